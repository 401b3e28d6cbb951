"""`Loop`: trains a model with one of the three trainers, evaluates, checkpoints, logs.

One step of the loop, at global step ``k`` (the number of steps already taken):

1. take batch ``k`` of ``inputs.train_stream(start_step=...)`` (streams are deterministic
   per step, so the step alone is the data position);
2. ``trainer.one_step(batch, fold_in(rng, k), step=k, learning_rate=schedule(k))``;
3. stop with `NonFiniteLossError` if the loss is NaN or inf (nothing is saved after it);
4. ``k += 1``; log train metrics every ``LogConfig.every`` steps, evaluate every
   ``EvalConfig.every`` steps and save a checkpoint every ``CheckpointConfig.every`` steps.

The schedule is optional: without one (``RunConfig.schedule = None``) the trainer keeps
the optimizer's own learning rate.

At the end (and when SIGINT/SIGTERM asked to stop) it saves a checkpoint, evaluates if the
last step was not evaluated yet, and returns the last eval metrics. On construction it
restores the newest checkpoint of ``output_dir`` -- weights, optimizer slots, layer state,
step and rng -- so ``run(20)`` then ``run(30)`` (even in a new process) ends with the same
weights as ``run(30)``, as with Trax's ``train`` whose ``steps`` is the total step count.
A checkpoint that cannot be read is skipped with a warning (`Checkpointer.restore`).
`revtrain.training.builder.build_loop` checks the first batch against the model and the
devices before anything is written (`revtrain.training.validation`).

All trainers see the model as the flat layer list of ``extract_reversible_blocks`` (the
plain `Trainer` gets ``Serial`` of it), so every trainer gives layer ``i`` the same rng and
checkpoints' ``weights`` have the same structure for all three.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from revtrain.data.inputs import Inputs
from revtrain.layers import Layer, Serial
from revtrain.trainers import Trainer, TrainState, blocks_to_layers, extract_reversible_blocks
from revtrain.training.checkpoints import Checkpointer
from revtrain.training.config import EvalConfig, LogConfig
from revtrain.training.evaluation import Evaluator, bits_per_byte, eval_batches
from revtrain.training.interrupts import StopOnSignals
from revtrain.training.metrics_writer import MetricsWriter

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or inf; the message names the step."""


def build_trainer(trainer_class: Callable[..., Any], model: Layer, loss_layer: Layer,
                  optimizer_fn: Callable[[], optax.GradientTransformation],
                  n_devices: int | None = None, **trainer_kwargs: Any) -> Any:
    """Builds ``trainer_class`` for an initialised ``model`` followed by ``loss_layer``.

    `Trainer` (or a subclass) gets ``Serial(*flat_layers)``; any other class is called as
    the block trainers are, ``trainer_class(blocks, loss_layer, optimizer_fn, n_devices,
    **trainer_kwargs)``, with ``blocks, loss_layer = extract_reversible_blocks([model,
    loss_layer])``.
    """
    blocks, loss = extract_reversible_blocks([model, loss_layer])
    if isinstance(trainer_class, type) and issubclass(trainer_class, Trainer):
        return trainer_class(Serial(*blocks_to_layers(blocks, loss)), optimizer_fn,
                             n_devices=n_devices, **trainer_kwargs)
    return trainer_class(blocks, loss, optimizer_fn, n_devices=n_devices, **trainer_kwargs)


def _global_l2(stats: Mapping[str, Any], name: str) -> float | None:
    """``stats[name]``, or the L2 norm over all ``layer{i}/{name}`` entries."""
    if name in stats:
        return float(stats[name])
    parts = [float(v) ** 2 for k, v in stats.items() if k.endswith("/" + name)]
    return math.sqrt(sum(parts)) if parts else None


class Loop:
    """Runs training steps, evaluation, checkpointing and metric logging.

    A `Loop` is given its collaborators; `revtrain.training.builder.build_loop` builds them
    from a run's configuration.

    Args:
      trainer: a trainer of ``model`` (`Trainer`, `ReversibleSerialTrainer` or
        `MemoryEfficientTrainer`); the loop reads and restores its ``train_state``.
      inputs: the run's data (train batches; the ``'eval'`` split).
      model: the `revtrain.training.builder.BuiltModel` the trainer was built from.
      evaluator: scores the eval-mode model (`Evaluator`).
      splits: eval split name -> `Inputs`; default ``{'eval': inputs}``.
      checkpointer: saves and restores checkpoints; None keeps none.
      writer: writes ``metrics.jsonl`` and TensorBoard; None writes nothing.
      schedule: ``step -> learning rate``; None keeps the optimizer's own rate.
      eval_config: when and how much to evaluate (`EvalConfig`).
      checkpoint_every: save every this many steps (0: only at the end).
      log: train-metric interval and progress bar (`LogConfig`).
      seed: seeds the per-step rngs (as in `RunConfig`).

    Attributes:
      step: the number of steps taken (restored from the checkpoint).
      trainer: the trainer.
      model: the training model. Its layer objects keep their initial values: the
        trainer owns the trained ones (``trainer.train_state``; `model_values` gives them
        in the model's structure; ``trainer.sync_to()`` writes them into the layers).
      interrupted_by: the signal number that stopped the last `run`, or None.
      last_eval_metrics: the metrics of the last evaluation of split ``'eval'`` ({}
        before any).
      restored_step: the step of the checkpoint restored on construction, or None.
    """

    def __init__(self, trainer: Any, inputs: Inputs, model: Any, evaluator: Evaluator,
                 splits: Mapping[str, Inputs] | None = None, *,
                 checkpointer: Checkpointer | None = None,
                 writer: MetricsWriter | None = None,
                 schedule: optax.Schedule | None = None,
                 eval_config: EvalConfig | None = None, checkpoint_every: int = 100,
                 log: LogConfig | None = None, seed: int = 0):
        self.trainer, self.inputs, self._built = trainer, inputs, model
        self.model, self._flat_layers = model.model, model.flat_layers
        self._evaluator = evaluator
        self._splits = dict(splits or {"eval": inputs})
        self._checkpointer = checkpointer
        self._writer = writer or MetricsWriter(None)
        self._schedule = schedule
        self.eval_config = eval_config or EvalConfig()
        self.checkpoint_every = checkpoint_every
        log = log or LogConfig()
        self.log_every = log.every or self.eval_config.every or 100
        self._progress = log.progress
        self._byte_level = inputs.byte_level
        self.interrupted_by: int | None = None
        self.last_eval_metrics: dict[str, float] = {}
        self._last_eval_step: int | None = None
        _, self._rng = jax.random.split(jax.random.key(seed))
        self.step = 0
        self.restored_step: int | None = None
        try:
            self._restore()
        except BaseException:
            self.close()  # Joins orbax's threads: no tracebacks from them at exit.
            raise

    @property
    def output_dir(self) -> str | None:
        """The run directory (the checkpointer's parent), or None."""
        if self._checkpointer is None:
            return None
        return os.path.dirname(self._checkpointer.directory)

    # ----------------------------------------------------------------------------------
    # Set-up and checkpoints.

    def _checkpoint_tree(self) -> dict[str, Any]:
        values = self.trainer.train_state
        return {"weights": values.weights, "state": values.state, "slots": values.slots,
                "step": np.asarray(self.step, np.int64),
                "rng": np.asarray(jax.random.key_data(self._rng))}

    def _restore(self) -> None:
        if self._checkpointer is None or self._checkpointer.latest_step() is None:
            return
        tree = self._checkpointer.restore(self._checkpoint_tree())
        self.trainer.restore(TrainState(tree["weights"], tree["state"], tree["slots"]))
        self.step = int(tree["step"])
        self._rng = jax.random.wrap_key_data(tree["rng"])
        self.restored_step = self.step
        logger.info("restored the checkpoint of step %d from %s", self.step,
                    self._checkpointer.directory)

    def save(self) -> bool:
        """Saves a checkpoint of the current step (no-op without ``output_dir``)."""
        if self._checkpointer is None:
            return False
        saved = self._checkpointer.save(self.step, self._checkpoint_tree())
        if saved:
            logger.info("saved the checkpoint of step %d", self.step)
        return saved

    # ----------------------------------------------------------------------------------
    # Training.

    def run(self, steps: int) -> dict[str, float]:
        """Trains until ``steps`` steps in total have been taken; returns eval metrics.

        Stops early, after saving a checkpoint, when SIGINT or SIGTERM arrives (then
        `interrupted_by` is set). Returns `last_eval_metrics` (possibly from the final
        evaluation it runs when the last step was not evaluated).

        Raises:
          NonFiniteLossError: the loss of a step was NaN or inf; no checkpoint is written
            after that step, so the newest checkpoint is the last good one.
        """
        self.interrupted_by = None
        if self.step >= steps:
            logger.info("already at step %d >= steps=%d; nothing to train", self.step, steps)
        stream = self.inputs.train_stream(start_step=self.step)
        with StopOnSignals() as stop, self._progress_bar(steps) as bar:
            window = _Window()
            while self.step < steps:
                self._train_step(stream, window)
                bar.update(1)
                self._after_step(steps, window, bar)
                if stop.requested():
                    self.interrupted_by = stop.signum
                    logger.warning("stopping after step %d on signal %d", self.step,
                                   stop.signum)
                    break
        self.save()
        if (self.interrupted_by is None and self.eval_config.enabled
                and self._last_eval_step != self.step):
            self.evaluate()
        self._writer.flush()
        return self.last_eval_metrics

    def _train_step(self, stream: Any, window: _Window) -> None:
        start = time.perf_counter()
        batch = next(stream)
        lr = None if self._schedule is None else float(self._schedule(self.step))
        rng = jax.random.fold_in(self._rng, self.step)
        loss, stats = self.trainer.one_step(batch, rng, step=self.step, learning_rate=lr)
        loss = float(loss)
        if not math.isfinite(loss):
            where = ("" if self._checkpointer is None else
                     f"; the newest checkpoint in {self._checkpointer.directory} (step "
                     f"{self._checkpointer.latest_step()}) is untouched")
            raise NonFiniteLossError(
                f"loss is {loss} at step {self.step + 1}; stopped without saving{where}; "
                f"lower the learning rate or set optimizer_fn.clip_gradient_norm")
        self.step += 1
        window.add(loss, stats, _tokens(batch), time.perf_counter() - start)

    def _after_step(self, steps: int, window: _Window, bar: Any) -> None:
        if self.step % self.log_every == 0 or self.step == steps:
            metrics = window.metrics(self._byte_level)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
            self._write("train", metrics)
            window.reset()
        every = self.eval_config.every
        if every and self.eval_config.enabled and self.step % every == 0:
            self.evaluate()
        if self.checkpoint_every and self.step % self.checkpoint_every == 0:
            self.save()

    def _progress_bar(self, steps: int) -> Any:
        enabled = self._progress
        if enabled is None:
            enabled = sys.stderr.isatty()
        enabled = enabled and jax.process_index() == 0
        bar = tqdm.tqdm(total=steps, initial=min(self.step, steps), disable=not enabled,
                        desc="train", unit="step", dynamic_ncols=True)
        return _BarWithLogging(bar) if enabled else bar

    # ----------------------------------------------------------------------------------
    # Evaluation and metrics.

    def evaluate(self, write: bool = True) -> dict[str, float]:
        """Evaluates the current values on every split (and on a train batch if asked).

        Each split ``name`` is scored on ``EvalConfig.steps`` batches (None: one exact
        pass) and written as split ``name``; with ``EvalConfig.eval_train``, the eval-mode
        model is also scored on the current step's train batch (split ``'eval_train'``).

        Returns:
          The ``'eval'`` split's ``{'loss', 'accuracy'}`` (plus ``'bits_per_byte'`` for
          byte-level data) as floats.
        """
        weights, state = self.model_values()
        results = {}
        for name, inputs in self._splits.items():
            batches = eval_batches(inputs, self.eval_config.steps)
            results[name] = self._evaluator.evaluate(weights, state, batches)
        if self.eval_config.eval_train:
            batch = next(iter(self.inputs.train_stream(start_step=self.step)))
            results["eval_train"] = self._evaluator.evaluate(weights, state, [batch])
        if write:
            for name, metrics in results.items():
                self._write(name, metrics)
        self.last_eval_metrics = results["eval"]
        self._last_eval_step = self.step
        return self.last_eval_metrics

    def model_values(self) -> tuple[Any, Any]:
        """The trainer's current ``(weights, state)`` in the model's tree structure.

        Read from the trainer (`TrainState`), never from the layer objects, which keep
        their initial values unless ``trainer.sync_to()`` is called.
        """
        values = self.trainer.train_state
        return self._built.nest(values.weights), self._built.nest(values.state)

    @property
    def batch_signature(self) -> Any:
        """``ShapeDtype`` signature of a train batch ``(inputs, targets, weights)``."""
        return self._built.batch_signature

    def _write(self, split: str, metrics: Mapping[str, float]) -> None:
        self._writer.write(self.step, split, metrics)
        text = " ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
        logger.info("step %d %s: %s", self.step, split, text)

    def close(self) -> None:
        """Finishes pending checkpoint saves and closes the metric writers."""
        if self._checkpointer is not None:
            self._checkpointer.close()
        self._writer.close()

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _fmt(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


def _tokens(batch: Any) -> tuple[int, str]:
    """``(count, unit)`` of a batch across processes: tokens for sequences, else examples."""
    inputs = np.asarray(batch[0])
    if inputs.ndim == 2 and np.issubdtype(inputs.dtype, np.integer):
        return inputs.size * jax.process_count(), "tokens"
    return inputs.shape[0] * jax.process_count(), "examples"


class _Window:
    """Train metrics accumulated since the last log line."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.losses: list[float] = []
        self.seconds = 0.0
        self.count, self.unit = 0, "tokens"
        self.stats: Mapping[str, Any] = {}

    def add(self, loss: float, stats: Mapping[str, Any], tokens: tuple[int, str],
            seconds: float) -> None:
        self.losses.append(loss)
        self.stats = stats
        self.count += tokens[0]
        self.unit = tokens[1]
        self.seconds += seconds

    def metrics(self, byte_level: bool) -> dict[str, float]:
        loss = float(np.mean(self.losses))
        metrics = {"loss": loss}
        if byte_level:
            metrics["bits_per_byte"] = bits_per_byte(loss)
        if "learning_rate" in self.stats:
            metrics["learning_rate"] = float(self.stats["learning_rate"])
        for name in ("gradients_l2", "weights_l2"):
            value = _global_l2(self.stats, name)
            if value is not None:
                metrics[name] = value
        seconds = max(self.seconds, 1e-9)
        metrics["steps_per_second"] = len(self.losses) / seconds
        metrics[f"{self.unit}_per_second"] = self.count / seconds
        return metrics


class _BarWithLogging:
    """A tqdm bar that routes log lines through ``tqdm.write`` while it is open."""

    def __init__(self, bar: Any):
        self._bar = bar
        self._redirect = logging_redirect_tqdm(
            loggers=[logging.getLogger(), logging.getLogger("revtrain")])

    def __enter__(self) -> Any:
        self._redirect.__enter__()
        return self._bar

    def __exit__(self, *exc_info) -> None:
        self._bar.close()
        self._redirect.__exit__(*exc_info)
