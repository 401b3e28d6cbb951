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
