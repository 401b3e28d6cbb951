"""``revtrain-eval``: evaluates the checkpoints of a run that have no eval records yet
(following the run with ``--wait``), rebuilt from ``output_dir/config.gin``
(`revtrain.cli.saved_run.read_run`), as Paxml's separate eval program."""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

from revtrain.cli.bounded_flags import define_real
from revtrain.cli.cache_flags import define_cache_flags
from revtrain.cli.common import UsageError, common_flags, is_chief, print_metrics, run
from revtrain.cli.saved_run import read_run


def _eval(fv: flags.FlagValues) -> int:
    import dataclasses

    from revtrain.training.eval_program import CheckpointEvaluator

    output_dir, configs, final_step = read_run(fv)  # Turns the compilation cache on.
    eval_config = configs["eval_config"]
    if fv.one_pass or fv.eval_steps is not None:
        steps = None if fv.one_pass else fv.eval_steps
        eval_config = dataclasses.replace(eval_config, steps=steps)
    if not eval_config.enabled:
        raise UsageError("this run has EvalConfig.steps=0 (no evaluation); pass "
                         "--eval_steps=N or --one_pass")
    evaluator = CheckpointEvaluator(configs["run"], eval_config, output_dir, fv.split)
    try:
        if not fv.wait and not evaluator.checkpointer.all_steps():
            raise UsageError(f"no checkpoint to load in {evaluator.checkpointer.directory}; "
                             f"train first, or pass --wait to evaluate the checkpoints as "
                             f"they appear")
        if (not fv.wait and fv.step is not None
                and fv.step not in evaluator.checkpointer.all_steps()):
            raise UsageError(f"--step={fv.step}: no checkpoint of that step in "
                             f"{evaluator.checkpointer.directory}; it has "
                             f"{evaluator.checkpointer.all_steps()}; pass --wait to wait "
                             f"for it")
        results = (evaluator.follow(final_step, fv.poll_seconds, step=fv.step) if fv.wait
                   else evaluator.run(fv.step))
        count = 0
        for step, metrics in results:
            for split, values in metrics.items():
                print_metrics(f"{split} at step {step}", values)
            count += 1
    finally:
        evaluator.close()
    if count == 0 and is_chief():
        print(f"nothing to evaluate: every checkpoint in {output_dir} has its eval records "
              f"in metrics.jsonl", flush=True)
    return 0


def eval_main(argv: Sequence[str] | None = None) -> int:
    """``revtrain-eval``: evaluates the checkpoints of ``--output_dir`` without eval records."""
    fv = common_flags("The output_dir of a revtrain-train run.")
    define_cache_flags(fv)
    flags.DEFINE_boolean("wait", False, "Keep polling for new checkpoints (and, first, for "
                         "the run's config.gin); exit after the run's final step "
                         "(train.steps) is evaluated.", flag_values=fv)
    define_real("poll_seconds", 10.0, "Seconds between looks for new checkpoints with "
                "--wait.", fv, lower=0.0, upper=600.0, lower_open=True)
    flags.DEFINE_integer("step", None, "Evaluate only the checkpoint of this step (with "
                         "--wait: wait for it, then exit).",
                         flag_values=fv, lower_bound=0)
    flags.DEFINE_string("split", None, "Evaluate only this eval split (default: all).",
                        flag_values=fv)
    flags.DEFINE_integer("eval_steps", None, "Eval batches per split (default: the run's "
                         "EvalConfig.steps).", flag_values=fv, lower_bound=1)
    flags.DEFINE_boolean("one_pass", False, "One exact pass over each (finite) split.",
                         flag_values=fv)
    return run("revtrain-eval", fv, argv, _eval)


__all__ = ["eval_main"]
