"""How good `revtrain.planning` is: predicted against measured peak memory, the planner's
pick against the measured best under memory caps, and deep long-context runs.

Usage (from the repository root, after ``pip install -e '.[bench]'``)::

    python benchmarks/memory_budget.py --part=accuracy   # predicted vs measured peak
    python benchmarks/memory_budget.py --part=caps       # tokens/s at 4 memory caps
    python benchmarks/memory_budget.py --part=deep       # B/tok/dim at 16K and 64K tokens
    python benchmarks/memory_budget.py --part=accuracy --quick   # tiny, a few minutes

The parts (``--part``):

* ``accuracy`` (``memory_budget.json``): the configurations of `ACCURACY` -- every trainer
  (``trainer_remat`` is ``Trainer(remat='layer')``; it is recorded as skipped where
  `Trainer` has no such option), the FSDP forms on 4 forced devices, depths 2 to 32,
  lengths 512 to 65,536 (blockwise or LSH attention with feed-forward and loss chunks at
  long lengths, as ``sequence_length.py`` builds them), d_model 64. Each in a fresh process:
  `revtrain.planning.estimate` on the abstractly initialised model (predicted peak, its
  split, the program that holds it, the seconds it took, the process's RSS after it), then
  the real trainer built the same way (``from_model`` with the same options), one warm-up
  step and one step under `revtrain.memory.track_peak` (the ledger on CPU, the allocator's
  peak on GPU/TPU). ``ratio`` is predicted / measured; the target is every ratio within
  ``1 +- TOLERANCE``; the worst configuration is named. ``--accuracy_configs`` runs some of
  them (their ids, e.g. ``reversible-d2-L512-b8-default``).
* ``caps`` (``memory_budget_caps.json``, ``.png``): `benchmarks.memory_budget_caps`.
* ``deep`` (``memory_budget_deep.json``): bytes of the peak per token per model dimension
  (B/tok/dim) of ``ReversibleSerialTrainer`` and ``Trainer(remat='layer')`` at depths 12
  and 32 and 16K and 64K tokens (d_model 128, LSH attention, batch 1), predicted and
  measured; the (length, depth) pairs of ``--deep_predict_only`` (e.g. ``65536x32``, about
  3 minutes a step on 2 cores) are predicted only, and labelled so.

Every worker records the machine's load average before and after it (``os.getloadavg``):
the machine may be shared, which distorts times (the caps part), not bytes. On an idle
2-core CPU: accuracy about 25 minutes, caps about 45, deep about 30; ``--quick`` a few
minutes each (``docs/benchmarks.md``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):  # Run as a script: make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import flags  # noqa: E402

from benchmarks import harness, memory_budget_caps, report  # noqa: E402
from benchmarks.budget_worker import base_config, measure, run_configs, spec_config  # noqa: E402

NAME = "memory_budget"
DEEP_NAME = "memory_budget_deep"
PARTS = ("accuracy", "caps", "deep")
TOLERANCE = 0.10

# (trainer kind, depth, length, batch, attention): 'default' is the model's own attention;
# 'blockwise' and 'lsh' come with feed-forward and loss chunks (`model_and_loss`).
ACCURACY = (
    ("trainer", 2, 512, 8, "default"), ("trainer", 8, 512, 8, "default"),
    ("trainer", 32, 512, 4, "default"), ("trainer", 16, 2048, 2, "blockwise"),
    ("trainer", 4, 16384, 1, "blockwise"), ("trainer", 2, 65536, 1, "lsh"),
    ("trainer_remat", 8, 512, 8, "default"), ("trainer_remat", 32, 2048, 2, "blockwise"),
    ("trainer_remat", 12, 16384, 1, "lsh"),
    ("reversible", 2, 512, 8, "default"), ("reversible", 32, 512, 8, "default"),
    ("reversible", 8, 4096, 2, "blockwise"), ("reversible", 12, 16384, 1, "lsh"),
    ("reversible", 2, 65536, 1, "lsh"),
    ("memory_efficient", 4, 512, 8, "default"), ("memory_efficient", 32, 1024, 4, "default"),
    ("memory_efficient", 8, 16384, 1, "lsh"), ("memory_efficient", 2, 65536, 1, "lsh"),
    ("trainer_fsdp", 8, 512, 8, "default"), ("reversible_fsdp", 16, 1024, 4, "default"),
    ("memory_efficient_fsdp", 8, 512, 8, "default"),
)
QUICK_ACCURACY = (
    ("trainer", 2, 32, 2, "default"), ("reversible", 2, 32, 2, "default"),
    ("memory_efficient", 2, 32, 2, "default"), ("trainer_remat", 2, 32, 2, "default"),
    ("trainer_fsdp", 2, 32, 4, "default"), ("reversible", 2, 64, 1, "lsh"),
    ("trainer", 2, 64, 1, "blockwise"),
)
ACCURACY_MODEL = {"d_model": 64, "d_ff": 256, "n_heads": 2, "vocab_size": 256,
                  "block_size": 512, "chunk_len": 128, "n_hashes": 2, "ff_chunk_size": 4096,
                  "loss_chunk": 4096}
QUICK_MODEL = {"d_model": 32, "d_ff": 64, "n_heads": 2, "vocab_size": 64, "block_size": 16,
               "chunk_len": 16, "n_hashes": 2, "ff_chunk_size": 32, "loss_chunk": 32}
DEEP_MODEL = ACCURACY_MODEL | {"d_model": 128, "d_ff": 512, "n_heads": 4}
DEEP = {"trainers": ("reversible", "trainer_remat"), "depths": (12, 32),
        "lengths": (16384, 65536), "predict_only": []}
QUICK_DEEP = DEEP | {"depths": (2, 4), "lengths": (64, 256), "predict_only": ["256x4"]}
FLAGS = flags.FLAGS

flags.adopt_module_key_flags(harness)
flags.DEFINE_enum("part", "accuracy", PARTS, "which part runs (module docstring)")
flags.DEFINE_list("accuracy_configs", None, "the accuracy part runs only these ids (e.g. "
                  "trainer-d2-L512-b8-default); default all")
flags.DEFINE_list("deep_predict_only", None, "LENGTHxDEPTH pairs the deep part predicts "
                  "but does not measure, e.g. 65536x32 (default none; 256x4 with --quick)")


# ------------------------------------------------------------------------------------------
# Configurations.

def model_overrides(args: SimpleNamespace) -> dict[str, Any]:
    """The model sizes given explicitly on the command line (they override every part's)."""
    names = ("d_model", "d_ff", "n_heads", "vocab_size", "dropout")
    return {n: getattr(args, n) for n in names if FLAGS[n].present}


def accuracy_configs(args: SimpleNamespace) -> list[dict[str, Any]]:
    """The accuracy part's configurations, filtered by ``--accuracy_configs`` and an
    explicit ``--trainers``.

    Raises:
      SystemExit: for an id that is not one of them (listing them).
    """
    model = (QUICK_MODEL if args.quick else ACCURACY_MODEL) | args.model_overrides
    base = base_config(model, args.seed, args.compilation_cache_dir) | {"part": "accuracy"}
    configs = [spec_config(base, *spec) for spec in (QUICK_ACCURACY if args.quick
                                                     else ACCURACY)]
    if args.accuracy_configs:
        ids = [c["id"] for c in configs]
        unknown = [i for i in args.accuracy_configs if i not in ids]
        if unknown:
            raise SystemExit(f"--accuracy_configs: {unknown[0]!r} is not one of {', '.join(ids)}")
        configs = [c for c in configs if c["id"] in args.accuracy_configs]
    if FLAGS["trainers"].present:
        configs = [c for c in configs if c["trainer"] in args.trainers]
    return configs


def deep_configs(args: SimpleNamespace) -> list[dict[str, Any]]:
    """The deep part's configurations: trainer x depth x length at batch 1, LSH."""
    spec = QUICK_DEEP if args.quick else DEEP
    model = (QUICK_MODEL | {"d_model": 64, "d_ff": 128, "n_heads": 4} if args.quick
             else DEEP_MODEL) | args.model_overrides
    base = base_config(model, args.seed, args.compilation_cache_dir) | {"part": "deep"}
    predict_only = set(args.deep_predict_only if args.deep_predict_only is not None
                       else spec["predict_only"])
    kinds = [k for k in spec["trainers"] if not FLAGS["trainers"].present or k in args.trainers]
    return [spec_config(base, kind, depth, length, 1, "lsh")
            | {"predict_only": f"{length}x{depth}" in predict_only}
            for length in spec["lengths"] for depth in spec["depths"] for kind in kinds]


# ------------------------------------------------------------------------------------------
# Parent side: summaries, tables, main.

def _describe(r: dict[str, Any]) -> str:
    measured = (f", measured {report.mib(r['peak_bytes'])} MiB ({r['method']}), ratio "
                f"{r['ratio']:.3f}" if "ratio" in r else " (predicted only)")
    return (f"predicted {report.mib(r['predicted_peak_bytes'])} MiB at "
            f"{r['predicted_peak_program']} in {r['estimate_s']:.1f} s{measured}")


def worst(results: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The measured configuration whose ratio is furthest from 1, or None."""
    measured = [r for r in results if "ratio" in r]
    return max(measured, key=lambda r: abs(r["ratio"] - 1.0)) if measured else None


def targets(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every measured ratio within ``1 +- TOLERANCE``; the worst named."""
    measured = [r for r in results if "ratio" in r]
    w = worst(results)
    if w is None:
        return []
    within = sum(abs(r["ratio"] - 1.0) <= TOLERANCE for r in measured)
    return [{"target": f"predicted peak within ±{TOLERANCE:.0%} of the measured one, every "
                       f"configuration", "value": f"{within}/{len(measured)}; worst "
                       f"{w['ratio']:.3f}x ({w['id']})", "met": within == len(measured)}]


def worst_line(payload: dict[str, Any]) -> str:
    w = worst(payload["results"])
    if w is None:
        return "No configuration was measured."
    return (f"Worst case: {w['id']} ({harness.TRAINERS[w['trainer']]}, {w['n_devices']} "
            f"device{'s' if w['n_devices'] > 1 else ''}): predicted "
            f"{report.mib(w['predicted_peak_bytes'])} MiB, measured "
            f"{report.mib(w['peak_bytes'])} MiB, ratio {w['ratio']:.3f}.")


def _not_run(results: Sequence[dict[str, Any]]) -> list[str]:
    return [f"- {r['id']}: {'skipped: ' + r['skipped'] if 'skipped' in r else r['error']}"
            for r in results if "skipped" in r or "error" in r]


def accuracy_table(payload: dict[str, Any]) -> str:
    """The documents' table: per configuration predicted, measured, ratio; the worst."""
    rows = [[r["id"], report.mib(r["predicted_peak_bytes"]), report.mib(r["peak_bytes"]),
             f"{r['ratio']:.3f}"] for r in payload["results"] if "ratio" in r]
    rows += [[r["id"], "—", "—", "skipped" if "skipped" in r else "failed"]
             for r in payload["results"] if "ratio" not in r]
    return (report.markdown_table(["configuration (trainer-depth-length-batch-attention)",
                                   "predicted MiB", "measured MiB", "predicted / measured"],
                                  rows) + "\n\n" + worst_line(payload) + "\n")


def settings(payload: dict[str, Any]) -> str:
    c = payload["config"]
    methods = sorted({r["method"] for r in payload["results"] if "method" in r}) or ["none"]
    return (f"ReversibleTransformerLM d_model {c['d_model']}, d_ff {c['d_ff']}, "
            f"{c['n_heads']} heads, vocab {c['vocab_size']}, Adam; blockwise block "
            f"{c['block_size']}, LSH chunk {c['chunk_len']} x {c['n_hashes']} hashes, "
            f"feed-forward and loss chunks of {c['ff_chunk_size']} / {c['loss_chunk']} "
            f"positions at long lengths; dropout {_dropouts(payload['results'])}; FSDP on "
            f"{harness.FSDP_DEVICES} devices; measured with {', '.join(methods)}")


def _dropouts(results: Sequence[dict[str, Any]]) -> str:
    """The dropout rate of each attention kind that ran, e.g. ``'0.1 (default), 0.0
    (lsh)'``."""
    pairs = sorted({(r["attention"], r["dropout"]) for r in results})
    return ", ".join(f"{rate} ({attention})" for attention, rate in pairs)


def accuracy_markdown(payload: dict[str, Any]) -> str:
    """The accuracy part's Markdown: every field of the estimate beside the measurement."""
    m = payload["machine"]
    rows = []
    for r in payload["results"]:
        if "predicted_peak_bytes" not in r:
            continue
        resident = r["predicted_weights_bytes"] + r["predicted_slots_bytes"]
        rows.append([r["id"], r["n_devices"], report.mib(r["predicted_peak_bytes"]),
                     report.mib(r.get("peak_bytes")),
                     f"{r['ratio']:.3f}" if "ratio" in r else "—",
                     r["predicted_peak_program"], r.get("peak_label") or "—",
                     report.mib(resident), report.mib(r["predicted_activation_bytes"]),
                     report.mib(r["predicted_temp_bytes"]), f"{r['estimate_s']:.1f}",
                     report.mib(r["rss_after_estimate_bytes"]),
                     f"{r['load_before'][0]:.1f} / {r['load_after'][0]:.1f}"])
    lines = [f"Predicted (`revtrain.planning.estimate`) against measured peak device memory "
             f"of one step, each configuration in a fresh process; {settings(payload)}. "
             f"{m['processor']}, {m['cpu_count']} cores, {m['date']}.", "",
             report.markdown_table(
                 ["configuration", "devices", "predicted MiB", "measured MiB", "ratio",
                  "predicted at", "measured at", "weights + slots MiB", "activations MiB",
                  "temporaries MiB", "estimate s", "RSS after estimate MiB",
                  "load avg before / after"], rows), "", worst_line(payload)]
    lines += [""] + _not_run(payload["results"])
    if payload.get("targets"):
        lines += ["", report.targets_table(payload["targets"])]
    return "\n".join(lines) + "\n"


def per_token_dim(n_bytes: float | None, r: dict[str, Any]) -> str:
    if n_bytes is None:
        return "—"
    return f"{n_bytes / (r['seq_len'] * r['d_model'] * r['batch_size']):.1f}"


def deep_table(payload: dict[str, Any]) -> str:
    """The documents' table of the deep part: B/tok/dim predicted and measured."""
    rows = []
    for r in payload["results"]:
        name = harness.TRAINERS[r["trainer"]]
        if "predicted_peak_bytes" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else "failed"
            rows.append([name, r["depth"], f"{r['seq_len']:,}", "—", "—", "—", "—", why])
            continue
        measured = r.get("peak_bytes")
        note = ("predicted only (--deep_predict_only)" if r.get("predict_only")
                else "failed" if measured is None else f"ratio {r['ratio']:.3f}")
        rows.append([name, r["depth"], f"{r['seq_len']:,}",
                     report.mib(r["predicted_peak_bytes"]),
                     per_token_dim(r["predicted_peak_bytes"], r), report.mib(measured),
                     per_token_dim(measured, r), note])
    return report.markdown_table(["trainer", "depth", "length", "predicted MiB",
                                  "predicted B/tok/dim", "measured MiB", "measured B/tok/dim",
                                  "note"], rows) + "\n"


def deep_settings(payload: dict[str, Any]) -> str:
    c = payload["config"]
    methods = sorted({r["method"] for r in payload["results"] if "method" in r}) or ["none"]
    return (f"ReversibleTransformerLM d_model {c['d_model']}, d_ff {c['d_ff']}, "
            f"{c['n_heads']} heads, vocab {c['vocab_size']}, LSH attention (chunk "
            f"{c['chunk_len']}, {c['n_hashes']} hashes), feed-forward and loss chunks of "
            f"{c['ff_chunk_size']} / {c['loss_chunk']} positions, batch 1, dropout 0, Adam; "
            f"measured with {', '.join(methods)}")


def deep_markdown(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    lines = [f"Deep long context: peak bytes per token per model dimension (B/tok/dim); "
             f"{deep_settings(payload)}. {m['processor']}, {m['cpu_count']} cores, "
             f"{m['date']}.", "", deep_table(payload)]
    lines += _not_run(payload["results"])
    return "\n".join(lines) + "\n"


def _write(out: Path, name: str, payload: dict[str, Any], markdown: str) -> None:
    report.write_json(out / f"{name}.json", payload)
    (out / f"{name}.md").write_text(markdown)
    print(markdown)
    print(f"wrote {out / name}.json, .md")


def _payload(name: str, configs: list[dict[str, Any]], results: list[dict[str, Any]],
             machine: dict[str, Any]) -> dict[str, Any]:
    config = {k: v for k, v in configs[0].items()
              if k not in ("id", "trainer", "depth", "seq_len", "batch_size", "attention",
                           "n_devices", "dropout", "predict_only")}
    return {"benchmark": name, "machine": machine,
            "config": harness.with_workers_host_allocator(config, results), "results": results}


def parse_flags(argv: Sequence[str] | None) -> SimpleNamespace:
    """The run's settings: `harness.parse_flags` (``--steps`` 3, ``--warmup`` 1 by default)
    plus this script's flags and ``model_overrides``."""
    args = harness.parse_flags(argv, steps=3, warmup=1)
    args.part, args.accuracy_configs = FLAGS.part, FLAGS.accuracy_configs
    args.deep_predict_only = FLAGS.deep_predict_only
    args.model_overrides = model_overrides(args)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs ``--part`` (or, with ``--render_only``, rewrites its Markdown and plot from the
    JSON in ``--out_dir``); returns the payload."""
    args = parse_flags(argv)
    out = Path(args.out_dir)
    if args.part == "caps":
        return memory_budget_caps.main(args)
    name, markdown = ((NAME, accuracy_markdown) if args.part == "accuracy"
                      else (DEEP_NAME, deep_markdown))
    if args.render_only:
        payload = report.read_json(out / f"{name}.json")
    else:
        machine = harness.machine_info(args.command)
        configs = accuracy_configs(args) if args.part == "accuracy" else deep_configs(args)
        if not configs:
            raise SystemExit(f"{name}: no configuration is left after --trainers="
                             f"{','.join(args.trainers)}; name trainers the part runs")
        print(f"{name}: {len(configs)} configurations")
        results = run_configs(configs, _describe, args.timeout, args.jobs)
        payload = _payload(name, configs, results, machine)
    if args.part == "accuracy":
        payload["targets"] = targets(payload["results"])
    _write(out, name, payload, markdown(payload))
    return payload


if __name__ == "__main__":
    harness.script_main(main, measure)
