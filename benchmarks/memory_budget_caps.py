"""The caps part of ``benchmarks/memory_budget.py``: tokens/s of every trainer at the
largest batch that fits each of several memory caps, and the planner's pick against the
measured best.

Per row of `ROWS` (``--caps_rows``):

1. one worker plans (`plan_worker`): it estimates each trainer at batch 1 and `Trainer` at
   ``max_batch``, chooses ``--n_caps`` caps between the smallest of those peaks and
   `Trainer`'s at ``max_batch`` (`choose_caps`), and at each cap runs
   `revtrain.planning.plan` with ``fixed_batch=False`` (each trainer at the largest batch
   predicted to fit, under the cap less ``--margin``) and the device's measured rates;
2. each (trainer, batch) a plan chose is measured once, in a fresh worker: ``--warmup``
   steps, ``--steps`` timed steps (their median gives tokens/s), then one step under
   `revtrain.memory.track_peak`;
3. at each cap (`compare`): the measured best is the fastest trainer whose measured peak
   is within the cap, and ``pick_vs_best`` the planner's pick's measured tokens/s over it
   (1.0: the planner picked the fastest).

The rows are budget-limited sizes, not the issue's: the d_model-256, depth-32 LM at 128
tokens (not 512) and batches up to 16, so that a CPU step takes seconds; and a long-context
row, depth 12 at 16,384 tokens with LSH attention, batches up to 2. Writes
``memory_budget_caps.json``, ``.md`` and ``.png`` (tokens/s against the cap, a line per
trainer, the picks starred).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from absl import flags

from benchmarks import budget_worker as budget
from benchmarks import harness, report

NAME = "memory_budget_caps"
KINDS = ("trainer", "trainer_remat", "reversible", "memory_efficient")
# The long-context kinds' settings (as the accuracy part's).
_CHUNKS = {"block_size": 512, "chunk_len": 128, "n_hashes": 2, "ff_chunk_size": 4096,
           "loss_chunk": 4096}
ROWS = {
    "d256": _CHUNKS | {"d_model": 256, "d_ff": 1024, "n_heads": 4, "vocab_size": 256,
                       "depth": 32, "seq_len": 128, "max_batch": 16, "attention": "default",
                       "dropout": 0.1},
    "long": _CHUNKS | {"d_model": 128, "d_ff": 512, "n_heads": 4, "vocab_size": 256,
                      "depth": 12, "seq_len": 16384, "max_batch": 2, "attention": "lsh",
                      "dropout": 0.0},
}
QUICK_ROWS = {
    "d256": ROWS["d256"] | {"d_model": 32, "d_ff": 64, "n_heads": 2, "vocab_size": 64,
                            "depth": 2, "seq_len": 32, "max_batch": 4},
    "long": ROWS["long"] | {"d_model": 32, "d_ff": 64, "n_heads": 2, "vocab_size": 64,
                            "depth": 2, "seq_len": 256, "max_batch": 2, "chunk_len": 16,
                            "ff_chunk_size": 64, "loss_chunk": 64},
}
FLAGS = flags.FLAGS

flags.DEFINE_list("caps_rows", list(ROWS), f"the caps part's rows, a subset of "
                  f"{','.join(ROWS)}")
flags.DEFINE_integer("n_caps", 4, "memory caps per row in the caps part (2 with --quick)",
                     lower_bound=1)
flags.DEFINE_float("margin", 0.1, "the planner's margin in the caps part (fraction of the "
                   "cap kept free)", lower_bound=0.0, upper_bound=0.99)
flags.register_validator("caps_rows", lambda v: bool(v) and set(v) <= set(ROWS),
                         f"--caps_rows must be a subset of {','.join(ROWS)}")


# ------------------------------------------------------------------------------------------
# Worker side.

def choose_caps(smallest_peak: int, largest_peak: int, n_caps: int, margin: float
                ) -> list[int]:
    """``n_caps`` memory caps in bytes, evenly spaced in log scale from the smallest
    predicted peak to the largest, each divided by ``1 - margin`` (so that peak fits under
    the planner's margin) and raised 2% (so it is not on the edge)."""
    low, high = (1.02 * p / (1.0 - margin) for p in (smallest_peak, largest_peak))
    if n_caps == 1 or high <= low:
        return [int(high)]
    step = (high / low) ** (1.0 / (n_caps - 1))
    return [int(low * step ** k) for k in range(n_caps)]


def plan_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Plans one row at every cap (module docstring, step 1).

    JAX's persistent compilation cache is on, in a fresh folder (unless the configuration
    names one), as revtrain turns it on for a user's planner
    (`revtrain.training.use_compilation_cache`): the plans of later caps find the programs
    of a trainer at a batch an earlier one estimated compiled.
    """
    from revtrain.training import CompilationCacheConfig, use_compilation_cache
    if config.get("compilation_cache_dir"):
        return _plan_row(config)
    with tempfile.TemporaryDirectory(prefix="memory_budget_plan_") as directory:
        use_compilation_cache(CompilationCacheConfig(directory=directory))
        return _plan_row(config)


def _plan_row(config: dict[str, Any]) -> dict[str, Any]:
    from revtrain.memory import rss_bytes
    from revtrain.planning import estimate
    from revtrain.planning.cost import measure_rates
    from revtrain.planning.plan import Candidate, plan

    model, loss, signature = budget.abstract_model(config)
    rates = measure_rates(width=config["d_model"])
    candidates, smallest, skipped = [], {}, {}
    for kind in config["kinds"]:
        cls, options = budget.trainer_and_options(kind)
        try:
            e = estimate(model, loss, signature, budget.optimizer_fn, cls, batch_size=1,
                         **options)
        except (TypeError, ValueError) as error:
            if not budget.refused_remat(options, error):
                raise
            skipped[kind] = budget.NO_REMAT
            continue
        smallest[kind] = e.peak_bytes
        candidates.append(Candidate(kind, cls, options))
    if not candidates:
        return {"error": f"no trainer could be estimated: {skipped}"}
    trainer_class, _ = budget.trainer_and_options("trainer")
    largest = estimate(model, loss, signature, budget.optimizer_fn, trainer_class,
                       batch_size=config["max_batch"]).peak_bytes
    caps = []
    for cap in choose_caps(min(smallest.values()), largest, config["n_caps"],
                           config["margin"]):
        p = plan(model, loss, signature, budget.optimizer_fn, cap, candidates=candidates,
                 margin=config["margin"], fixed_batch=False, max_batch=config["max_batch"],
                 rates=rates)
        caps.append({"cap_bytes": cap, "limit_bytes": p.limit_bytes, "plan_s": p.seconds,
                     "pick": p.pick.candidate.name if p.pick else None,
                     "choices": [{"kind": c.candidate.name, "batch_size": c.estimate.batch_size,
                                  "fits": c.fits,
                                  "predicted_peak_bytes": c.estimate.peak_bytes,
                                  "predicted_peak_program": c.estimate.peak_program,
                                  "predicted_step_s": c.step_seconds,
                                  "predicted_tokens_per_s": c.tokens_per_second,
                                  "expected_rss_bytes": p.expected_rss_bytes(c)}
                                 for c in p.choices]})
    return {"rates": dataclasses.asdict(rates), "smallest_peak_bytes": smallest,
            "trainer_largest_peak_bytes": largest, "skipped_kinds": skipped, "caps": caps,
            "planner_rss_bytes": rss_bytes()}


# ------------------------------------------------------------------------------------------
# Parent side.

def row_config(args: SimpleNamespace, name: str) -> dict[str, Any]:
    """The settings every worker of row ``name`` shares (model flags given explicitly
    override the row's)."""
    model = (QUICK_ROWS if args.quick else ROWS)[name] | args.model_overrides
    kinds = [k for k in KINDS if not FLAGS["trainers"].present or k in args.trainers]
    return budget.base_config(model, args.seed, args.compilation_cache_dir) | {
        "row": name, "trainer": "plan", "batch_size": 1, "kinds": kinds,
        "n_caps": args.n_caps, "margin": args.margin, "warmup": args.warmup,
        "steps": args.steps}


def measure_configs(row: dict[str, Any], planned: dict[str, Any]) -> list[dict[str, Any]]:
    """One configuration per (trainer, batch) that a plan of the row found to fit."""
    chosen = dict.fromkeys((c["kind"], c["batch_size"]) for cap in planned["caps"]
                           for c in cap["choices"] if c["fits"])
    base = {k: v for k, v in row.items() if k not in ("kinds", "n_caps", "margin", "max_batch")}
    return [budget.spec_config(base | {"part": "caps", "estimate": False}, kind, row["depth"],
                               row["seq_len"], batch, row["attention"])
            for kind, batch in chosen]


def compare(planned: dict[str, Any], measured: Sequence[dict[str, Any]]
            ) -> list[dict[str, Any]]:
    """At each cap: every choice with its measurement (tokens/s, peak, the process's peak
    RSS beside the planner's ``expected_rss_bytes``), the planner's pick, the measured
    best (the fastest whose measured peak is within the cap) and ``pick_vs_best``."""
    found = {(r["trainer"], r["batch_size"]): r for r in measured if "tokens_per_s" in r}
    out = []
    for cap in planned["caps"]:
        entries = []
        for c in cap["choices"]:
            m = found.get((c["kind"], c["batch_size"])) if c["fits"] else None
            entries.append(c | ({} if m is None else {
                "measured_tokens_per_s": m["tokens_per_s"], "measured_peak_bytes": m["peak_bytes"],
                "measured_peak_rss_bytes": m["peak_rss_bytes"],
                "within_cap": m["peak_bytes"] <= cap["cap_bytes"]}))
        ok = [e for e in entries if e.get("within_cap")]
        best = max(ok, key=lambda e: e["measured_tokens_per_s"]) if ok else None
        pick = next((e for e in entries if e["kind"] == cap["pick"]), None)
        ratio = (pick["measured_tokens_per_s"] / best["measured_tokens_per_s"]
                 if best and pick and "measured_tokens_per_s" in pick else None)
        out.append({"cap_bytes": cap["cap_bytes"], "pick": cap["pick"],
                    "measured_best": best and best["kind"], "pick_vs_best": ratio,
                    "entries": entries})
    return out


def targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The planner's pick within 10% of the measured best's tokens/s, and within its cap."""
    caps = [c for r in rows for c in r.get("caps", []) if c["pick_vs_best"] is not None]
    if not caps:
        return []
    worst = min(caps, key=lambda c: c["pick_vs_best"])
    picks = [e for c in caps for e in c["entries"] if e["kind"] == c["pick"]]
    over = [e for e in picks if not e.get("within_cap")]
    return [{"target": "planner's pick >= 0.9x the measured best tokens/s at every cap",
             "value": f"worst {worst['pick_vs_best']:.2f}x ({len(caps)} caps)",
             "met": worst["pick_vs_best"] >= 0.9},
            {"target": "planner's pick's measured peak within the cap",
             "value": f"{len(picks) - len(over)}/{len(picks)}", "met": not over}]


def cost_model_spread(caps: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
    """The smallest and largest measured / predicted tokens/s over the measured entries,
    or None."""
    ratios = [e["measured_tokens_per_s"] / e["predicted_tokens_per_s"] for cap in caps
              for e in cap["entries"] if "measured_tokens_per_s" in e
              and e["predicted_tokens_per_s"] > 0]
    return (min(ratios), max(ratios)) if ratios else None


def _cell(entry: dict[str, Any] | None) -> str:
    if entry is None or not entry["fits"]:
        return "—"
    if "measured_tokens_per_s" not in entry:
        return f"b {entry['batch_size']}: not measured"
    over = "" if entry["within_cap"] else " (over the cap)"
    return (f"b {entry['batch_size']}: {entry['measured_tokens_per_s']:,.0f} "
            f"({entry['predicted_tokens_per_s']:,.0f}){over}")


def row_label(row: dict[str, Any]) -> str:
    return (f"d_model {row['d_model']}, depth {row['depth']}, length {row['seq_len']:,}, "
            f"{row['attention']} attention, batches up to {row['max_batch']}")


def table(payload: dict[str, Any]) -> str:
    """The documents' table: per row and cap, each trainer's batch and measured tokens/s
    (predicted in brackets), the pick, the measured best and their ratio."""
    lines = []
    for row in payload["rows"]:
        kinds = row["settings"]["kinds"]
        skipped = row.get("plan", {}).get("skipped_kinds", {})
        lines.append(f"{row_label(row['settings'])} (budget-limited size):")
        if "caps" not in row:
            lines += ["", f"not run: {row.get('plan', {}).get('error', 'no plan')}", ""]
            continue
        rows = []
        for cap in row["caps"]:
            by_kind = {e["kind"]: e for e in cap["entries"]}
            rows.append([report.mib(cap["cap_bytes"])]
                        + [_cell(by_kind.get(k)) for k in kinds if k not in skipped]
                        + [harness.TRAINERS.get(cap["pick"], "none fits"),
                           harness.TRAINERS.get(cap["measured_best"], "—"),
                           "—" if cap["pick_vs_best"] is None else f"{cap['pick_vs_best']:.2f}"])
        lines += ["", report.markdown_table(
            ["cap MiB"] + [f"{harness.TRAINERS[k]}: batch: tokens/s (predicted)"
                           for k in kinds if k not in skipped]
            + ["planner's pick", "measured best", "pick / best"], rows), ""]
        notes = [f"{harness.TRAINERS[k]}: skipped: {why}." for k, why in skipped.items()]
        spread = cost_model_spread(row["caps"])
        if spread:
            notes.append(f"Measured / predicted tokens/s (the planner's cost model): "
                         f"{spread[0]:.2f}x to {spread[1]:.2f}x.")
        if notes:
            lines += [" ".join(notes), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def settings(payload: dict[str, Any]) -> str:
    c = payload["config"]
    return (f"ReversibleTransformerLM, Adam, one device; each trainer at the largest batch "
            f"`plan(..., fixed_batch=False)` predicts to fit under the cap less its "
            f"{c['margin']:.0%} margin; tokens/s: median of {c['steps']} steps after "
            f"{c['warmup']} warm-up (predicted by the planner's cost model in brackets)")


def markdown(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    lines = [f"Tokens/s at memory caps; {settings(payload)}; {m['processor']}, "
             f"{m['cpu_count']} cores, {m['date']}.", "", table(payload)]
    for row in payload["rows"]:
        for r in row.get("measured", []):
            lines.append(f"- {row['row']} {r['id']}: " + budget.outcome(r, lambda r: (
                f"{r['tokens_per_s']:,.0f} tokens/s, peak {report.mib(r['peak_bytes'])} MiB"))
                + f"; load average {r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f}")
        if "plan" in row and "caps" in row["plan"]:
            seconds = sum(cap["plan_s"] for cap in row["plan"]["caps"])
            lines.append(f"- {row['row']}: planning took {seconds:.0f} s for "
                         f"{len(row['plan']['caps'])} caps")
    if payload.get("targets"):
        lines += ["", report.targets_table(payload["targets"])]
    return "\n".join(lines) + "\n"


def plot(path: Path, payload: dict[str, Any]) -> bool:
    """Measured tokens/s against the cap, a line per trainer, one panel per row; the
    planner's picks starred."""
    plt = report.pyplot(path)
    if plt is None:
        return False
    rows = [r for r in payload["rows"] if "caps" in r]
    fig, axes = plt.subplots(1, max(len(rows), 1), figsize=(6.5 * max(len(rows), 1), 4.4),
                             squeeze=False)
    for ax, row in zip(axes[0], rows, strict=False):
        for kind in row["settings"]["kinds"]:
            points = [(cap["cap_bytes"] / harness.MIB, e["measured_tokens_per_s"])
                      for cap in row["caps"] for e in cap["entries"]
                      if e["kind"] == kind and "measured_tokens_per_s" in e]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=harness.TRAINERS[kind])
        picks = [(cap["cap_bytes"] / harness.MIB, e["measured_tokens_per_s"])
                 for cap in row["caps"] for e in cap["entries"]
                 if e["kind"] == cap["pick"] and "measured_tokens_per_s" in e]
        if picks:
            ax.scatter(*zip(*picks, strict=True), marker="*", s=180, color="black",
                       zorder=3, label="planner's pick")
        ax.set_xscale("log")
        caps = [cap["cap_bytes"] / harness.MIB for cap in row["caps"]]
        ax.set_xticks(caps, [f"{c:,.1f}" for c in caps])
        ax.minorticks_off()
        ax.set_xlabel("memory cap (MiB)")
        ax.set_ylabel("measured tokens/s")
        ax.set_title(row_label(row["settings"]), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Tokens/s at the largest batch that fits each cap (budget-limited sizes)",
                 fontsize=10)
    report.save_figure(plt, fig, path)
    return True


def run_row(args: SimpleNamespace, name: str) -> dict[str, Any]:
    """Plans one row in a worker, measures what the plans chose, compares."""
    row = row_config(args, name)
    print(f"{NAME}: planning {name} ({row_label(row)}) at {args.n_caps} caps")
    (planned,) = budget.run_configs(
        [row | {"part": "plan", "id": f"{name}-plan"}],
        lambda r: "caps " + ", ".join(report.mib(c["cap_bytes"]) for c in r["caps"]) + " MiB",
        args.timeout)
    out = {"row": name, "settings": row, "plan": planned}
    if "caps" not in planned:
        return out
    configs = measure_configs(row, planned)
    print(f"{NAME}: measuring {len(configs)} (trainer, batch) pairs of {name}")
    out["measured"] = budget.run_configs(configs, lambda r: (
        f"{r['tokens_per_s']:,.0f} tokens/s, peak {report.mib(r['peak_bytes'])} MiB"),
        args.timeout)
    out["caps"] = compare(planned, out["measured"])
    return out


def main(args: SimpleNamespace) -> dict[str, Any]:
    """The caps part of `benchmarks.memory_budget.main` (``args`` its parsed flags)."""
    out = Path(args.out_dir)
    args.margin = FLAGS.margin
    args.n_caps = 2 if args.quick and not FLAGS["n_caps"].present else FLAGS.n_caps
    if args.render_only:
        payload = report.read_json(out / f"{NAME}.json")
    else:
        machine = harness.machine_info(args.command)
        rows = [run_row(args, name) for name in FLAGS.caps_rows]
        payload = {"benchmark": NAME, "machine": machine,
                   "config": {"rows": FLAGS.caps_rows, "n_caps": args.n_caps,
                              "margin": args.margin, "steps": args.steps,
                              "warmup": args.warmup, "quick": args.quick,
                              "host_allocator": harness.host_heap.host_allocator_choice()},
                   "rows": rows}
    payload["targets"] = targets(payload["rows"])
    report.write_json(out / f"{NAME}.json", payload)
    text = markdown(payload)
    (out / f"{NAME}.md").write_text(text)
    plot(out / f"{NAME}.png", payload)
    print(text)
    print(f"wrote {out / NAME}.json, .md, .png")
    return payload
