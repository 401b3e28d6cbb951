"""Time to first step against depth, with a cold and a warm compilation cache.

Usage (from the repository root, after ``pip install -e '.[bench]'``)::

    python benchmarks/first_step.py                     # every part, the sizes below
    python benchmarks/first_step.py --quick             # tiny sizes, a check that it runs
    python benchmarks/first_step.py --parts=scan --scan_rounds=7

The model is the benchmarks' reversible LM (`benchmarks.harness.model`: here d_model 128,
d_ff 512, 4 heads, seq 128, batch 8, vocab 256, dropout 0.1) with ``CrossEntropyLoss``,
trained with Adam on one device; ``--quick`` and the shared model flags change the sizes.
Three parts (``--parts``, all by default), every configuration in a fresh process, the
1-, 5- and 15-minute load averages (`os.getloadavg`) recorded before and after each; one
unrecorded process runs first, so that no recorded one reads Python, JAX and XLA from disk:

* ``first_step`` -- for each kind (``--kinds``: `Trainer`, `Trainer` with
  ``scan_layers=False`` for comparison, `ReversibleSerialTrainer`,
  `MemoryEfficientTrainer`) and depth (``--depths``, default 2,8,32): model construction,
  init, trainer construction, first step (until every update landed) and their sum, the
  "total"; the seconds JAX spent tracing, lowering and compiling per phase (its
  `jax.monitoring` events, summed over threads) and the block trainers'
  ``trainer.compile_times`` (the first step's wall clock split). Each configuration runs
  twice: *cold*, with a fresh empty ``jax_compilation_cache_dir``, then *warm*, a second
  fresh process on that directory (set as `revtrain.training.build_loop` sets it); a
  trainer's depths run back to back, so the ratio between them sees one machine load. The
  ratios: total at the deepest depth over the shallowest, cold (target <= 1.25x), and
  warm over cold first step (target <= 0.3x at every depth).
* ``scan`` -- steady step time of `Trainer` with ``scan_layers=True`` against ``False`` at
  ``--scan_depths`` (default 2,32): one process per depth builds both trainers on one
  model, takes ``--warmup`` steps with each, then ``--scan_rounds`` rounds of ``--steps``
  steps, alternating which goes first; medians over quiet steps as ``step_time.py``
  takes them, and their ratio (target: within 5%).
* ``deep_serial`` -- `Trainer` on ``Serial`` of ``--serial_layers`` (default 100,800)
  ``Dense(2)`` layers, a [batch, 2] input and a cross-entropy loss (google/trax#1697's
  model), cache off: compile seconds per layer (all phases), target: the deepest's at
  most 2x the shallowest's.

Writes ``first_step.json``, ``.md`` and ``.png`` to ``--out_dir``; ``--render_only``
recomputes the ratios and targets from the JSON and rewrites all three.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # Run as a script: make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import flags  # noqa: E402

from benchmarks import harness, report  # noqa: E402
from benchmarks.first_step_worker import KINDS, measure  # noqa: E402

NAME = "first_step"
PARTS = ("first_step", "scan", "deep_serial")
TARGET_KINDS = ("trainer", "reversible", "memory_efficient")
DEFAULTS = {"depths": "2,8,32", "d_model": 128, "d_ff": 512, "seq_len": 128,
            "scan_depths": "2,32", "scan_rounds": 5, "serial_layers": "100,800",
            "steps": 3, "warmup": 2}
QUICK_DEFAULTS = {"scan_depths": "2,4", "scan_rounds": 2, "serial_layers": "10,80",
                  "steps": 1, "warmup": 1}
"""This script's defaults where no flag sets them (``--quick``: harness.QUICK's sizes and
depths, and these)."""
LIMITS = {"depth": 1.25, "warm": 0.3, "scan": 0.05, "serial": 2.0}

flags.adopt_module_key_flags(harness)
flags.DEFINE_list("parts", list(PARTS), f"which measurements: any of {', '.join(PARTS)}")
flags.DEFINE_list("kinds", list(KINDS), f"trainers of the first_step part: any of "
                  f"{', '.join(KINDS)}")
flags.DEFINE_list("scan_depths", None, f"depths of the scan part (default "
                  f"{DEFAULTS['scan_depths']}, --quick {QUICK_DEFAULTS['scan_depths']})")
flags.DEFINE_integer("scan_rounds", None, f"rounds of the scan part (default "
                     f"{DEFAULTS['scan_rounds']})", lower_bound=1)
flags.DEFINE_list("serial_layers", None, f"Dense layers of the deep_serial part (default "
                  f"{DEFAULTS['serial_layers']}, --quick {QUICK_DEFAULTS['serial_layers']})")
flags.register_validator("parts", lambda v: bool(v) and set(v) <= set(PARTS),
                         f"--parts must name some of {','.join(PARTS)}")
flags.register_validator("kinds", lambda v: bool(v) and set(v) <= set(KINDS),
                         f"--kinds must name some of {','.join(KINDS)}")
for _name in ("scan_depths", "serial_layers"):
    flags.register_validator(_name, lambda v: v is None or harness.positive_ints(v),
                             f"--{_name} must be positive integers, e.g. 2,32")


def parse(argv: Sequence[str] | None) -> Any:
    """The run's settings: `harness.parse_flags`, then `DEFAULTS` (or `QUICK_DEFAULTS`
    with ``--quick``) for what no flag set."""
    args = harness.parse_flags(argv, steps=DEFAULTS["steps"], warmup=DEFAULTS["warmup"])
    own = DEFAULTS | (QUICK_DEFAULTS if args.quick else {})
    for name, value in own.items():  # --quick keeps harness.QUICK's sizes and depths.
        if not (flags.FLAGS[name].present or args.quick and name in harness.QUICK):
            setattr(args, name, value)
    for name in ("depths", "scan_depths", "serial_layers"):
        value = getattr(args, name)
        setattr(args, name, [int(v) for v in (value.split(",") if isinstance(value, str)
                                              else value)])
    return args


# ------------------------------------------------------------------------------------------
# Running the workers.

def _worker(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """`harness.run_worker` of this script, with the load averages around it."""
    before = os.getloadavg()
    result = harness.run_worker(str(Path(__file__).resolve()), config, timeout)
    return result | {"loadavg_before": list(before), "loadavg_after": list(os.getloadavg())}


def _cold_and_warm(config: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Two processes on one fresh cache directory, which is removed afterwards."""
    cache = tempfile.mkdtemp(prefix="revtrain_first_step_")
    try:
        rows = []
        for mode in ("cold", "warm"):
            row = _worker(config | {"cache": mode, "cache_dir": cache}, timeout)
            size = sum(p.stat().st_size for p in Path(cache).rglob("*") if p.is_file())
            rows.append({k: v for k, v in row.items() if k != "cache_dir"} | {
                "cache_bytes": size})
        return rows
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _describe(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"ERROR {r['error']}"
    if r["part"] == "scan":
        scan, unrolled = r["kinds"]["trainer"], r["kinds"]["trainer_unrolled"]
        return (f"scanned {scan['median_step_s']:.3f} s/step, unrolled "
                f"{unrolled['median_step_s']:.3f} s/step")
    return (f"total {r['total_s']:.1f} s (first step {r['first_step_s']:.1f} s, compiling "
            f"{r['compile_total_s']:.1f} s, {r['cache_hits']} cache hits)")


def _label(config: dict[str, Any]) -> str:
    if config["part"] == "scan":
        return f"Trainer scanned vs unrolled, depth {config['depth']}"
    if config["part"] == "deep_serial":
        return f"Trainer, Serial of {config['depth']} Dense(2)"
    return f"{KINDS[config['trainer']]}, depth {config['depth']}"


def run(args: Any) -> dict[str, Any]:
    """Runs the parts asked for (``args.jobs`` units at a time); the payload."""
    machine = harness.machine_info(args.command)
    base = harness.model_config(args) | {"model": "lm", "rounds": args.scan_rounds}
    units = []  # (part, config): a first_step unit runs its cold and warm processes.
    if "first_step" in args.parts:  # A trainer's depths back to back: their ratio is read.
        units += [("first_step", base | {"part": "first_step", "trainer": kind, "depth": d,
                                         "compilation_cache_dir": None})
                  for kind in args.kinds for d in args.depths]
    if "scan" in args.parts:
        units += [("scan", base | {"part": "scan", "depth": d}) for d in args.scan_depths]
    if "deep_serial" in args.parts:
        units += [("deep_serial", base | {"part": "deep_serial", "model": "dense_serial",
                                          "trainer": "trainer", "depth": n, "cache_dir": None,
                                          "compilation_cache_dir": None})
                  for n in args.serial_layers]

    def one(k_unit):
        k, (part, config) = k_unit
        rows = (_cold_and_warm(config, args.timeout) if part == "first_step"
                else [_worker(config, args.timeout)])
        for r in rows:
            mode = f", {r['cache']}" if "cache" in r else ""
            print(f"[{k}/{len(units)}] {_label(config)}{mode}: {_describe(r)}", flush=True)
        return part, rows

    print(f"{NAME}: {len(units)} configurations, {settings_line(base)}")
    # Not recorded: the first process after a while reads Python, JAX and XLA from disk.
    warmup = _worker(base | {"part": "deep_serial", "model": "dense_serial", "depth": 2,
                             "trainer": "trainer", "cache_dir": None,
                             "compilation_cache_dir": None}, args.timeout)
    print(f"warm-up process (not recorded): {warmup.get('worker_wall_s', math.nan):.1f} s"
          + (f", ERROR {warmup['error']}" if "error" in warmup else ""), flush=True)
    payload = {"benchmark": NAME, "machine": machine, "parts": list(args.parts),
               "config": base | {"quick": args.quick, "parts": list(args.parts)},
               **{part: [] for part in PARTS}}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for part, rows in pool.map(one, enumerate(units, 1)):
            payload[part] += rows
    return payload


# ------------------------------------------------------------------------------------------
# Ratios and targets (also for --render_only).

def _ok(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "error" not in r]


def derive(payload: dict[str, Any]) -> None:
    """Sets the ratios: warm over cold per row, the depth ratios, scanned over unrolled
    and compile seconds per layer; then ``payload['targets']``."""
    cells = {(r["trainer"], r["depth"], r["cache"]): r for r in _ok(payload["first_step"])}
    for (kind, depth, mode), r in cells.items():
        cold = cells.get((kind, depth, "cold"))
        if mode == "warm" and cold:
            r["warm_over_cold_first_step"] = r["first_step_s"] / cold["first_step_s"]
            r["warm_over_cold_total"] = r["total_s"] / cold["total_s"]
    payload["depth_ratios"] = []
    for kind in KINDS:
        for mode in ("cold", "warm"):
            depths = sorted(d for k, d, m in cells if (k, m) == (kind, mode))
            if len(depths) > 1:
                lo, hi = cells[(kind, depths[0], mode)], cells[(kind, depths[-1], mode)]
                payload["depth_ratios"].append({
                    "trainer": kind, "cache": mode, "from_depth": depths[0],
                    "to_depth": depths[-1], "total": hi["total_s"] / lo["total_s"],
                    "first_step": hi["first_step_s"] / lo["first_step_s"],
                    "compile": hi["compile_total_s"] / max(lo["compile_total_s"], 1e-9)})
    for r in _ok(payload["scan"]):
        scan, unrolled = r["kinds"]["trainer"], r["kinds"]["trainer_unrolled"]
        quiet = scan["n_quiet_steps"] > 0 and unrolled["n_quiet_steps"] > 0
        key = "median_step_s" if quiet else "median_step_all_s"
        r["ratio"], r["ratio_from"] = scan[key] / unrolled[key], key
        r["cpu_ratio"] = scan["median_cpu_s"] / unrolled["median_cpu_s"]
    serial = sorted(_ok(payload["deep_serial"]), key=lambda r: r["depth"])
    for r in serial:
        r["compile_per_layer_s"] = r["compile_total_s"] / r["depth"]
        r["per_layer_ratio"] = r["compile_per_layer_s"] / (
            serial[0]["compile_total_s"] / serial[0]["depth"])
    payload["targets"] = targets(payload)


def targets(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, where their configurations were measured."""
    checks = []
    for d in payload["depth_ratios"]:
        if d["cache"] == "cold" and d["trainer"] in TARGET_KINDS:
            checks.append({"target": f"{KINDS[d['trainer']]} build + init + first step, cold "
                                     f"cache, depth {d['to_depth']} <= {LIMITS['depth']}x "
                                     f"depth {d['from_depth']}",
                           "value": f"{d['total']:.2f}x", "met": d["total"] <= LIMITS["depth"]})
    for kind in TARGET_KINDS:
        warm = [r for r in _ok(payload["first_step"]) if r["trainer"] == kind
                and "warm_over_cold_first_step" in r]
        if warm:
            worst = max(warm, key=lambda r: r["warm_over_cold_first_step"])
            ratio = worst["warm_over_cold_first_step"]
            checks.append({"target": f"{KINDS[kind]} first step, warm cache <= "
                                     f"{LIMITS['warm']}x cold, every depth",
                           "value": f"{ratio:.2f}x (worst: depth {worst['depth']})",
                           "met": ratio <= LIMITS["warm"]})
    for r in _ok(payload["scan"]):
        checks.append({"target": f"Trainer step time, scan_layers=True within "
                                 f"{LIMITS['scan']:.0%} of False, depth {r['depth']}",
                       "value": f"{r['ratio']:.3f}x (CPU time {r['cpu_ratio']:.3f}x)",
                       "met": abs(r["ratio"] - 1) <= LIMITS["scan"]})
    serial = sorted(_ok(payload["deep_serial"]), key=lambda r: r["depth"])
    if len(serial) > 1:
        lo, hi = serial[0], serial[-1]
        checks.append({"target": f"Trainer on Serial of {hi['depth']} Dense(2): compile "
                                 f"seconds per layer <= {LIMITS['serial']}x those of "
                                 f"{lo['depth']} layers",
                       "value": f"{hi['per_layer_ratio']:.2f}x",
                       "met": hi["per_layer_ratio"] <= LIMITS["serial"]})
    return checks


# ------------------------------------------------------------------------------------------
# Tables and plot.

def settings_line(config: dict[str, Any]) -> str:
    """The model, batch and method in one line."""
    return (f"ReversibleTransformerLM d_model {config['d_model']}, d_ff {config['d_ff']}, "
            f"{config['n_heads']} heads, seq {config['seq_len']}, batch "
            f"{config['batch_size']}, vocab {config['vocab_size']}, dropout "
            f"{config['dropout']}, Adam, one device, a fresh process per configuration"
            + (" (--quick: sizes for a check that the script runs, not for reading)"
               if config.get("quick") else ""))


def settings(payload: dict[str, Any]) -> str:
    """`settings_line`, with the scan part's steps where it ran (render_tables' source
    line)."""
    c = payload["config"]
    scan = (f"; scan part: {c['rounds']} rounds of {c['steps']} steps per trainer after "
            f"{c['warmup']}" if payload["scan"] else "")
    return settings_line(c) + scan


def _load(r: dict[str, Any]) -> str:
    return f"{r['loadavg_before'][0]:.1f} / {r['loadavg_after'][0]:.1f}"


def _s(value: float | None, pattern: str = "{:.1f}") -> str:
    return "—" if value is None else pattern.format(value)


def tables(payload: dict[str, Any]) -> str:
    """Every part's table and the targets, as Markdown."""
    out = []
    rows = sorted(_ok(payload["first_step"]), key=lambda r: (
        list(KINDS).index(r["trainer"]), r["depth"], r["cache"]))
    if rows:
        out.append(report.markdown_table(
            ["trainer", "depth", "cache", "model (s)", "init (s)", "trainer (s)",
             "first step (s)", "total (s)", "compiling, all threads (s)",
             "block trainer trace + compile (s)", "compiles (hits/misses)",
             "warm / cold first step", "load avg before / after"],
            [[KINDS[r["trainer"]], r["depth"], r["cache"], _s(r["model_s"], "{:.2f}"),
              _s(r["init_s"]), _s(r["trainer_s"]), _s(r["first_step_s"]), _s(r["total_s"]),
              _s(r["compile_total_s"]),
              _s(None if r["compile_times"] is None else
                 r["compile_times"]["trace_s"] + r["compile_times"]["compile_s"]),
              f"{sum(r['n_compiles'].values())} ({r['cache_hits']}/{r['cache_misses']})",
              _s(r.get("warm_over_cold_first_step"), "{:.2f}x"), _load(r)] for r in rows]))
    if payload.get("depth_ratios"):
        out.append(report.markdown_table(
            ["trainer", "cache", "depths", "total", "first step", "compiling"],
            [[KINDS[d["trainer"]], d["cache"], f"{d['to_depth']} / {d['from_depth']}",
              f"{d['total']:.2f}x", f"{d['first_step']:.2f}x", f"{d['compile']:.2f}x"]
             for d in payload["depth_ratios"]]))
    scan = _ok(payload["scan"])
    if scan:
        out.append(report.markdown_table(
            ["depth", "scan_layers=True (s/step)", "False (s/step)", "True / False",
             "CPU time True / False", "quiet steps", "load avg before / after"],
            [[r["depth"], f"{r['kinds']['trainer'][r['ratio_from']]:.4f}",
              f"{r['kinds']['trainer_unrolled'][r['ratio_from']]:.4f}",
              f"{r['ratio']:.3f}x", f"{r['cpu_ratio']:.3f}x",
              " / ".join(f"{r['kinds'][k]['n_quiet_steps']}/{r['kinds'][k]['n_steps']}"
                         for k in ("trainer", "trainer_unrolled")), _load(r)]
             for r in sorted(scan, key=lambda r: r["depth"])]))
    serial = sorted(_ok(payload["deep_serial"]), key=lambda r: r["depth"])
    if serial:
        out.append(report.markdown_table(
            ["Serial of Dense(2)", "init (s)", "trainer (s)", "first step (s)",
             "compiling, all phases (s)", "per layer (ms)", "per layer vs "
             f"{serial[0]['depth']} layers", "load avg before / after"],
            [[f"{r['depth']} layers", _s(r["init_s"]), _s(r["trainer_s"]),
              _s(r["first_step_s"]), _s(r["compile_total_s"]),
              f"{1e3 * r['compile_per_layer_s']:.2f}", f"{r['per_layer_ratio']:.2f}x", _load(r)]
             for r in serial]))
    errors = [f"- {_label(r)}{', ' + r['cache'] if 'cache' in r else ''}: {r['error']}"
              for part in PARTS for r in payload[part] if "error" in r]
    out += ["\n".join(errors)] if errors else []
    if payload["targets"]:
        out.append(report.targets_table(payload["targets"]))
    return "\n\n".join(out) + "\n"


def markdown(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    return (f"Time to first step; {settings(payload)}; {m['processor']}, {m['cpu_count']} "
            f"cores, {m['date'][:10]}.\n\n" + tables(payload))


def plot(path: Path, payload: dict[str, Any]) -> bool:
    """Total time to first step against depth per trainer, cold and warm side by side."""
    plt = report.pyplot(path)
    if plt is None:
        return False
    rows = _ok(payload["first_step"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), squeeze=False)
    for ax, mode in zip(axes[0], ("cold", "warm"), strict=True):
        for kind, label in KINDS.items():
            points = sorted((r["depth"], r["total_s"]) for r in rows
                            if (r["trainer"], r["cache"]) == (kind, mode))
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=label)
        ax.set_xlabel("depth (n_layers)")
        ax.set_ylabel("build + init + first step (s)")
        ax.set_title(f"{mode} compilation cache")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Time to first step ({settings_line(payload['config'])})", fontsize=9)
    report.save_figure(plt, fig, path)
    return True


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the parts asked for (or reads the JSON with ``--render_only``); writes JSON,
    Markdown and PNG to ``--out_dir`` and returns the payload."""
    args = parse(argv)
    out = Path(args.out_dir)
    payload = report.read_json(out / f"{NAME}.json") if args.render_only else run(args)
    derive(payload)
    report.write_json(out / f"{NAME}.json", payload)
    (out / f"{NAME}.md").write_text(markdown(payload))
    plot(out / f"{NAME}.png", payload)
    print(markdown(payload))
    print(f"wrote {out / NAME}.json, .md, .png")
    return payload


if __name__ == "__main__":
    harness.script_main(main, measure)
