"""`Loop`: trains a model with one of the three trainers, evaluates, checkpoints, logs.

One step of the loop, at global step ``k`` (the number of steps already taken):

1. take batch ``k`` of ``inputs.train_stream(start_step=...)`` (streams are deterministic
   per step, so the step alone is the data position);
2. ``trainer.one_step(batch, fold_in(rng, k), step=k, learning_rate=schedule(k))``; the
   key is derived on the device from a step counter kept there (`step_key`), so a step
   sends nothing from the host to the devices but what the trainer sends;
   with ``accumulate_steps > 1``, once per micro-batch (`accumulated_step`);
3. stop with `NonFiniteLossError` if the loss is NaN or inf (nothing is saved after it);
4. ``k += 1``; log train metrics every ``LogConfig.every`` steps, evaluate every
   ``EvalConfig.every`` steps and save a checkpoint every ``CheckpointConfig.every`` steps.

The schedule is optional: without one (``RunConfig.schedule = None``) the trainer keeps
the optimizer's own learning rate.

At the end (and when SIGINT/SIGTERM/SIGHUP asked to stop) it saves a checkpoint, evaluates if the
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
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax
import tqdm

from revtrain.data.inputs import Inputs
from revtrain.trainers.common.protocols import Trainer as TrainerProtocol
from revtrain.training.accumulation import accumulated_step, check_accumulate_steps
from revtrain.training.barriers import barrier
from revtrain.training.checkpoints.checkpointer import Checkpointer
from revtrain.training.checkpoints.resume import checkpoint_tree, restore_template, resume
from revtrain.training.config import CheckpointConfig, EvalConfig, LogConfig
from revtrain.training.evaluation import Evaluator, eval_batches
from revtrain.training.interrupts import StopOnSignals
from revtrain.training.loop_metrics import BarWithLogging, Window, fmt, model_summary, tokens
from revtrain.training.metrics_writer import MetricsWriter
from revtrain.training.run_directory import PROFILE_DIR

logger = logging.getLogger(__name__)


@jax.jit
def step_key(rng: jax.Array, step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(fold_in(rng, step), step + 1)`` for a uint32 ``step`` that lives on the device:
    the key of one step and the counter of the next, with no host value involved."""
    return jax.random.fold_in(rng, step), step + 1


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or inf; the message names the step."""


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
      init_checkpointer: where to warm-start from when ``checkpointer`` holds no
        checkpoint yet (``CheckpointConfig.init_checkpoint_dir``); None starts from the
        initial values.
      writer: writes ``metrics.jsonl`` and TensorBoard; None writes nothing.
      schedule: ``step -> learning rate``; None keeps the optimizer's own rate.
      eval_config: when and how much to evaluate (`EvalConfig`).
      checkpoint: ``every`` (0: only at the end), ``restore_step`` and
        ``init_weights_only`` of `CheckpointConfig` (retention is the checkpointer's).
      log: train-metric interval, progress bar and profiled steps (`LogConfig`).
      seed: seeds the per-step rngs (as in `RunConfig`).
      accumulate_steps: micro-batches per step, one ``one_step`` each (`accumulated_step`).

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

    def __init__(self, trainer: TrainerProtocol, inputs: Inputs, model: Any, evaluator: Evaluator,
                 splits: Mapping[str, Inputs] | None = None, *,
                 checkpointer: Checkpointer | None = None,
                 init_checkpointer: Checkpointer | None = None,
                 writer: MetricsWriter | None = None, schedule: optax.Schedule | None = None,
                 eval_config: EvalConfig | None = None,
                 checkpoint: CheckpointConfig | None = None,
                 log: LogConfig | None = None, seed: int = 0, accumulate_steps: int = 1):
        self.trainer, self.inputs, self._built = trainer, inputs, model
        self.accumulate_steps = check_accumulate_steps(accumulate_steps)
        self.model = model.model
        self._evaluator = evaluator
        self._splits = dict(splits or {"eval": inputs})
        self._checkpointer, self._init_checkpointer = checkpointer, init_checkpointer
        self._writer = writer or MetricsWriter(None)
        self._schedule = schedule
        self.eval_config = eval_config or EvalConfig()
        self.checkpoint_config = checkpoint or CheckpointConfig()
        self.checkpoint_every = self.checkpoint_config.every
        log = log or LogConfig()
        self.log_every = log.every or self.eval_config.every or 100
        self._progress = log.progress
        self._profile_steps = log.profile_steps
        self._tracing = False
        self._byte_level = inputs.byte_level
        self.interrupted_by: int | None = None
        self.last_eval_metrics: dict[str, float] = {}
        self._last_eval_step: int | None = None
        _, self._rng = jax.random.split(jax.random.key(seed))
        self.step = 0
        self._key_step: tuple[int, jax.Array] | None = None  # (step, its device counter)
        self.restored_step: int | None = None
        try:
            self._restore()
        except BaseException:
            self.close()  # Joins orbax's threads: no tracebacks from them at exit.
            raise
        barrier("revtrain_loop_restored")  # Every process starts from the same step.
        self.summary = model_summary(model.flat_layers)
        logger.info("%s", self.summary)
        self._writer.write_text("model_summary", self.summary, self.step)

    @property
    def output_dir(self) -> str | None:
        """The run directory (the checkpointer's parent), or None."""
        if self._checkpointer is None:
            return None
        return os.path.dirname(self._checkpointer.directory)

    # ----------------------------------------------------------------------------------
    # Set-up and checkpoints.

    def _checkpoint_tree(self) -> dict[str, Any]:
        return checkpoint_tree(self.trainer, self.step, self._rng)

    def _restore_template(self) -> dict[str, Any]:
        return restore_template(self.trainer, self._rng)

    def _restore(self) -> None:
        """Restores the run's checkpoint or warm-starts (`revtrain.training.checkpoints.resume`)."""
        self.step, self._rng, self.restored_step = resume(
            self.trainer, self._checkpointer, self._init_checkpointer,
            self.checkpoint_config, self._rng)

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

        Stops early, after saving a checkpoint, when SIGINT, SIGTERM or SIGHUP arrives (then
        `interrupted_by` is set). The signal handlers stay installed until the final save
        has committed (an asynchronous one is waited for): a SIGTERM during the save, or
        a repeated one, is absorbed and the save completes (`StopOnSignals`); a signal that
        arrives during the final save of a finished run sets `interrupted_by` and skips
        the final evaluation, and one during that evaluation lets it finish. Returns
        `last_eval_metrics` (possibly from the final evaluation it runs when the last step
        was not evaluated).

        Raises:
          NonFiniteLossError: the loss of a step was NaN or inf; no checkpoint is written
            after that step, so the newest checkpoint is the last good one.
          KeyboardInterrupt: a second Ctrl-C (the newest committed checkpoint stays valid).
        """
        self.interrupted_by = None
        if self.step >= steps:
            logger.info("already at step %d >= steps=%d; nothing to train", self.step, steps)
        stream = self.inputs.train_stream(start_step=self.step)
        window = Window()
        with StopOnSignals() as stop:
            try:
                with self._progress_bar(steps) as bar:
                    while self.step < steps:
                        self._train_step(stream, window)
                        bar.update(1)
                        self._after_step(steps, window, bar)
                        if stop.requested():
                            logger.warning("stopping after step %d on signal %d",
                                           self.step, stop.signum)
                            break
            finally:
                self._stop_trace()
            self._check_finite(window)
            self.save()
            if self._checkpointer is not None:
                self._checkpointer.wait_until_finished()  # Committed before handlers go.
            # Every process asks (one all-gather), so all of them skip or run the eval.
            self.interrupted_by = stop.signum if stop.requested() else None
            if (self.interrupted_by is None and self.eval_config.enabled
                    and self._last_eval_step != self.step):
                self.evaluate()
        self._writer.flush()
        return self.last_eval_metrics

    def _train_step(self, stream: Any, window: Window) -> None:
        """One step, without waiting for the device (losses are read on logging steps)."""
        start = time.perf_counter()
        batch = next(stream)
        self._check_batch(batch)
        lr = None if self._schedule is None else self._rate(self.step)
        rng = self._step_rng()
        if self._profile_steps and self.step + 1 == self._profile_steps[0]:
            jax.profiler.start_trace(os.path.join(self.output_dir or ".", PROFILE_DIR))
            self._tracing = True
        with jax.profiler.StepTraceAnnotation("train", step_num=self.step):
            loss, stats = accumulated_step(self.trainer, batch, rng, self.step, lr,
                                           self.accumulate_steps)
        self.step += 1
        window.add(self.step, loss, stats, tokens(batch), start)
        if self._tracing and self.step >= self._profile_steps[1]:
            self._stop_trace()

    def _step_rng(self) -> jax.Array:
        """``fold_in(rng, step)`` from the device step counter; the counter is put on the
        device (explicitly) only when ``step`` was set from outside, e.g. by a restore."""
        if self._key_step is None or self._key_step[0] != self.step:
            self._key_step = (self.step, jax.device_put(np.uint32(self.step)))
        rng, counter = step_key(self._rng, self._key_step[1])
        self._key_step = (self.step + 1, counter)
        return rng

    def _stop_trace(self) -> None:
        if self._tracing:
            jax.profiler.stop_trace()
            self._tracing = False

    def _rate(self, step: int) -> float:
        """The schedule's learning rate for ``step``, computed on the host CPU: optax and
        revtrain schedules use jnp, and reading a value back from an accelerator on every
        step would make each step wait for the device."""
        # Host memory only (the CPU device), so the guard of accelerator transfers is off.
        with (jax.default_device(jax.local_devices(backend="cpu")[0]),
              jax.transfer_guard("allow")):
            return float(self._schedule(step))

    def _check_batch(self, batch: Any) -> None:
        """Raises when a batch's shapes differ from the first batch's (a silent recompile)."""
        first_signature = tuple((tuple(s.shape), np.dtype(s.dtype))
                                for s in self._built.batch_signature)
        if tuple((tuple(np.shape(x)), np.result_type(x)) for x in batch) == first_signature:
            return  # Every step: compare tuples, format only on a mismatch.
        found = ", ".join(f"{np.result_type(x).name}{list(np.shape(x))}" for x in batch)
        first = ", ".join(f"{d.name}{list(shape)}" for shape, d in first_signature)
        raise ValueError(f"the train batch of step {self.step + 1} is ({found}); the first "
                         f"batch was ({first}); every batch must have the first's shapes "
                         f"(pad a short last batch) or each change recompiles")

    def _check_finite(self, window: Window) -> None:
        """Reads the window's pending losses back; raises on the first NaN or inf."""
        bad = window.first_non_finite()
        if bad is None:
            return
        where = ("" if self._checkpointer is None else
                 f"; the newest checkpoint in {self._checkpointer.directory} (step "
                 f"{self._checkpointer.latest_step()}) is untouched")
        raise NonFiniteLossError(
            f"loss is {bad[1]} at step {bad[0]}; stopped without saving{where}; lower the "
            f"learning rate or set optimizer_fn.clip_gradient_norm")

    def _after_step(self, steps: int, window: Window, bar: Any) -> None:
        log_now = self.step % self.log_every == 0 or self.step == steps
        every = self.eval_config.every
        eval_now = bool(every and self.eval_config.enabled and self.step % every == 0)
        save_now = bool(self.checkpoint_every and self.step % self.checkpoint_every == 0)
        if log_now or eval_now or save_now:
            self._check_finite(window)  # The only device sync of ordinary training.
        if log_now:
            metrics = window.metrics(self._byte_level)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
            self._write("train", metrics)
            window.reset()
        if eval_now:
            self.evaluate()
        if save_now:
            self.save()

    def _progress_bar(self, steps: int) -> Any:
        enabled = self._progress
        if enabled is None:
            enabled = sys.stderr.isatty()
        enabled = enabled and jax.process_index() == 0
        bar = tqdm.tqdm(total=steps, initial=min(self.step, steps), disable=not enabled,
                        desc="train", unit="step", dynamic_ncols=True)
        return BarWithLogging(bar) if enabled else bar

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
        return (self._built.nest(self.trainer.host_values("weights")),
                self._built.nest(self.trainer.host_values("state")))

    @property
    def batch_signature(self) -> Any:
        """``ShapeDtype`` signature of a train batch ``(inputs, targets, weights)``."""
        return self._built.batch_signature

    def _write(self, split: str, metrics: Mapping[str, float]) -> None:
        self._writer.write(self.step, split, metrics)
        text = " ".join(f"{k} {fmt(v)}" for k, v in metrics.items())
        logger.info("step %d %s: %s", self.step, split, text)

    def close(self) -> None:
        """Finishes pending checkpoint saves and closes the metric writers.

        Every part is closed even when one fails; the first failure is raised after.

        Raises:
          CheckpointSaveError: an asynchronous save failed (names the step and what is
            intact).
          RunWriteError: the metric writers could not flush (e.g. a full disk).
        """
        closers = [self._stop_trace]
        closers += [c.close for c in (self._checkpointer, self._init_checkpointer)
                    if c is not None]  # Waits for an asynchronous save.
        first = None
        for close in [*closers, self._writer.close]:
            try:
                close()
            except Exception as e:  # noqa: BLE001  Close the rest, then raise the first.
                first = first or e
        barrier("revtrain_loop_closed")  # No process exits while another still saves.
        if first is not None:
            raise first

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
