"""`train`: the gin-configurable entry point of ``revtrain-train`` (as Trax's ``train``).

``revtrain.configurables`` registers `train` with gin under the name ``train`` and the run
configuration dataclasses (`revtrain.training.config`) under their class names, so a config
sets ``train.steps = 1000``, ``RunConfig.model = @ReversibleTransformerLM`` and
``EvalConfig.every = 250``; ``--gin_bindings='train.steps=20'`` overrides them. The other
tools rebuild the same run from its ``config.gin`` through the same dataclasses and
`revtrain.training.builder`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from revtrain.training.builder import build_loop
from revtrain.training.config import (
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    RunConfig,
    legacy_binding_error,
)
from revtrain.training.loop import Loop
from revtrain.training.run_lock import RunLock
from revtrain.training.validation import check_arguments

logger = logging.getLogger(__name__)


def train(output_dir: str | None = None, steps: int = 1000, run: RunConfig | None = None,
          eval_config: EvalConfig | None = None, checkpoint: CheckpointConfig | None = None,
          log: LogConfig | None = None,
          callbacks: Sequence[Callable[[Loop], None]] = (), **removed: Any) -> Loop:
    """Trains a run to ``steps`` total steps; returns the finished `Loop`.

    Restores the newest checkpoint in ``output_dir`` first, so calling it again with more
    ``steps`` continues the run (Trax's ``train`` semantics). The loop is closed (pending
    checkpoint writes finished) before returning or raising.

    Args:
      output_dir: directory for checkpoints, ``metrics.jsonl`` and TensorBoard files.
      steps: total number of training steps.
      run: the model, data and optimisation (`RunConfig`; ``RunConfig.*`` in gin).
      eval_config: evaluation (`EvalConfig`); default ``EvalConfig()``.
      checkpoint: checkpointing (`CheckpointConfig`); default ``CheckpointConfig()``.
      log: logging (`LogConfig`); default ``LogConfig()``.
      callbacks: functions called with the `Loop` once it is built (and has restored the
        newest checkpoint), before training; the CLI writes ``config.gin`` in one.
      **removed: the parameters ``train`` had before the run configuration
        (``train.eval_every`` and the like); any is an error naming its new binding.

    Returns:
      The `Loop` after `Loop.run`: ``last_eval_metrics``, ``step``, ``interrupted_by``.

    Validates before it writes: the numeric arguments (the dataclasses check theirs when
    built), then the output directory and its lock, then (in `build_loop`) the first batch
    against the model and the devices; only then are checkpoints, metrics and callbacks'
    files written. The chief process holds a `RunLock` on ``output_dir`` throughout: a
    second ``train`` on the same directory is refused while this one runs.

    Raises:
      NonFiniteLossError: when the loss became NaN or inf.
      RunLockError: when another process is training in ``output_dir``.
      ValueError: for a removed parameter, a missing model/inputs, an argument out of
        range, data that does not fit the model or the devices, or a checkpoint that does
        not match the model.
    """
    if removed:
        raise legacy_binding_error(sorted(removed))
    check_arguments({"steps": steps}, "train")
    run = run or RunConfig()
    run.check_complete()
    with _run_lock(output_dir):
        loop = build_loop(run, eval_config, checkpoint, log, output_dir)
        try:
            for callback in callbacks:
                callback(loop)
            loop.run(steps)
        except BaseException:
            try:
                loop.close()
            except Exception:  # noqa: BLE001  The first failure is the one to report.
                logger.debug("closing the loop after a failure also failed", exc_info=True)
            raise
        loop.close()
    return loop


def _run_lock(output_dir: str | None) -> contextlib.AbstractContextManager:
    """The chief process's `RunLock` on ``output_dir`` (nothing to lock without one)."""
    if output_dir is None or jax.process_index() != 0:
        return contextlib.nullcontext()
    return RunLock(output_dir)
