"""Renders every benchmark table of the README and docs/ from benchmarks/results.

Usage (from the repository root)::

    python benchmarks/render_tables.py          # rewrite the tables in place
    python benchmarks/render_tables.py --check  # exit 1, naming each stale table

A document marks each generated table by name; everything between the two markers is
this script's output and is replaced whole::

    <!-- table: step_time -->
    | trainer | ... |
    <!-- end table -->

Each table reads the result sets listed in `TABLES` (JSON written by the benchmark
scripts) and ends with a line naming them with the date, machine and settings they
recorded, so no figure in a document is typed by hand. A table name that `TABLES` does not
know, or a marker without its end, is an error.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # Run as a script: make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import first_step as first_step_runs  # noqa: E402
from benchmarks import memory_budget as budget_runs  # noqa: E402
from benchmarks import memory_budget_caps as caps_runs  # noqa: E402
from benchmarks import quality as quality_runs  # noqa: E402
from benchmarks import quality_report as qr  # noqa: E402
from benchmarks import report  # noqa: E402
from benchmarks import sequence_length as lengths  # noqa: E402
from benchmarks import sequence_mesh as mesh_runs  # noqa: E402
from benchmarks.harness import MIB, RESULTS_DIR, TRAINERS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- table: (?P<name>[a-z0-9_]+) -->\n(?P<body>.*?)<!-- end table -->",
                   re.S)
OPENING = re.compile(r"<!-- table: (?P<name>[^ ]*) -->")
SINGLE_DEVICE = ("trainer", "trainer_remat", "reversible", "memory_efficient")


def load(name: str) -> dict[str, Any]:
    """The result set ``benchmarks/results/<name>.json`` (``name`` may hold a folder)."""
    return report.read_json(RESULTS_DIR / f"{name}.json")


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _source(name: str, payload: dict[str, Any], settings: str) -> str:
    m = payload["machine"]
    where = f"{m['processor']} ({m['cpu_count']} cores)"
    if m.get("device"):  # A set measured on an accelerator names it first.
        where = f"{m['device']}, host {where}"
    return (f"`benchmarks/results/{name}.json`: {m['date'][:10]}, {where}, jax {m['jax']}; "
            f"{settings}")


def _with_sources(table: str, *lines: str) -> str:
    """``table`` followed by one ``Source: ...`` paragraph per result set it read."""
    return table.rstrip("\n") + "\n" + "".join(f"\nSource: {line}.\n" for line in lines)


def _rows_by_kind(payload: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return report.by_key(payload["results"])


def _settings(payload: dict[str, Any]) -> str:
    """`report.settings_line` of a result set, its mode labels limited to the trainers
    that ran."""
    return report.settings_line(payload["config"],
                                sorted({r["trainer"] for r in payload["results"]}))


def _memory_settings(payload: dict[str, Any]) -> str:
    methods = {r.get("method", "ledger") for r in payload["results"]}
    method = ("the allocator's peak (`memory_stats`)" if methods == {"memory_stats"}
              else "ledger (`revtrain.memory`)")
    return f"{_settings(payload)}; method: {method}"


def _step_settings(payload: dict[str, Any]) -> str:
    c = payload["config"]
    rounds = c.get("rounds", 1)
    return (f"{_settings(payload)}; median of {c['steps']} steps after {c['warmup']} "
            f"warm-up step{'s' if c['warmup'] > 1 else ''}"
            f"{f' in each of {rounds} rounds' if rounds > 1 else ''}")


# ------------------------------------------------------------------------------------------
# The tables.

def summary() -> str:
    """The README's table: peak memory at the shallowest and deepest depth, step time."""
    memory, steps = load("memory_vs_depth"), load("step_time")
    mem, step = _rows_by_kind(memory), _rows_by_kind(steps)
    lo, hi = min(memory["depths"]), max(memory["depths"])
    (depth,) = steps["depths"]
    rows = [[TRAINERS[k], report.mib(mem[(k, lo)]["peak_bytes"]),
             report.mib(mem[(k, hi)]["peak_bytes"]),
             report.mib(mem[(k, hi)]["weights_and_slots_bytes"]),
             _ratio(step[(k, depth)]["ratio_to_trainer"]) if (k, depth) in step
             else "not measured"]
            for k in SINGLE_DEVICE if (k, hi) in mem]
    table = report.markdown_table(
        ["trainer", f"peak device MiB, depth {lo}", f"depth {hi}",
         f"of which weights + slots, depth {hi}", f"step time vs Trainer, depth {depth}"],
        rows)
    return _with_sources(table, _source("memory_vs_depth", memory, _memory_settings(memory)),
                         _source("step_time", steps, _step_settings(steps)))


def memory_by_depth(name: str = "memory_vs_depth") -> str:
    """Peak device memory of every trainer at every depth (result set ``name``)."""
    payload = load(name)
    table = _rows_by_kind(payload)
    kinds = [k for k in TRAINERS if any(r["trainer"] == k for r in payload["results"])]
    rows = [[d] + [report.mib(table[(k, d)]["peak_bytes"]) if (k, d) in table else "—"
                   for k in kinds] for d in sorted(payload["depths"])]
    return _with_sources(report.markdown_table(["depth"] + [TRAINERS[k] for k in kinds], rows),
                         _source(name, payload, _memory_settings(payload)))


def memory_by_depth_gpu() -> str:
    """`memory_by_depth` of the set measured on one GPU (the allocator's high-water mark)."""
    return memory_by_depth("memory_vs_depth_gpu")


def memory_breakdown() -> str:
    """Per device at the deepest depth: the peak split into weights + slots and the rest."""
    payload = load("memory_vs_depth")
    hi = max(payload["depths"])
    rows = [[TRAINERS[r["trainer"]], r["n_devices"], report.mib(r["peak_bytes"]),
             report.mib(r["weights_and_slots_bytes"]), report.mib(r["rest_bytes"])]
            for r in payload["results"] if r["depth"] == hi and "error" not in r]
    table = report.markdown_table(
        ["trainer", "devices", f"peak per device, depth {hi} (MiB)",
         "weights + slots (MiB)", "rest (MiB)"], rows)
    return _with_sources(table, _source("memory_vs_depth", payload, _memory_settings(payload)))


def _targets(names: Sequence[str]) -> str:
    rows = [[c["target"], c["value"], "yes" if c["met"] else "**no**", f"`{name}`"]
            for name in names for c in load(name).get("targets", [])]
    return report.markdown_table(["target", "measured", "met", "result set"], rows) + "\n"


def memory_targets() -> str:
    """The memory benchmark's targets, as it computed them."""
    return _targets(["memory_vs_depth"])


def _step_table(name: str) -> str:
    payload = load(name)
    rows = []
    for kind in TRAINERS:
        for r in sorted((r for r in payload["results"]
                         if r["trainer"] == kind and "error" not in r),
                        key=lambda r: r["depth"]):
            rows.append([TRAINERS[kind], r["depth"], f"{r['median_step_s']:.2f}",
                         _ratio(r.get("ratio_to_trainer")), f"{r['median_cpu_s']:.2f}",
                         _ratio(r.get("cpu_ratio_to_trainer")),
                         f"{r['n_quiet_steps']}/{r['n_steps']}", f"{r['first_step_s']:.1f}",
                         f"{r['first_step_compile_s']:.1f}", r["n_dispatches_per_step"]])
    table = report.markdown_table(
        ["trainer", "depth", "median step (s)", "vs Trainer", "CPU s/step",
         "vs Trainer (CPU)", "quiet steps", "first step (s)",
         "compiling, all threads (s)", "programs/step"], rows)
    return _with_sources(table, _source(name, payload, _step_settings(payload)))


def step_time() -> str:
    """Step time at depth 16: the pooled, interleaved rounds."""
    return _step_table("step_time")


def step_time_depths() -> str:
    """Step time and first step at the shallowest and deepest depths."""
    return _step_table("step_time_depths_2_32/step_time")


def step_time_system_allocator() -> str:
    """Step time at depth 16 with glibc's allocator as a plain script has it."""
    return _step_table("step_time_system_allocator/step_time")


def step_time_targets() -> str:
    """The step-time benchmark's targets, as it computed them."""
    return _targets(["step_time", "step_time_system_allocator/step_time",
                     "step_time_depths_2_32/step_time"])


def step_time_fsdp() -> str:
    """The block trainers' step with and without FSDP, on the same devices, one run."""
    name = "step_time_fsdp/step_time"
    payload = load(name)
    table = _rows_by_kind(payload)
    (depth,) = payload["depths"]
    rows = []
    for kind in ("trainer", "reversible", "memory_efficient"):
        plain, sharded = table.get((kind, depth)), table.get((f"{kind}_fsdp", depth))
        if plain and sharded:
            rows.append([TRAINERS[kind], f"{plain['median_step_s']:.2f}",
                         f"{sharded['median_step_s']:.2f}",
                         _ratio(sharded["median_step_s"] / plain["median_step_s"]),
                         _ratio(sharded["median_cpu_s"] / plain["median_cpu_s"])])
    table = report.markdown_table(
        ["trainer", "median step (s)", "with FSDP (s)", "FSDP / without",
         "FSDP / without (CPU time)"], rows)
    return _with_sources(table, _source(name, payload, _step_settings(payload)
                                        + f"; depth {depth}"))


def host_memory() -> str:
    """Peak RSS and CPU time per step with the tuned (default) and the system allocator."""
    tuned, system = load("host_memory"), load("host_memory_system_allocator/host_memory")
    other = _rows_by_kind(system)
    rows = [[TRAINERS[r["trainer"]], r["depth"], report.mib(r["peak_rss_bytes"]),
             report.mib(other[(r["trainer"], r["depth"])]["peak_rss_bytes"]),
             f"{r['median_cpu_s']:.2f}",
             f"{other[(r['trainer'], r['depth'])]['median_cpu_s']:.2f}"]
            for r in tuned["results"] if "error" not in r]
    table = report.markdown_table(
        ["trainer", "depth", "peak RSS, tuned (MiB)", "system allocator (MiB)",
         "CPU s/step, tuned", "system allocator"], rows)
    return _with_sources(
        table, _source("host_memory", tuned, _settings(tuned)),
        _source("host_memory_system_allocator/host_memory", system,
                _settings(system)))


def host_overhead() -> str:
    """Host time and programs per step of the block trainers on a tiny model, and the
    dispatch targets."""
    from benchmarks import host_overhead as overhead
    payload = load(overhead.NAME)
    c = payload["config"]
    settings = (f"ReversibleTransformerLM d_model {c['d_model']}, d_ff {2 * c['d_model']}, "
                f"2 heads, seq 16, batch 4, dropout 0.1, Adam, one device, a fresh process each, "
                f"{'with ' + ', '.join(c['malloc_env']) if c.get('malloc_env') else 'system'}"
                f" allocator; median of {c['steps']} steps after {c['warmup']}")
    return _with_sources(overhead.table(payload) + "\n\n"
                         + report.targets_table(payload["targets"]),
                         _source(overhead.NAME, payload, settings))


WINDOWS = "memory_efficient_windows"


def memory_efficient_windows() -> str:
    """`MemoryEfficientTrainer` one program per layer against ``scan_window``: peak device
    memory at the shallowest and deepest depth, programs per step and step time."""
    sets = [("memory_vs_depth", "step_time"),
            (f"{WINDOWS}/memory_vs_depth", f"{WINDOWS}/step_time")]
    payloads = [(load(mem), load(step)) for mem, step in sets]
    depths = payloads[1][0]["depths"]
    lo, hi = min(depths), max(depths)
    (depth,) = payloads[1][1]["depths"]
    rows = []
    for mem, step in payloads:
        m, t = _rows_by_kind(mem), _rows_by_kind(step)
        window = mem["config"].get("scan_window")
        timed = t.get(("memory_efficient", depth), {})
        rows.append([f"scan_window={window}" if window else "one program per layer",
                     report.mib(m[("memory_efficient", lo)]["peak_bytes"]),
                     report.mib(m[("memory_efficient", hi)]["peak_bytes"]),
                     report.mib(m[("memory_efficient", hi)]["weights_and_slots_bytes"]),
                     timed.get("n_dispatches_per_step", "—"),
                     _ratio(timed.get("ratio_to_trainer"))])
    table = report.markdown_table(
        ["MemoryEfficientTrainer", f"peak device MiB, depth {lo}", f"depth {hi}",
         f"of which weights + slots, depth {hi}", f"programs/step, depth {depth}",
         f"step time vs Trainer, depth {depth}"], rows)
    return _with_sources(table, *(
        _source(name, payload, _memory_settings(payload) if name.endswith("memory_vs_depth")
                else _step_settings(payload))
        for (mem, step), pair in zip(sets, payloads, strict=True)
        for name, payload in zip((mem, step), pair, strict=True)))


def reconstruction_drift() -> str:
    """Worst reconstruction and gradient errors by depth, precision and ``keep_every``."""
    payload = load("reconstruction_drift")
    found = {(r["depth"], r["compute_dtype"], r["keep_every"], r.get("variant", "plain")): r
             for r in payload["results"]}

    def cell(depth, dtype, keep, variant="plain", grad=True):
        r = found.get((depth, dtype, keep, variant))
        if r is None:
            return "—"
        errors = [r["worst_error"]] + ([r.get("worst_gradient_error")] if grad else [])
        return " / ".join("n/a" if e is None else f"{e:.1e}" for e in errors)

    rows = []
    for depth in sorted({r["depth"] for r in payload["results"]}):
        kept = found.get((depth, "bfloat16", 8, "plain"))
        rows.append([depth, cell(depth, "float32", None, grad=False),
                     cell(depth, "bfloat16", None), cell(depth, "bfloat16", 8),
                     "—" if kept is None else f"{kept['kept_bytes'] / MIB:.2f} "
                                              f"({kept['kept_copies']})",
                     cell(depth, "bfloat16", None, "round_inputs")])
    c = payload["config"]
    settings = (f"ReversibleTransformerLM d_model {c['d_model']}, d_ff {c['d_ff']}, "
                f"{c['n_heads']} heads, seq {c['seq_len']}, batch {c['batch_size']}, dropout "
                f"{c['dropout']}, float32 streams; gradients against `Trainer` in the same "
                f"precision; {payload.get('note', '')}")
    table = report.markdown_table(
        ["depth", "float32: worst rec.", "bfloat16: worst rec. / grad.",
         "bfloat16 + keep_every 8: worst rec. / grad.", "its kept copies: MiB (count)",
         "bfloat16, inputs rounded: worst rec. / grad."], rows)
    return _with_sources(table, _source("reconstruction_drift", payload, settings))


def sequence_length() -> str:
    """Peak memory, RSS and step time against length, beside Trax's Reformer."""
    payload = load("sequence_length")
    c = payload["config"]
    m = payload["machine"]
    elsewhere = {}  # Variants measured on another machine (rows replaced by --update).
    for r in payload["results"]:
        if r.get("processor", m["processor"]) != m["processor"]:
            elsewhere.setdefault(lengths.variant_label(r["variant"]),
                                 f"{r['processor']}, {r['measured'][:10]}")
    settings = (f"`ReversibleSerialTrainer`, one device, d_model {c['d_model']}, d_ff "
                f"{c['d_ff']}, {c['n_layers']} layers, {c['n_heads']} heads, batch "
                f"{c['batch_size']}, vocab {c['vocab_size']}, dropout {c['dropout']}, Adam; "
                f"host allocator {c['host_allocator']}"
                + "".join(f"; the {label} rows on {where}" for label, where in elsewhere.items()))
    table = lengths.readme_table(payload).rstrip("\n") + "\n\n" + lengths.notes(payload) + "\n"
    return _with_sources(table, _source("sequence_length", payload, settings))


def _ring_source(name: str, payload: dict[str, Any]) -> str:
    c = payload["config"]
    return _source(name, payload, f"random float32 `q, k, v` `[{c['batch']}, {c['length']:,}, "
                                  f"{c['heads']}, {c['d_head']}]`, block {c['block_size']}, "
                                  f"{c['n_shards']} forced {c['platform']} devices")


def ring_attention() -> str:
    """Ring attention against one-device blockwise attention: error, time, bytes."""
    exact, big = load("ring_attention"), load("ring_attention_65536_memory")
    errors = report.markdown_table(
        ["tensor", "max abs error", "relative to the largest value"],
        [[name, f"{e['max_abs_error']:.1e}", f"{e['relative']:.1e}"]
         for name, e in exact["errors"].items()])
    rows = []
    for payload in (exact, big):
        for key, label in (("ring", "ring"), ("blockwise_one_device", "blockwise, 1 device")):
            r = payload[key]
            rows.append([f"{payload['config']['length']:,}", label,
                         f"{r['run_s']:.1f}" if "run_s" in r else "not run",
                         report.mib(r["temp_bytes_per_device"]),
                         report.mib(r["total_bytes_per_device"])])
    memory = report.markdown_table(
        ["length", "program", "forward + backward (s)", "temporaries per device (MiB)",
         "all per device (MiB)"], rows)
    return _with_sources(errors + "\n\n" + memory,
                         _ring_source("ring_attention", exact),
                         _ring_source("ring_attention_65536_memory", big))


def ring_balance() -> str:
    """Ring steps per shard for the striped, contiguous and zig-zag layouts."""
    payloads = [load("ring_attention"), load("ring_attention_65536_memory")]
    lengths = [f"{p['config']['length']:,}" for p in payloads]
    rows = [[layout] + [f"{p['balance'][layout]['worst_step_max_over_mean']:.2f} / "
                        f"{p['balance'][layout]['slowdown']:.2f}" for p in payloads]
            for layout in payloads[0]["balance"]]
    table = report.markdown_table(
        ["layout"] + [f"length {n}: worst step max/mean / slowdown" for n in lengths], rows)
    return _with_sources(table, _ring_source("ring_attention", payloads[0]),
                         _ring_source("ring_attention_65536_memory", payloads[1]))


def sequence_mesh() -> str:
    """The named-mesh runs (`benchmarks.sequence_mesh`) and their targets."""
    payload = load("sequence_mesh")
    c = payload["config"]
    settings = (f"`{TRAINERS[c['trainer']]}`, {mesh_runs.N_DEVICES} forced devices, d_model "
                f"{c['d_model']}, d_ff {c['d_ff']}, {c['n_layers']} layers, {c['n_heads']} "
                f"heads, vocab {c['vocab_size']}, blockwise attention (block "
                f"{c['block_size']}) with ff chunks {c['ff_chunk_size']}, Adam")
    earlier = sorted({(r["kind"], r["processor"], r["measured"][:10])
                      for r in payload["results"] if "measured" in r})  # Kept by --update.
    settings += "".join(f"; the {kind} rows on {where}, {day}" for kind, where, day in earlier)
    return _with_sources(mesh_runs.tables(payload), _source("sequence_mesh", payload, settings))


def first_step() -> str:
    """Time to first step by trainer and depth, cold and warm compilation cache; scanned
    against unrolled `Trainer` steps; a deep plain Serial (`benchmarks.first_step`)."""
    payload = load("first_step")
    return _with_sources(first_step_runs.tables(payload),
                         _source("first_step", payload, first_step_runs.settings(payload)))


def quality() -> str:
    """Held-out bits per byte per configuration, mean ± std over seeds, and the targets;
    the pilot that sets a converged run's steps (`benchmarks.quality --pilot`)."""
    payload, pilot = load("quality"), load("quality_pilot")
    table = quality_runs.tables(payload) + "\n"
    return _with_sources(table, _source("quality", payload, quality_runs.settings(payload)),
                         _source("quality_pilot", pilot, quality_runs.pilot_settings(pilot)))


def quality_summary() -> str:
    """The quality table without the ablation and the targets (the README's)."""
    payload = load("quality")
    table = quality_runs.summary_tables(payload) + "\n"
    return _with_sources(table, _source("quality", payload, quality_runs.settings(payload)))


def quality_reference_rerun() -> str:
    """The ablation's reference configuration rerun at later code, per seed, and each
    factor's difference against both (`benchmarks.quality_report.rerun_table`)."""
    name = "quality_reference_rerun/quality"
    payload, rerun = load("quality"), load(name)
    table = qr.rerun_table(payload["results"], rerun["results"]) + "\n"
    return _with_sources(table, _source(name, rerun, quality_runs.settings(rerun)))


def _not_measured(name: str, part: str) -> str | None:
    """None when ``benchmarks/results/<name>.json`` exists, else what its table says until
    a run writes it."""
    if (RESULTS_DIR / f"{name}.json").exists():
        return None
    return (f"Not measured yet: `python benchmarks/memory_budget.py --part={part}` writes "
            f"`benchmarks/results/{name}.json`, and `python benchmarks/render_tables.py` "
            f"then fills this table.\n")


def memory_budget() -> str:
    """Predicted against measured peak per configuration, and the worst case."""
    pending = _not_measured(budget_runs.NAME, "accuracy")
    if pending:
        return pending
    payload = load(budget_runs.NAME)
    return _with_sources(budget_runs.accuracy_table(payload),
                         _source(budget_runs.NAME, payload, budget_runs.settings(payload)))


def memory_budget_caps() -> str:
    """Tokens/s of each trainer at memory caps, the planner's pick against the measured
    best."""
    pending = _not_measured(caps_runs.NAME, "caps")
    if pending:
        return pending
    payload = load(caps_runs.NAME)
    return _with_sources(caps_runs.table(payload),
                         _source(caps_runs.NAME, payload, caps_runs.settings(payload)))


def memory_budget_deep() -> str:
    """Bytes per token per model dimension at depth 12 and 32, 16K and 64K tokens."""
    pending = _not_measured(budget_runs.DEEP_NAME, "deep")
    if pending:
        return pending
    payload = load(budget_runs.DEEP_NAME)
    return _with_sources(budget_runs.deep_table(payload),
                         _source(budget_runs.DEEP_NAME, payload,
                                 budget_runs.deep_settings(payload)))


TABLES: dict[str, Callable[[], str]] = {
    fn.__name__: fn for fn in (
        summary, memory_by_depth, memory_by_depth_gpu, memory_breakdown, memory_targets, step_time,
        step_time_depths, step_time_system_allocator, step_time_targets, step_time_fsdp,
        first_step, host_memory, host_overhead, memory_efficient_windows, reconstruction_drift,
        sequence_length, ring_attention, ring_balance, sequence_mesh, quality,
        quality_summary, quality_reference_rerun, memory_budget, memory_budget_caps,
        memory_budget_deep)}


# ------------------------------------------------------------------------------------------
# Documents.

def documents() -> list[Path]:
    """The README and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def render(text: str, where: str = "<text>") -> str:
    """``text`` with every marked table replaced by what its result sets give.

    Raises:
      ValueError: for a table name `TABLES` lacks, or a marker without ``<!-- end table
        -->``, naming ``where`` and the table.
    """
    opened = [m["name"] for m in OPENING.finditer(text)]
    closed = [m["name"] for m in BLOCK.finditer(text)]
    if opened != closed:
        missing = next(n for n in opened if opened.count(n) != closed.count(n))
        raise ValueError(f"{where}: the table marker '{missing}' has no "
                         f"'<!-- end table -->' after it; close it")
    unknown = sorted(set(closed) - set(TABLES))
    if unknown:
        raise ValueError(f"{where}: unknown table {unknown[0]!r}; use one of "
                         f"{', '.join(TABLES)} (benchmarks/render_tables.py)")
    return BLOCK.sub(lambda m: f"<!-- table: {m['name']} -->\n{TABLES[m['name']]()}"
                               f"<!-- end table -->", text)


def stale(paths: Sequence[Path] | None = None) -> list[str]:
    """The documents (relative paths) whose tables differ from what the results give."""
    return [str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
            for p in (paths or documents()) if render(p.read_text(), str(p)) != p.read_text()]


def used_tables(paths: Sequence[Path] | None = None) -> set[str]:
    """The table names the documents mark."""
    return {m["name"] for p in (paths or documents()) for m in BLOCK.finditer(p.read_text())}


def main(argv: Sequence[str]) -> int:
    if argv not in ([], ["--check"]):
        print(f"usage: python benchmarks/render_tables.py [--check]; got {argv}",
              file=sys.stderr)
        return 2
    if argv:
        out_of_date = stale()
        for path in out_of_date:
            print(f"{path}: a benchmark table differs from benchmarks/results; run "
                  f"python benchmarks/render_tables.py", file=sys.stderr)
        return 1 if out_of_date else 0
    for path in documents():
        text = path.read_text()
        new = render(text, str(path))
        if new != text:
            path.write_text(new)
            print(f"rewrote the tables of {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
