"""The names of the files and folders of a run directory (``output_dir``), in one place.

::

    output_dir/
      config.gin                 the latest run's operative gin config (`CONFIG_FILE`)
      config_history/<UTC>.gin   every run's config, never overwritten (`HISTORY_DIR`)
      run.lock                   held while a training job runs (`LOCK_FILE`)
      tokenizer.json             which tokenizer made the tokens (`TOKENIZER_FILE`)
      tokenizer.model            a copy of its SentencePiece model (`TOKENIZER_MODEL_FILE`)
      checkpoints/<step>/        orbax step directories (`CHECKPOINT_DIR`)
      checkpoints/retention.json what earlier runs kept permanently (`RETENTION_FILE`)
      checkpoints_unreadable/    damaged checkpoints set aside (`UNREADABLE_SUFFIX`)
      metrics.jsonl              one JSON record per split and step (`METRICS_FILE`)
      tensorboard/<split>/       TensorBoard event files (`TENSORBOARD_DIR`)
      tensorboard/config/        the operative config as TensorBoard text
      decoder_out/step_<N>.jsonl revtrain-decode's continuations (`DECODER_DIR`)
      profile/                   profiler traces of ``LogConfig.profile_steps``

A directory flag (``--output_dir``, ``--log_dir``, ``CheckpointConfig.init_checkpoint_dir``)
that is, or lies under, a symbolic link to a missing target is refused in one line naming
the link and the target (`broken_link_error`); the OS would only say "File exists" or "No
such file".
"""

import os

CONFIG_FILE = "config.gin"
HISTORY_DIR = "config_history"
LOCK_FILE = "run.lock"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_MODEL_FILE = "tokenizer.model"
CHECKPOINT_DIR = "checkpoints"
RETENTION_FILE = "retention.json"
UNREADABLE_SUFFIX = "_unreadable"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_CONFIG_DIR = os.path.join(TENSORBOARD_DIR, "config")
DECODER_DIR = "decoder_out"
PROFILE_DIR = "profile"


def broken_link(path: str) -> tuple[str, str] | None:
    """``(link, target)`` for the symbolic link, ``path`` itself or one of its parents,
    whose target does not exist (or is a loop of links); None when there is none."""
    path = os.path.abspath(path)
    while True:
        if os.path.islink(path) and not os.path.exists(path):
            target = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
            return path, target
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def broken_link_error(flag: str, path: str) -> str | None:
    """The one-line error for a directory flag ``flag=path`` that is (or lies under) a
    symbolic link to a missing target, naming both and the fix; None when it is not."""
    found = broken_link(path)
    if found is None:
        return None
    link, target = found
    where = "" if link == os.path.abspath(path) else f" ({link} in it)"
    return (f"{flag}={path}{where} is a symbolic link to {target}, which does not exist; "
            f"create {target}, or give a {flag} that is not a broken link")
