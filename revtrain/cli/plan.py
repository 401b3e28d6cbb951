"""``revtrain-plan``: which trainer fits a memory budget, at what batch and speed, before a
run.

``revtrain-plan --config_file=configs/reversible_lm.gin --memory_budget=12GiB
[--gin_bindings=...]`` builds the run's model abstractly, estimates one step's peak on one
device for every candidate (`revtrain.planning.plan`), and prints a table: each candidate,
its batch (times accumulation steps), predicted peak and its split, whether it fits the
budget less the margin, and its predicted tokens/s. Then it prints the pick and the gin
bindings that apply it (``revtrain-train --memory_budget=...`` applies them itself). A
budget nothing fits exits 1 with one line naming the smallest predicted peak and what
would fit; a malformed budget exits 2. Nothing is written but JAX's persistent
compilation cache (as ``revtrain-train``'s, `revtrain.cli.cache_flags`), so the programs
planned for the pick are loaded, not compiled, by the run that follows.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

from revtrain.cli.bounded_flags import define_real
from revtrain.cli.cache_flags import define_cache_flags, use_flagged_cache
from revtrain.cli.common import UsageError, add_tool_flags, parse_gin, run


def define_budget_flags(fv: flags.FlagValues) -> None:
    """``--memory_budget`` and ``--memory_margin``, shared with ``revtrain-train``."""
    flags.DEFINE_string("memory_budget", None, "Accelerator memory one device may use, "
                        "e.g. 12GiB, 16GB or 512MiB (no space before the unit).",
                        flag_values=fv)
    define_real("memory_margin", 0.1, "The fraction of --memory_budget kept free for what "
                "no estimate sees (fragmentation, runtime buffers).", fv, lower=0.0,
                upper=0.99)


def checked_budget(fv: flags.FlagValues) -> int:
    """``--memory_budget`` in bytes.

    Raises:
      UsageError: one line for a malformed budget (`revtrain.planning.parse_memory_budget`).
    """
    from revtrain.planning import parse_memory_budget
    try:
        return parse_memory_budget(fv.memory_budget)
    except ValueError as e:
        raise UsageError(str(e)) from e


def _plan(fv: flags.FlagValues) -> int:
    if not fv.config_file:
        raise UsageError("give at least one --config_file, e.g. "
                         "--config_file=configs/reversible_lm.gin")
    if fv.memory_budget is None:
        raise UsageError("--memory_budget is required, e.g. --memory_budget=12GiB")
    budget = checked_budget(fv)
    parse_gin(fv.config_file, fv.gin_bindings)
    use_flagged_cache(fv)  # The programs planned are the ones a run then loads.
    from revtrain import configurables
    from revtrain.memory import format_bytes
    from revtrain.planning.runs import applied_bindings, plan_run

    run_config = configurables.run_configs()["run"]
    result = plan_run(run_config, budget, margin=fv.memory_margin,
                      fixed_batch=not fv.largest_batch)
    print(result.table())
    print(f"\nplanned in {result.seconds:.1f} s; planner RSS "
          f"{format_bytes(result.planner_rss_bytes)}; rates measured on "
          f"{result.rates.device}")
    pick = result.pick
    if pick is None:
        print(f"revtrain-plan: {result.nothing_fits()}")
        return 1
    print(f"\npick: {pick.candidate.name} at batch {pick.estimate.batch_size} x "
          f"{pick.accumulate_steps}, predicted peak "
          f"{format_bytes(pick.estimate.peak_bytes)} of "
          f"{format_bytes(result.budget_bytes)}, {pick.tokens_per_second:,.0f} tokens/s")
    expected = result.expected_rss_bytes(pick)
    if expected is not None:
        print(f"on this CPU host device memory is RAM: expected process RSS about "
              f"{format_bytes(expected)} (the runtime's {format_bytes(result.baseline_rss_bytes)}"
              f" + the peak + values kept in host memory)")
    print("gin bindings:")
    for line in applied_bindings(pick, run_config):
        print(f"  {line}")
    return 0


def plan_main(argv: Sequence[str] | None = None) -> int:
    """``revtrain-plan``; returns the exit status (``argv[0]`` is the program name)."""
    fv = flags.FlagValues()
    flags.DEFINE_multi_string("config_file", [], "A gin config file, or the name of one "
                              "shipped in revtrain/configs; repeat for several.",
                              flag_values=fv)
    flags.DEFINE_alias("gin_file", "config_file", flag_values=fv)
    flags.DEFINE_multi_string("gin_bindings", [], "A gin binding; repeat for several; "
                              "applied after the config files.", flag_values=fv)
    define_budget_flags(fv)
    flags.DEFINE_boolean("largest_batch", False, "Plan each candidate at the largest batch "
                         "that fits instead of the configured global batch.", flag_values=fv)
    define_cache_flags(fv)
    add_tool_flags(fv)
    return run("revtrain-plan", fv, argv, _plan)


__all__ = ["checked_budget", "define_budget_flags", "plan_main"]
