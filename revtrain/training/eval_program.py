"""Continuous evaluation of a run's checkpoints, as Paxml's separate eval program.

`CheckpointEvaluator` rebuilds a run's eval model from its configuration (no trainer, no
optimizer slots: `Checkpointer.restore_values` reads only weights and state) and scores
each complete checkpoint that has no eval record yet, in step order, writing
``metrics.jsonl`` records and TensorBoard runs under each split's name -- where training
writes its own evaluations. Following a training job (`follow`), it polls for new
checkpoints at a bounded interval; orbax's temporary directories of saves in progress are
not listed, and a checkpoint that retention deletes between listing and reading is
skipped (`revtrain.training.checkpoints.readable`: the vanished checkpoint of every
program that reads a directory being saved into). Re-running evaluates nothing twice: the
records are the memory.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator

import jax

from revtrain.training.builder import (
    BuiltModel,
    build_evaluator,
    build_model,
    eval_splits,
    resolve_inputs,
)
from revtrain.training.checkpoints.checkpointer import Checkpointer, short_reason
from revtrain.training.checkpoints.readable import (
    CheckpointUnreadableError,
    CheckpointVanishedError,
)
from revtrain.training.checkpoints.trees import CheckpointMismatchError
from revtrain.training.config import EvalConfig, RunConfig
from revtrain.training.evaluation import eval_batches
from revtrain.training.metrics_writer import MetricsWriter, read_metrics
from revtrain.training.run_directory import CHECKPOINT_DIR
from revtrain.training.run_tokenizer import check_run_tokenizer, tokenizer_binding

logger = logging.getLogger(__name__)

MAX_POLL_SECONDS = 600.0


class CheckpointEvaluator:
    """Evaluates the checkpoints of ``output_dir`` on the run's eval splits.

    Args:
      run: the run's `RunConfig` (from its ``config.gin``).
      eval_config: its `EvalConfig`; ``steps`` batches per split (None: one exact pass).
      output_dir: the run directory (``checkpoints/`` is read, ``metrics.jsonl`` and
        ``tensorboard/<split>`` are appended to).
      split: evaluate only this split (default: all of them).

    Raises:
      ValueError: for an unknown ``split``, data that does not fit the model, or a
        tokenizer other than the one the run was trained with.
    """

    def __init__(self, run: RunConfig, eval_config: EvalConfig, output_dir: str,
                 split: str | None = None):
        inputs = resolve_inputs(run.inputs)
        check_run_tokenizer(output_dir, inputs.tokenizer, tokenizer_binding(inputs))
        # Shapes only: every value is read from a checkpoint.
        self.built: BuiltModel = build_model(run, inputs, abstract=True)
        self._evaluator = build_evaluator(run, self.built, inputs)
        splits = eval_splits(inputs, eval_config)
        if split is not None and split not in splits:
            raise ValueError(f"--split={split} is not a split of this run; use one of "
                             f"{sorted(splits)}")
        self.splits = {split: splits[split]} if split else splits
        self._steps = eval_config.steps
        self.output_dir = output_dir
        self.checkpointer = Checkpointer(os.path.join(output_dir, CHECKPOINT_DIR),
                                         max_to_keep=None, read_only=True)
        self._writer = MetricsWriter(output_dir, enabled=jax.process_index() == 0)
        self.unreadable_steps: set[int] = set()

    def evaluated_steps(self) -> set[int]:
        """Steps that have a record of every split in ``metrics.jsonl``."""
        done = [{r["step"] for r in read_metrics(self.output_dir, name)}
                for name in self.splits]
        return set.intersection(*done)

    def pending_steps(self, step: int | None = None) -> list[int]:
        """Complete checkpoints without a record (only ``step`` when given), ascending."""
        self.checkpointer.reload()
        done = self.evaluated_steps()
        return [s for s in self.checkpointer.all_steps()
                if s not in done and s not in self.unreadable_steps
                and (step is None or s == step)]

    def evaluate_step(self, step: int) -> dict[str, dict[str, float]] | None:
        """Evaluates the checkpoint of ``step`` and writes its records.

        A checkpoint that cannot be read (a missing or damaged file) is skipped with a
        warning naming it and the reason, and listed in `unreadable_steps`.

        Returns:
          ``{split: metrics}``, or None when the checkpoint was deleted before it was read
          or cannot be read.

        Raises:
          CheckpointMismatchError: the checkpoint holds another model.
        """
        where = os.path.join(self.checkpointer.directory, str(step))
        try:
            values = self.checkpointer.restore_values(self.built.initial_values(), step)
        except CheckpointMismatchError:
            raise
        except CheckpointVanishedError as e:  # Deleted by retention: the next list is newer.
            logger.warning("skipping the checkpoint %s: %s", where, short_reason(e))
            return None
        except Exception as e:  # noqa: BLE001  Damage shows as any orbax/tensorstore error.
            self.unreadable_steps.add(step)
            logger.warning("skipping the checkpoint %s: it cannot be read (%s)", where,
                           short_reason(e))
            return None
        weights, state = self.built.nest(values["weights"]), self.built.nest(values["state"])
        results = {}
        for name, inputs in self.splits.items():
            results[name] = self._evaluator.evaluate(weights, state,
                                                     eval_batches(inputs, self._steps))
            self._writer.write(step, name, results[name])
        self._writer.flush()
        return results

    def run(self, step: int | None = None) -> Iterator[tuple[int, dict]]:
        """Evaluates the pending checkpoints once, in step order; yields ``(step, results)``.

        Raises:
          CheckpointUnreadableError: when checkpoints were pending and none could be read.
        """
        pending = self.pending_steps(step)
        evaluated = 0
        for each in pending:
            results = self.evaluate_step(each)
            if results is not None:
                evaluated += 1
                yield each, results
        unreadable = [s for s in pending if s in self.unreadable_steps]
        if pending and not evaluated and len(unreadable) == len(pending):
            raise CheckpointUnreadableError(
                f"none of the {len(pending)} checkpoints to evaluate in "
                f"{self.checkpointer.directory} can be read (steps {pending})")

    def follow(self, final_step: int, poll_seconds: float = 10.0,
               sleep: Callable[[float], None] = time.sleep, step: int | None = None
               ) -> Iterator[tuple[int, dict]]:
        """Evaluates new checkpoints as they appear until ``final_step`` is evaluated, or
        (with ``step``) waits for that step's checkpoint alone and evaluates it.

        Args:
          final_step: the run's last step (``train.steps``); returns once a checkpoint of
            that step or a later one has been evaluated.
          poll_seconds: seconds between looks at the directory, in (0, 600].
          sleep: the waiting function (tests pass a fake one).
          step: evaluate only this step's checkpoint, returning once it is evaluated (or
            was, by an earlier evaluation).

        Raises:
          ValueError: for ``poll_seconds`` outside (0, 600], a ``step`` after
            ``final_step``, or a ``step`` the run went past without saving it (checkpoints
            are saved in step order, so it will not appear).
        """
        if not 0 < poll_seconds <= MAX_POLL_SECONDS:
            raise ValueError(f"--poll_seconds={poll_seconds} must be in (0, "
                             f"{MAX_POLL_SECONDS:g}]; pass a shorter interval")
        if step is not None and step > final_step:
            raise ValueError(f"--step={step} is after the run's final step {final_step} "
                             f"(train.steps); pass a step up to {final_step}")
        while True:
            yield from self.run(step)
            done = self.evaluated_steps() | self.unreadable_steps
            if step is None and done and max(done) >= final_step or step in done:
                return
            saved = self.checkpointer.all_steps()
            if step is not None and step not in saved and any(s > step for s in saved):
                raise ValueError(f"--step={step}: the run went past that step without "
                                 f"saving it; its checkpoints are {saved}")
            sleep(poll_seconds)

    def close(self) -> None:
        """Closes the checkpoint manager and the metric writers."""
        self.checkpointer.close()
        self._writer.close()
