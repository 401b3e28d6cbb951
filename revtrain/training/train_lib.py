"""`train`: the gin-configurable entry point of ``revtrain-train`` (as Trax's ``train``).

``revtrain.configurables`` registers `train` with gin under the name ``train``, so a config
sets its arguments as ``train.steps = 1000`` or ``train.model = @ReversibleTransformerLM``
and ``--gin_bindings='train.steps=20'`` overrides them. `make_loop` takes the same
arguments minus ``steps`` and is what ``revtrain-eval`` and ``revtrain-decode`` use to rebuild
a run from its ``config.gin``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax

from revtrain.data.inputs import Inputs
from revtrain.layers import Layer
from revtrain.trainers import Trainer
from revtrain.training.loop import Loop
from revtrain.training.optimizers import optimizer_fn
from revtrain.training.run_lock import RunLock
from revtrain.training.validation import check_train_arguments


def make_loop(output_dir: str | None = None, model: Callable[..., Layer] | None = None,
              inputs: Inputs | Callable[[], Inputs] | None = None,
              optimizer: Callable[[], optax.GradientTransformation] = optimizer_fn,
              trainer_class: Callable[..., Any] = Trainer,
              learning_rate: float | optax.Schedule | None = 1e-3,
              loss: Layer | Callable[[], Layer] | None = None, eval_every: int = 100,
              eval_steps: int = 10, checkpoint_every: int = 100, max_to_keep: int | None = 3,
              keep_period: int | None = None, keep_time_interval: float | None = None,
              log_every: int | None = None, seed: int = 0, n_devices: int | None = None,
              trainer_kwargs: Mapping[str, Any] | None = None,
              progress: bool | None = None) -> Loop:
    """Builds the `Loop` of a run (restoring ``output_dir``'s newest checkpoint, if any).

    Arguments are `Loop`'s; ``model`` and ``inputs`` are required.

    Raises:
      ValueError: when ``model`` or ``inputs`` is missing.
    """
    if model is None or inputs is None:
        missing = "train.model" if model is None else "train.inputs"
        raise ValueError(f"{missing} is not set; bind it in the gin config, e.g. "
                         f"train.model = @ReversibleTransformerLM and train.inputs = "
                         f"@TextFiles")
    return Loop(model, inputs, optimizer, trainer_class=trainer_class, loss=loss,
                learning_rate=learning_rate, output_dir=output_dir, eval_every=eval_every,
                eval_steps=eval_steps, checkpoint_every=checkpoint_every,
                max_to_keep=max_to_keep, keep_period=keep_period,
                keep_time_interval=keep_time_interval, log_every=log_every, seed=seed,
                n_devices=n_devices, trainer_kwargs=trainer_kwargs, progress=progress)


def train(output_dir: str | None = None, model: Callable[..., Layer] | None = None,
          inputs: Inputs | Callable[[], Inputs] | None = None,
          optimizer: Callable[[], optax.GradientTransformation] = optimizer_fn,
          trainer_class: Callable[..., Any] = Trainer,
          learning_rate: float | optax.Schedule | None = 1e-3,
          loss: Layer | Callable[[], Layer] | None = None, steps: int = 1000,
          eval_every: int = 100, eval_steps: int = 10, checkpoint_every: int = 100,
          max_to_keep: int | None = 3, keep_period: int | None = None,
          keep_time_interval: float | None = None, log_every: int | None = None,
          seed: int = 0, n_devices: int | None = None,
          trainer_kwargs: Mapping[str, Any] | None = None,
          progress: bool | None = None,
          callbacks: Sequence[Callable[[Loop], None]] = ()) -> Loop:
    """Trains ``model`` on ``inputs`` to ``steps`` total steps; returns the finished `Loop`.

    Restores the newest checkpoint in ``output_dir`` first, so calling it again with more
    ``steps`` continues the run (Trax's ``train`` semantics). The loop is closed (pending
    checkpoint writes finished) before returning or raising.

    Args:
      output_dir: directory for checkpoints, ``metrics.jsonl`` and TensorBoard files.
      model: model function called with ``mode='train'`` / ``mode='eval'``.
      inputs: an `Inputs` or a function returning one (e.g. the class ``TextFiles``).
      optimizer: ``() -> optax.GradientTransformation`` (default `optimizer_fn`).
      trainer_class: `Trainer`, `ReversibleSerialTrainer` or `MemoryEfficientTrainer`.
      learning_rate: a float or a schedule (``@warmup_rsqrt_decay()`` in gin).
      loss: loss layer or its class; default ``WeightedCategoryCrossEntropy``.
      steps: total number of training steps.
      eval_every, eval_steps, checkpoint_every, max_to_keep, keep_period,
        keep_time_interval, log_every, seed, n_devices, trainer_kwargs, progress: as in
        `Loop`.
      callbacks: functions called with the `Loop` once it is built (and has restored the
        newest checkpoint), before training; the CLI writes ``config.gin`` in one.

    Returns:
      The `Loop` after `Loop.run`: ``last_eval_metrics``, ``step``, ``interrupted_by``.

    Validates before it writes: the numeric arguments (`check_train_arguments`), then
    the output directory and its lock, then (in `Loop`) the first batch against the model
    and the devices; only then are checkpoints, metrics and callbacks' files written. The
    chief process holds a `RunLock` on ``output_dir`` throughout: a second ``train`` on
    the same directory is refused while this one runs.

    Raises:
      NonFiniteLossError: when the loss became NaN or inf.
      RunLockError: when another process is training in ``output_dir``.
      ValueError: for a missing model/inputs, an argument out of range, data that does not
        fit the model or the devices, or a checkpoint that does not match the model.
    """
    kwargs = dict(locals())
    check_train_arguments(kwargs)
    steps, callbacks = kwargs.pop("steps"), kwargs.pop("callbacks")
    with _run_lock(output_dir):
        loop = make_loop(**kwargs)
        try:
            for callback in callbacks:
                callback(loop)
            loop.run(steps)
        finally:
            loop.close()
    return loop


def _run_lock(output_dir: str | None) -> contextlib.AbstractContextManager:
    """The chief process's `RunLock` on ``output_dir`` (nothing to lock without one)."""
    if output_dir is None or jax.process_index() != 0:
        return contextlib.nullcontext()
    return RunLock(output_dir)


def loop_arguments(bindings: Mapping[str, Any]) -> dict[str, Any]:
    """`make_loop` keyword arguments from ``train``'s gin bindings (``steps`` dropped)."""
    names = set(inspect.signature(make_loop).parameters)
    return {k: v for k, v in bindings.items() if k in names}
