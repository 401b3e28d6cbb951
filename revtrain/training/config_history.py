"""The configuration of every run of an output directory is kept.

``revtrain-train`` writes its operative gin config twice: as ``output_dir/config.gin`` (the
latest run's, which ``revtrain-eval`` and ``revtrain-decode`` read) and as
``output_dir/config_history/<UTC start time>.gin``, which no later run overwrites. A resumed
run with changed bindings (more steps, another learning rate, or one that stopped on a NaN
loss) therefore leaves the record of what every earlier run used, as TensorBoard's
per-run ``hparams`` do.
"""

from __future__ import annotations

import datetime
import os

from revtrain.training.run_directory import CHECKPOINT_DIR, CONFIG_FILE, HISTORY_DIR
from revtrain.training.run_files import write_atomic
from revtrain.training.write_failures import reporting_write_failures


def write_run_config(output_dir: str, text: str,
                     started: datetime.datetime | None = None) -> str:
    """Writes ``text`` as ``config.gin`` and as a new file in ``config_history/``.

    Args:
      output_dir: the run directory (created if missing).
      text: the operative config.
      started: the run's start time (default: now), naming the history file
        ``YYYYmmddTHHMMSS.ffffffZ.gin`` so the files sort in start order.

    Returns:
      The path of the history file.

    Raises:
      RunWriteError: a file could not be written (e.g. a full disk, or a history file of
        the same start time exists); ``config.gin`` is then as it was.
    """
    started = started or datetime.datetime.now(datetime.UTC)
    history = os.path.join(output_dir, HISTORY_DIR)
    stamp = started.astimezone(datetime.UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    path = os.path.join(history, f"{stamp}.gin")
    checkpoints = os.path.join(output_dir, CHECKPOINT_DIR)
    with reporting_write_failures(f"write {path}", checkpoints):
        os.makedirs(history, exist_ok=True)
        write_atomic(path, text, overwrite=False)  # Never overwrites an earlier run's record.
    # Whole or not at all: a crash or a full disk never leaves half a config.gin.
    config = os.path.join(output_dir, CONFIG_FILE)
    with reporting_write_failures(f"write {config}", checkpoints):
        write_atomic(config, text)
    return path
