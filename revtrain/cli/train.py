"""``revtrain-train``: parses the gin files and bindings, calls the gin-configured `train`,
writes the operative config once the run is set up, and prints the final eval metrics.

See `revtrain.cli` for the flags every program shares, signals and the conventions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

import gin
from absl import flags

from revtrain.cli.cache_flags import define_cache_flags, use_flagged_cache
from revtrain.cli.common import (
    UsageError,
    common_flags,
    initialize_distributed,
    is_chief,
    parse_gin,
    print_metrics,
    run,
)
from revtrain.cli.plan import checked_budget, define_budget_flags
from revtrain.training.run_directory import CHECKPOINT_DIR, TENSORBOARD_CONFIG_DIR

logger = logging.getLogger(__name__)


def _write_operative_config(output_dir: str) -> Callable:
    """A `Loop` callback writing gin's operative config to ``config.gin`` and TensorBoard."""
    def write(loop) -> None:
        if is_chief():
            from revtrain.training.config_history import write_run_config
            from revtrain.training.metrics_writer import EventFile
            from revtrain.training.write_failures import reporting_write_failures

            config = gin.operative_config_str()
            write_run_config(output_dir, config)
            logdir = os.path.join(output_dir, TENSORBOARD_CONFIG_DIR)
            with reporting_write_failures(f"write the TensorBoard events in {logdir}",
                                          os.path.join(output_dir, CHECKPOINT_DIR)):
                events = EventFile(logdir)
                try:
                    events.add_text("gin/operative_config", gin.config.markdown(config),
                                    loop.step)
                finally:
                    events.close()
    return write


def _print_summary(loop) -> None:
    """A `Loop` callback printing the parameter count and per-layer summary (stdout)."""
    if is_chief():
        print(loop.summary, flush=True)


def _apply_memory_budget(fv: flags.FlagValues, output_dir: str) -> list[Callable]:
    """With ``--memory_budget``: plans the run (`revtrain.planning.runs.plan_run`), applies
    the pick's gin bindings, and returns the `Loop` callbacks that record them in
    ``plan.gin`` and log the predicted peak beside the first step's measured one. A run
    resumed with a ``plan.gin`` reapplies it (a new pick could change the trainer or the
    accumulation under its checkpoints); nothing is written before the plan is made.

    Raises:
      UsageError: for a malformed budget, a budget nothing fits (one line naming the
        smallest predicted peak and what would fit), or a run started without a budget.
    """
    if fv.memory_budget is None:
        return []
    budget = checked_budget(fv)
    from revtrain import configurables
    from revtrain.planning.runs import PLAN_FILE, FirstStepPeak, applied_bindings, plan_run
    from revtrain.training.write_failures import checkpoint_steps

    recorded = os.path.join(output_dir, PLAN_FILE)
    if os.path.isfile(recorded):
        gin.parse_config_file(recorded)
        logger.info("resuming with the plan recorded in %s", recorded)
        return []
    if checkpoint_steps(os.path.join(output_dir, CHECKPOINT_DIR)):
        raise UsageError(f"--memory_budget: the run in {output_dir} was started without a "
                         f"plan, and a new pick could change its trainer under its "
                         f"checkpoints; resume it without --memory_budget, or start a new "
                         f"--output_dir")
    run_config = configurables.run_configs()["run"]
    result = plan_run(run_config, budget, margin=fv.memory_margin)
    pick = result.pick
    if pick is None:
        raise UsageError(f"--memory_budget={fv.memory_budget}: {result.nothing_fits()}")
    bindings = applied_bindings(pick, run_config)
    logger.info("plan under %s:\n%s\npick: %s at batch %d x %d, predicted peak %d bytes",
                fv.memory_budget, result.table(), pick.candidate.name,
                pick.estimate.batch_size, pick.accumulate_steps, pick.estimate.peak_bytes)
    gin.parse_config(bindings)

    def record(loop) -> None:
        if is_chief():
            from revtrain.training.write_failures import reporting_write_failures
            text = "\n".join([f"# revtrain-train --memory_budget={fv.memory_budget} "
                              f"applied:", *bindings, ""])
            with (reporting_write_failures(f"write {recorded}",
                                           os.path.join(output_dir, CHECKPOINT_DIR)),
                  open(recorded, "w", encoding="utf-8") as f):
                f.write(text)
        loop.trainer.observers.append(FirstStepPeak(pick.estimate.peak_bytes))
    return [record]


def _train(fv: flags.FlagValues) -> int:
    if not fv.output_dir:
        raise UsageError("--output_dir is required (checkpoints, metrics and config.gin go "
                         "there)")
    if not fv.config_file:
        raise UsageError("give at least one --config_file, e.g. "
                         "--config_file=configs/reversible_lm.gin")
    initialize_distributed(fv)
    parse_gin(fv.config_file, fv.gin_bindings)
    from revtrain import configurables
    from revtrain.training.config import legacy_binding_error

    removed = sorted(set(gin.get_bindings("train")) - {"steps"})
    if removed:  # A usage error, before anything is built.
        raise UsageError(str(legacy_binding_error(removed)))
    output_dir = os.path.abspath(fv.output_dir)
    use_flagged_cache(fv)
    planned = _apply_memory_budget(fv, output_dir)
    loop = configurables.train(output_dir=output_dir,
                               callbacks=[_write_operative_config(output_dir),
                                          _print_summary, *planned],
                               **configurables.run_configs())
    if loop.interrupted_by is not None:
        name = signal.Signals(loop.interrupted_by).name
        # After SIGHUP the terminal may be gone (EIO): the save is done, the status stands.
        with contextlib.suppress(OSError):
            if is_chief():
                print(f"stopped by {name} after step {loop.step}; the checkpoint is saved "
                      f"in {output_dir}; run the same command to resume", file=sys.stderr)
        return 128 + loop.interrupted_by
    if loop.last_eval_metrics:
        print_metrics(f"final eval at step {loop.step}", loop.last_eval_metrics)
    return 0


def train_main(argv: Sequence[str] | None = None) -> int:
    """``revtrain-train``; returns the exit status (``argv[0]`` is the program name)."""
    fv = common_flags("Directory for checkpoints, metrics.jsonl, TensorBoard files and "
                       "config.gin; an existing run there is resumed.")
    define_cache_flags(fv)
    define_budget_flags(fv)
    return run("revtrain-train", fv, argv, _train)


__all__ = ["train_main"]
