"""Step time vs depth for the four trainers of a reversible Transformer LM.

Usage (from the repository root, after ``pip install -e '.[bench]'``)::

    python benchmarks/step_time.py            # defaults: depths 2..32, d_model 256
    python benchmarks/step_time.py --quick    # tiny sizes, seconds

Each (trainer, depth) runs in a fresh process on one device (``n_devices=1``; on CPU that
one XLA device uses every core), so every first step compiles from scratch. Each step is
timed from the ``one_step`` call until its loss and stats are ready
(``trainer.block_until_ready()``: every layer's update landed). Reported per
configuration:

* ``first_step_s`` -- the first step, compilation included, and ``first_step_compile_s``,
  the seconds JAX spent tracing, lowering and compiling in it (from ``jax.monitoring``,
  summed over compilations: the block trainers compile their layers' programs side by
  side in a thread pool, so this sum can exceed ``first_step_s``; their
  ``trainer.compile_times`` gives the wall-clock split);
* ``median_step_s`` -- the median of ``--steps`` steps run after ``--warmup`` steps (the
  first step is warm-up step 1); ``tokens_per_s = batch_size * seq_len / median_step_s``;
* ``ratio_to_trainer`` -- ``median_step_s`` over `Trainer`'s at the same depth, both from
  the same run of this script;
* ``median_cpu_s`` and ``cpu_ratio_to_trainer`` -- the same for the worker's CPU time per
  step (all its threads), which other processes on a shared machine inflate far less than
  the wall time, and ``median_others_cpu_s``, the CPU time the rest of the machine used
  during a step (a contention gauge; Linux only);
* ``--rounds R`` runs everything R times (the trainers of a depth back to back) and pools
  the steps, so drifts in machine speed hit every trainer;
* ``n_dispatches_per_step`` (compiled-function calls in one step) and
  ``n_compiles_after_first_step`` (should be 0: nothing recompiles);
* ``phase_s`` -- seconds per phase (``forward`` / ``loss`` / ``backward`` for the block
  trainers, ``step`` for `Trainer`), the median of ``--phase_steps`` extra steps timed
  by a trainer observer that waits for each dispatch's inputs (`benchmarks.phases`);
* ``mask_s`` -- drawing every dropout mask of one forward pass alone, as the layers draw
  them, and ``mask_bernoulli_s`` with 32-bit ``jax.random.bernoulli`` masks for comparison.

``--preset=trax_reformer`` sets the sizes of Trax's reformer benchmark (batch 8, seq 256,
d_model 256, d_ff 1024, vocab 256, Adam) where no flag sets them, so the comparison with
Trax can be rerun: ``python benchmarks/step_time.py --preset=trax_reformer --depths=2,16
--dropout=0.1``.

Writes ``step_time.json``, ``.md`` and ``.png`` to ``--out_dir``.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # Run as a script: make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import flags  # noqa: E402

from benchmarks import harness, phases, report  # noqa: E402

PRESETS = {"trax_reformer": {"batch_size": 8, "seq_len": 256, "d_model": 256, "d_ff": 1024,
                             "vocab_size": 256}}

flags.adopt_module_key_flags(harness)  # --help lists the shared flags.
flags.DEFINE_integer("rounds", 1, "run every configuration this many times (fresh "
                     "processes, trainers of a depth back to back) and pool the steps",
                     lower_bound=1)
flags.DEFINE_enum("preset", None, list(PRESETS), "model and batch sizes of a reference "
                  f"configuration, for sizes no flag sets: {PRESETS}")
flags.DEFINE_integer("phase_steps", 2, "extra steps timed per phase (forward / loss / "
                     "backward) after the measured ones; 0 skips the phase breakdown and "
                     "the mask timing", lower_bound=0)

NAME = "step_time"
QUIET_FRACTION = 0.1
POOLED = {"step_times_s": "wall_s", "cpu_times_s": "cpu_s", "others_cpu_times_s": "others_cpu_s"}
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


# ------------------------------------------------------------------------------------------
# Worker side.

class _DispatchCounter:
    """A trainer observer that counts compiled-function dispatches."""

    def __init__(self):
        self.n_dispatches = 0

    def on_dispatch(self, label: str, fn: Any, args: tuple) -> None:
        del label, fn, args
        self.n_dispatches += 1


def busy_cpu_seconds() -> float | None:
    """CPU-seconds all cores spent busy since boot (Linux ``/proc/stat``), else None.

    Busy is user + nice + system + irq + softirq + steal (steal: taken by the hypervisor).
    """
    try:
        ticks = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def timed_step(trainer: Any, batch: tuple, step: int) -> dict[str, float]:
    """Runs one step until its loss and stats are ready.

    Returns ``wall_s``; ``cpu_s``, the CPU time of this process (all its threads) in the
    step, which other processes slow down far less than the wall time; ``others_cpu_s``,
    the CPU time the rest of the machine used meanwhile (NaN where unknown); and ``loss``.
    """
    import jax
    busy, cpu, start = busy_cpu_seconds(), time.process_time(), time.perf_counter()
    loss, _ = trainer.one_step(batch, jax.random.key(step))
    trainer.block_until_ready()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    busy_after = busy_cpu_seconds()
    others = math.nan if busy is None else max(busy_after - busy - cpu, 0.0)
    return {"wall_s": wall, "cpu_s": cpu, "others_cpu_s": others, "loss": float(loss)}


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """Builds the configured trainer and times its first step and its steady-state steps."""
    import jax
    compile_events: list[tuple[str, float]] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event in COMPILE_EVENTS:
            compile_events.append((event, duration))

    trainer, batch = harness.build(config)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        counter = _DispatchCounter()
        trainer.observers.append(counter)
        first = timed_step(trainer, batch, 0)
        trainer.observers.remove(counter)
        first_compile_s = sum(d for _, d in compile_events)
        n_first_compiles = sum(e == COMPILE_EVENTS[-1] for e, _ in compile_events)
        compile_events.clear()
        for step in range(1, config["warmup"]):
            timed_step(trainer, batch, step)
        timed = [timed_step(trainer, batch, config["warmup"] + k)
                 for k in range(config["steps"])]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    # After the timed steps, outside the compile count: the mask timing compiles its own.
    start, n_phase = config["warmup"] + config["steps"], config.get("phase_steps", 0)
    phase_s = phases.profile_phases(trainer, batch, range(start, start + n_phase))
    masks = phases.time_masks(config) if n_phase else {}
    result = {"first_step_s": first["wall_s"], "first_step_compile_s": first_compile_s,
              "n_compiled_in_first_step": n_first_compiles,
              "n_dispatches_per_step": counter.n_dispatches,
              "n_compiles_after_first_step": sum(e == COMPILE_EVENTS[-1]
                                                 for e, _ in compile_events),
              "losses": [first["loss"]] + [t["loss"] for t in timed],
              "phase_s": phase_s, **masks}
    for name, key in POOLED.items():
        result[name] = [t[key] for t in timed]
    return result | summarise(result, config)


def summarise(result: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Medians of the per-step lists of ``result`` (over its quiet steps), and tokens/s.

    A step is *quiet* when the rest of the machine used at most `QUIET_FRACTION` of a
    core meanwhile (``others_cpu_s <= QUIET_FRACTION * wall_s``). ``median_step_s`` and
    ``median_cpu_s`` are taken over the quiet steps, or over all steps when none was quiet
    (``n_quiet_steps == 0``); ``median_step_all_s`` is always over all steps.
    """
    steps = list(zip(result["step_times_s"], result["cpu_times_s"],
                     result["others_cpu_times_s"], strict=True))
    quiet = [s for s in steps if s[2] <= QUIET_FRACTION * s[0]]  # NaN (unknown) is never.
    used = quiet or steps
    median = statistics.median(wall for wall, _, _ in used)
    return {"median_step_s": median,
            "median_step_all_s": statistics.median(wall for wall, _, _ in steps),
            "median_cpu_s": statistics.median(cpu for _, cpu, _ in used),
            "median_others_cpu_s": statistics.median(other for _, _, other in steps),
            "n_quiet_steps": len(quiet), "n_steps": len(steps),
            "tokens_per_s": config["batch_size"] * config["seq_len"] / median}


# ------------------------------------------------------------------------------------------
# Parent side: ratios, tables, plot, targets.

def merge_rounds(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pools each (trainer, depth)'s rounds: all their timed steps, their first steps.

    ``median_step_s`` becomes the median of every timed step of every round and
    ``first_step_s`` the median of the rounds' first steps (each in a fresh process). A
    configuration whose rounds all failed keeps its first error.
    """
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["trainer"], r["depth"]), []).append(r)
    merged = []
    for rounds in groups.values():
        ok = [r for r in rounds if "error" not in r]
        if not ok:
            merged.append({k: v for k, v in rounds[0].items() if k != "round"})
            continue
        m = {k: v for k, v in ok[0].items() if k != "round"}
        for name in POOLED:
            m[name] = [t for r in ok for t in r.get(name, [])]
        m |= summarise(m, m)
        for key in ("first_step_s", "first_step_compile_s"):
            m[key] = statistics.median(r[key] for r in ok)
        m["first_steps_s"] = [r["first_step_s"] for r in ok]
        m["n_compiles_after_first_step"] = max(r["n_compiles_after_first_step"] for r in ok)
        m["n_rounds"] = len(ok)
        merged.append(m)
    return merged


def add_ratios(results: Sequence[dict[str, Any]]) -> None:
    """Sets ``ratio_to_trainer`` on every result that has a `Trainer` result at its depth."""
    for r in results:
        if "error" not in r and "cpu_times_s" in r:  # Re-summarise (also --render_only).
            r |= summarise(r, r)
    table = report.by_key(results)
    for r in results:
        base = table.get(("trainer", r["depth"]))
        if "error" in r or base is None:
            continue
        # Like with like: quiet medians when both had quiet steps, else all-step medians.
        both_quiet = r.get("n_quiet_steps", 0) > 0 and base.get("n_quiet_steps", 0) > 0
        key = "median_step_s" if both_quiet or "median_step_all_s" not in r else (
            "median_step_all_s")
        r["ratio_to_trainer"] = r[key] / base[key]
        r["ratio_from"] = key
        if "median_cpu_s" in r:
            r["cpu_ratio_to_trainer"] = r["median_cpu_s"] / base["median_cpu_s"]


def _describe(r: dict[str, Any]) -> str:
    return (f"median {r['median_step_s']:.3f} s/step ({r['tokens_per_s']:,.0f} tokens/s), "
            f"first step {r['first_step_s']:.1f} s (compiling {r['first_step_compile_s']:.1f} "
            f"s), {r['n_dispatches_per_step']} dispatches/step")


def targets(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's time targets, evaluated where the needed depths were measured."""
    table = report.by_key(results)
    depths = sorted({r["depth"] for r in results})
    checks = []
    hi = depths[-1] if depths else None
    for kind in ("reversible", "memory_efficient"):
        r = table.get((kind, hi))
        if r:
            checks.append({"target": f"{harness.TRAINERS[kind]} first step (compile "
                                     f"included) at depth {hi} <= 10 s",
                           "value": f"{r['first_step_s']:.1f} s", "met": r["first_step_s"] <= 10})
    lo, first = (depths[0] if depths else None), table.get(("reversible", hi))
    if first and lo != hi and ("reversible", lo) in table:
        ratio = first["first_step_s"] / table[("reversible", lo)]["first_step_s"]
        checks.append({"target": f"ReversibleSerialTrainer first step at depth {hi} <= 1.3x "
                                 f"its first step at depth {lo}",
                       "value": f"{ratio:.2f}x", "met": ratio <= 1.3})
    mid = 16 if 16 in depths else hi
    for kind, limit in (("reversible", 1.4), ("memory_efficient", 2.0)):
        r = table.get((kind, mid))
        if r and "ratio_to_trainer" in r:
            cpu = r.get("cpu_ratio_to_trainer")
            checks.append({"target": f"{harness.TRAINERS[kind]} step time at depth {mid} <= "
                                     f"{limit}x Trainer's",
                           "value": f"{r['ratio_to_trainer']:.2f}x" + (
                               "" if cpu is None else f" (CPU time {cpu:.2f}x)"),
                           "met": r["ratio_to_trainer"] <= limit})
    return checks


def _fmt(value: float | None, pattern: str) -> str:
    return "n/a" if value is None or math.isnan(value) else pattern.format(value)


def markdown(payload: dict[str, Any]) -> str:
    results, config = payload["results"], payload["config"]
    rows = []
    for kind in harness.TRAINERS:
        for r in sorted((r for r in results if r["trainer"] == kind and "error" not in r),
                        key=lambda r: r["depth"]):
            mark = "*" if r.get("n_quiet_steps") == 0 else ""
            rows.append([harness.TRAINERS[kind], r["depth"], f"{r['median_step_s']:.3f}{mark}",
                         _fmt(r.get("ratio_to_trainer"), "{:.2f}x"),
                         _fmt(r.get("median_cpu_s"), "{:.2f}"),
                         _fmt(r.get("cpu_ratio_to_trainer"), "{:.2f}x"),
                         _fmt(r.get("median_others_cpu_s"), "{:.2f}"),
                         f"{r.get('n_quiet_steps', '?')}/{len(r['step_times_s'])}",
                         f"{r['tokens_per_s']:,.0f}", f"{r['first_step_s']:.1f}",
                         f"{r['first_step_compile_s']:.1f}", r["n_dispatches_per_step"]])
    rounds = config.get("rounds", 1)
    lines = [f"Step time by depth; {report.settings_line(config)}; median of "
             f"{config['steps']} steps after {config['warmup']} warm-up steps"
             f"{f' in each of {rounds} rounds' if rounds > 1 else ''}; "
             f"{payload['machine']['processor']}, {payload['machine']['cpu_count']} cores.",
             "", report.markdown_table(
                 ["trainer", "depth", "median step (s)", "vs Trainer", "CPU s/step",
                  "vs Trainer (CPU)", "others' CPU s/step", "quiet steps", "tokens/s",
                  "first step (s)",
                  "of which compiling (s)", "dispatches/step"], rows), ""]
    lines += [f"Medians are over the quiet steps (other processes used <= "
              f"{QUIET_FRACTION:.0%} of a core meanwhile); * marks a configuration without "
              f"any quiet step (median of all steps). A ratio to Trainer compares quiet "
              f"medians when both had quiet steps, else the medians of all steps."]
    lines += phase_table(results)
    lines += ["", *payload["notes"]] if payload.get("notes") else []  # Added by hand.
    lines += [f"- {harness.TRAINERS[r['trainer']]} depth {r['depth']}: {r['error']}"
              for r in results if "error" in r]
    if payload["targets"]:
        lines += ["", report.targets_table(payload["targets"])]
    return "\n".join(lines) + "\n"


def apply_preset(args: Any) -> Any:
    """Sets ``args.preset``'s sizes (`PRESETS`) on ``args`` where no flag set them."""
    for name, value in PRESETS.get(args.preset, {}).items():
        if not flags.FLAGS[name].present:
            setattr(args, name, value)
    return args


def phase_table(results: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown lines: seconds per phase and mask generation, per trainer and depth."""
    rows = []
    for kind in harness.TRAINERS:
        for r in sorted((r for r in results if r["trainer"] == kind and r.get("phase_s")),
                        key=lambda r: r["depth"]):
            rows.append([harness.TRAINERS[kind], r["depth"],
                         *(_fmt(r["phase_s"].get(p), "{:.3f}") for p in phases.PHASES),
                         _fmt(r.get("mask_s"), "{:.4f}"),
                         _fmt(r.get("mask_bernoulli_s"), "{:.4f}")])
    if not rows:
        return []
    return ["", "Seconds per phase (median of the profiled steps, each dispatch waiting for "
            "its inputs; `Trainer` runs one program, so only its whole step), and drawing "
            "one forward pass's dropout masks alone (masks of the run's --mask_bits, as the "
            "layers draw them; "
            "32-bit `jax.random.bernoulli` for comparison):", "",
            report.markdown_table(["trainer", "depth", *(f"{p} (s)" for p in phases.PHASES),
                                    "masks (s)", "bernoulli masks (s)"], rows)]


def _run(args: Any) -> dict[str, Any]:
    """Runs every configuration (``--rounds`` times) in worker processes; the payload."""
    machine = harness.machine_info(args.command)  # Before the run: its date is the start.
    configs = [c | {"phase_steps": args.phase_steps}
               for c in harness.configurations(args, args.rounds)]
    print(f"{NAME}: {len(configs)} runs, {report.settings_line(configs[0])}")
    results = merge_rounds(harness.run_all(str(Path(__file__).resolve()), configs,
                                           args.timeout, _describe, args.jobs))
    return {"benchmark": NAME, "config": harness.model_config(args) | {
                "rounds": args.rounds, "preset": args.preset, "phase_steps": args.phase_steps},
            "depths": args.depths, "machine": machine, "results": results}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs every configuration in a worker process and writes JSON, Markdown and PNG.

    With ``--render_only`` it reads the JSON instead, recomputes the medians, ratios and
    targets from the per-step times in it, and rewrites all three files.
    """
    args = apply_preset(harness.parse_flags(argv, steps=5, warmup=2))
    out = Path(args.out_dir)
    payload = (report.read_json(out / f"{NAME}.json") if args.render_only
               else _run(args))
    payload["config"] = harness.with_workers_host_allocator(payload["config"],
                                                            payload["results"])
    add_ratios(payload["results"])
    payload["targets"] = targets(payload["results"])
    report.write_json(out / f"{NAME}.json", payload)
    (out / f"{NAME}.md").write_text(markdown(payload))
    panels = [("median step time", "seconds per step", lambda r: r["median_step_s"]),
              ("first step (compilation included)", "seconds", lambda r: r["first_step_s"]),
              ("compiling in the first step", "seconds", lambda r: r["first_step_compile_s"])]
    report.plot_by_depth(out / f"{NAME}.png", payload["results"], panels,
                          f"Step time vs depth ({report.settings_line(payload['config'])})")
    print(markdown(payload))
    print(f"wrote {out / NAME}.json, .md, .png")
    return payload


if __name__ == "__main__":
    harness.script_main(main, measure)
