"""What a loop checkpoint holds, and how a run picks one up again (resume, warm start).

A loop checkpoint is ``{'weights', 'state', 'slots', 'step', 'rng'}``: the trainer's
`TrainState` parts as they live (`checkpoint_tree`), the number of steps taken and the
key data of the run's rng. `resume` restores the newest one of the run's own directory
(or ``CheckpointConfig.restore_step``), or, when there is none, warm-starts from
``CheckpointConfig.init_checkpoint_dir`` as Paxml's ``init_checkpoint`` does: weights and
state only (``init_weights_only``) or the full state. Templates are built from shapes
(`revtrain.training.checkpoints.restore_templates`), so nothing is copied to the host to restore.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from revtrain.trainers import TrainState
from revtrain.training.checkpoints.checkpointer import Checkpointer
from revtrain.training.checkpoints.restore_templates import checkpoint_template, host_template
from revtrain.training.config import CheckpointConfig

logger = logging.getLogger(__name__)


def checkpoint_tree(trainer: Any, step: int, rng: jax.Array) -> dict[str, Any]:
    """The trainer's values as they live (sharded ``jax.Array`` s are not gathered: each
    process saves its own shards), ``step`` and the key data of ``rng``."""
    values = {part: trainer.saved_values(part) for part in TrainState._fields}
    return {**values, "step": np.asarray(step, np.int64),
            "rng": np.asarray(jax.random.key_data(rng))}


def restore_template(trainer: Any, rng: jax.Array) -> dict[str, Any]:
    """`checkpoint_tree`'s structure from the trainer's shapes and shardings, no values:
    restoring reads each device's slices straight into the sharding the trainer wants,
    whatever device count or ``fsdp`` it was saved with."""
    return checkpoint_template(trainer, TrainState._fields, rng)


def _apply(trainer: Any, tree: Mapping[str, Any]) -> tuple[int, jax.Array]:
    """Gives the trainer a restored checkpoint's values; returns its step and rng."""
    trainer.restore(TrainState(tree["weights"], tree["state"], tree["slots"]))
    return int(tree["step"]), jax.random.wrap_key_data(jax.device_put(tree["rng"]))


def resume(trainer: Any, checkpointer: Checkpointer | None,
           init_checkpointer: Checkpointer | None, config: CheckpointConfig,
           rng: jax.Array) -> tuple[int, jax.Array, int | None]:
    """Restores ``config.restore_step`` (default: the newest checkpoint) of
    ``checkpointer`` into ``trainer``, or warm-starts from ``init_checkpointer`` when
    ``checkpointer`` holds none.

    Returns:
      ``(step, rng, restored_step)``: the run's step and rng after it (``0`` and ``rng``
      when nothing was restored, or after a weights-only warm start), and the step of the
      run's own restored checkpoint (None when there was none).

    Raises:
      FileNotFoundError: there is no checkpoint of ``config.restore_step``, or the warm
        start's source holds none.
      CheckpointMismatchError: a checkpoint holds another model.
    """
    if checkpointer is None:
        return 0, rng, None
    if checkpointer.latest_step() is None:
        if init_checkpointer is None:
            return 0, rng, None
        return (*warm_start(trainer, init_checkpointer, config.init_weights_only, rng), None)
    start = time.perf_counter()
    step, rng = _apply(trainer, checkpointer.restore(restore_template(trainer, rng),
                                                     config.restore_step))
    logger.info("restored the checkpoint of step %d from %s in %.2f s", step,
                checkpointer.directory, time.perf_counter() - start)
    return step, rng, step


def warm_start(trainer: Any, source: Checkpointer, weights_only: bool,
               rng: jax.Array) -> tuple[int, jax.Array]:
    """Paxml's ``init_checkpoint``: weights and state (or everything) of another run.

    With ``weights_only`` only weights and state are read and moved; the optimizer slots
    stay where they are. Returns the run's ``(step, rng)`` after it.

    Reads ``source``'s newest readable checkpoint (an unreadable one is skipped with a
    warning naming it, as the run's own are).

    Raises:
      FileNotFoundError: ``source`` holds no checkpoint.
      CheckpointUnreadableError: none of its checkpoints can be read.
    """
    if source.latest_step() is None:
        raise FileNotFoundError(f"CheckpointConfig.init_checkpoint_dir: {source.directory} "
                                f"holds no checkpoint; point it at a run's checkpoints")
    # The newest readable checkpoint, an unreadable one skipped with a warning.
    start = time.perf_counter()
    if weights_only:
        tree = source.restore_values({part: host_template(trainer, part)
                                      for part in ("weights", "state")})
        trainer.restore(TrainState(tree["weights"], tree["state"],
                                   trainer.saved_values("slots")))
        run_position = 0, rng
    else:
        run_position = _apply(trainer, source.restore(restore_template(trainer, rng)))
    logger.info("warm-started from the checkpoint of step %d in %s (%s) in %.2f s",
                source.restored_step, source.directory,
                "weights and state" if weights_only else "full state",
                time.perf_counter() - start)
    return run_position
