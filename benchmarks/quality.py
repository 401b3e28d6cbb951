"""Held-out bits per byte after a fixed step budget: does reversal, LSH or a tokenizer cost
quality? Beside the plain Transformer and Trax 1.4.1's ReformerLM, on identical batches.

Usage (from the repository root, after ``pip install -e '.[bench]'``)::

    python benchmarks/quality.py                     # the full run (about an hour, 2 cores)
    python benchmarks/quality.py --steps=150 --seeds=2   # a reduced run, labelled as such
    python benchmarks/quality.py --trax_python=/tmp/traxenv/bin/python   # + Trax
    python benchmarks/quality.py --quick             # tiny sizes, seconds (tests)

Data: `revtrain.data.TextFiles` on the embedded corpus (Python's documentation topics, 466
KB), the last 5% held out. Every configuration of a seed sees the same train batches (batch
``k`` depends only on ``(seed, k)``) and starts from the seed's initialisation key; the
held-out figure is one exact pass over the eval part (`Inputs.eval_pass`), in bits per
byte of its UTF-8 text (`revtrain.training.Evaluator` with the tokenizer's byte counts), so
byte and SentencePiece models compare. Each (configuration, seed) runs in a fresh process.

Configurations (``--configurations``), all 2 layers, ReLU feed-forward, dropout 0, Adam
(optax's defaults) at a constant ``--learning_rate``:

* ``plain`` -- `TransformerLM` with `Trainer` (the baseline);
* ``rev_trainer``, ``rev_reversible``, ``rev_memory_efficient`` -- `ReversibleTransformerLM`
  (exact attention) with `Trainer`, `ReversibleSerialTrainer`, `MemoryEfficientTrainer`;
* ``lsh1``, ``lsh2``, ``lsh4``, ``lsh8`` -- `LSHCausalAttention` with that many hashes,
  ``--lsh_chunk_len`` below the length (chunks do not cover the sequence), with
  `ReversibleSerialTrainer`;
* ``sentencepiece`` -- ``rev_reversible`` on a SentencePiece model trained on the train
  text (``--sp_vocab_size``), compared with bytes at equal training wall time;
* with ``--trax_python``: ``trax_full``, ``trax_lsh2``, ``trax_lsh4`` -- Trax's
  ``ReformerLM`` with its ``ReversibleSerialTrainer`` (`benchmarks/trax_quality_worker.py`)
  on the same batches, with the same sizes (per-head width ``d_model // n_heads``).

Reported per configuration: mean ± standard deviation over the seeds of the final
held-out bits per byte, the eval curve (every ``--eval_every`` steps; a plot), training
wall time (eval excluded), peak device memory (`revtrain.memory`) and peak RSS, and the
parameter count. Writes ``quality.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import functools
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):  # Run as a script: make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import flags  # noqa: E402

# sequence_length defines --trax_python, which this script shares.
from benchmarks import harness, report, sequence_length  # noqa: E402, F401

NAME = "quality"
VARIANTS = {
    "plain": "TransformerLM + Trainer",
    "rev_trainer": "Reversible + Trainer",
    "rev_reversible": "Reversible + ReversibleSerialTrainer",
    "rev_memory_efficient": "Reversible + MemoryEfficientTrainer",
    "lsh1": "LSH-1", "lsh2": "LSH-2", "lsh4": "LSH-4", "lsh8": "LSH-8",
    "sentencepiece": "SentencePiece + ReversibleSerialTrainer",
}
TRAX_VARIANTS = {"trax_full": "Trax ReformerLM full", "trax_lsh2": "Trax ReformerLM LSH-2",
                 "trax_lsh4": "Trax ReformerLM LSH-4"}
# Which revtrain configuration each Trax one is matched with.
TRAX_MATCH = {"trax_full": "rev_reversible", "trax_lsh2": "lsh2", "trax_lsh4": "lsh4"}
DEFAULTS = {"steps": 400, "seeds": 3, "eval_every": 50, "d_model": 64, "d_ff": 256,
            "n_heads": 4, "n_layers": 2, "seq_len": 128, "batch_size": 16,
            "chunk_len": 32, "sp_vocab_size": 1024, "learning_rate": 2e-3}
QUICK = {"steps": 4, "seeds": 2, "eval_every": 2, "d_model": 16, "d_ff": 32, "n_heads": 2,
         "seq_len": 32, "batch_size": 4, "chunk_len": 8, "sp_vocab_size": 400}
FLAGS = flags.FLAGS

flags.DEFINE_integer("seeds", None, f"seeds per configuration (default {DEFAULTS['seeds']})",
                     lower_bound=1)
flags.DEFINE_integer("eval_every", None, "steps between held-out evaluations (default "
                     f"{DEFAULTS['eval_every']})", lower_bound=1)
flags.DEFINE_integer("lsh_chunk_len", None, "LSH chunk (default "
                     f"{DEFAULTS['chunk_len']})", lower_bound=1)
flags.DEFINE_integer("sp_vocab_size", None, "pieces of the SentencePiece model (default "
                     f"{DEFAULTS['sp_vocab_size']})", lower_bound=259)
flags.DEFINE_float("learning_rate", None, "Adam's constant rate (default "
                   f"{DEFAULTS['learning_rate']})", lower_bound=0.0)
flags.DEFINE_list("configurations", list(VARIANTS), f"subset of {','.join(VARIANTS)}; "
                  "with --trax_python (a Python with Trax 1.4.1) Trax's ReformerLM (full, "
                  "LSH-2, LSH-4) also trains on the same batches")
flags.DEFINE_string("label", None, "a note stored with the results (e.g. 'reduced run')")
flags.register_validator("configurations", lambda v: bool(v) and set(v) <= set(VARIANTS),
                         f"--configurations must be a subset of {','.join(VARIANTS)}")

TRAX_WORKER = Path(__file__).resolve().parent / "trax_quality_worker.py"


def parse_flags(argv: Sequence[str] | None) -> SimpleNamespace:
    """The run's settings: the shared harness flags plus this script's."""
    args = harness.parse_flags(argv, steps=DEFAULTS["steps"], warmup=1)
    defaults = {**DEFAULTS, **(QUICK if args.quick else {})}
    for name in ("steps", "seeds", "eval_every", "d_model", "d_ff", "n_heads", "seq_len",
                 "batch_size", "sp_vocab_size", "learning_rate"):
        value = getattr(FLAGS, name)
        setattr(args, name, value if FLAGS[name].present else defaults[name])
    args.chunk_len = (FLAGS.lsh_chunk_len if FLAGS["lsh_chunk_len"].present
                      else defaults["chunk_len"])
    args.n_layers = defaults["n_layers"]
    return args


def configurations(args: SimpleNamespace) -> list[dict[str, Any]]:
    """One config per (seed, variant), seed-major so that a partial run has whole seeds."""
    base = {name: getattr(args, name) for name in (
        "steps", "eval_every", "d_model", "d_ff", "n_heads", "n_layers", "seq_len",
        "batch_size", "chunk_len", "sp_vocab_size", "learning_rate")}
    base |= {"vocab_size": 256, "dropout": 0.0,
             "n_buckets": 2 * args.seq_len // args.chunk_len}
    trax = list(TRAX_VARIANTS) if args.trax_python else []
    return [base | {"variant": v, "seed": args.seed + s}
            for s in range(args.seeds) for v in [*args.configurations, *trax]]


# ------------------------------------------------------------------------------------------
# Worker side (revtrain).

def _model_fn(config: dict[str, Any], vocab_size: int) -> Any:
    from revtrain import layers as tl
    from revtrain.models import ReversibleTransformerLM, TransformerLM

    variant = config["variant"]
    cls = TransformerLM if variant == "plain" else ReversibleTransformerLM
    attention = tl.CausalAttention
    if variant.startswith("lsh"):
        attention = functools.partial(tl.LSHCausalAttention, chunk_len=config["chunk_len"],
                                      n_hashes=int(variant[3:]),
                                      n_buckets=config["n_buckets"])
    return functools.partial(
        cls, vocab_size=vocab_size, d_model=config["d_model"], d_ff=config["d_ff"],
        n_layers=config["n_layers"], n_heads=config["n_heads"], max_len=config["seq_len"],
        dropout=0.0, attention_type=attention, ff_activation=tl.Relu)


def _inputs(config: dict[str, Any], sentencepiece: bool) -> Any:
    from revtrain.data import TextFiles, trained_sentencepiece

    tokenizer = None
    if sentencepiece:  # Trained on the train text only: the eval part stays unseen.
        with tempfile.TemporaryDirectory() as tmp:
            train_text = Path(tmp) / "train.txt"
            data = TextFiles(sequence_length=config["seq_len"], batch_size=1,
                             process_index=0, process_count=1)
            train_text.write_bytes(data.train_bytes.tobytes())
            tokenizer = trained_sentencepiece(config["sp_vocab_size"], paths=[train_text])
    return TextFiles(sequence_length=config["seq_len"], batch_size=config["batch_size"],
                     seed=config["seed"], tokenizer=tokenizer, process_index=0,
                     process_count=1)


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """Trains one configuration for ``steps`` steps; the eval curve, times and memory."""
    import jax
    import numpy as np
    import optax

    from revtrain import layers as tl
    from revtrain import memory
    from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
    from revtrain.training import RunConfig
    from revtrain.training.builder import build_evaluator, build_model, build_trainer

    variant = config["variant"]
    inputs = _inputs(config, variant == "sentencepiece")
    trainer_class = {"rev_reversible": ReversibleSerialTrainer,
                     "rev_memory_efficient": MemoryEfficientTrainer}.get(
        variant, Trainer if variant in ("plain", "rev_trainer") else ReversibleSerialTrainer)
    rate = config["learning_rate"]
    run = RunConfig(model=_model_fn(config, inputs.vocab_size), inputs=inputs,
                    trainer_class=trainer_class, loss=tl.CrossEntropyLoss,
                    optimizer=lambda: optax.inject_hyperparams(optax.adam)(learning_rate=rate),
                    schedule=rate, seed=config["seed"], n_devices=1)
    built = build_model(run, inputs)
    trainer = build_trainer(trainer_class, built.model, built.loss, run.optimizer, 1)
    evaluator = build_evaluator(run, built, inputs)
    n_params = sum(int(np.size(w)) for w in jax.tree.leaves(built.initial_values()["weights"]))
    rng, stream = jax.random.key(config["seed"]), inputs.train_stream(0)
    curve, losses, train_s = [], [], 0.0
    with memory.track_peak(trainer) as peak:
        for step in range(config["steps"]):
            start = time.perf_counter()
            loss, _ = trainer.one_step(next(stream), jax.random.fold_in(rng, step),
                                       step=step, learning_rate=rate)
            losses.append(float(loss))  # Waits for the step.
            train_s += time.perf_counter() - start
            if (step + 1) % config["eval_every"] == 0 or step + 1 == config["steps"]:
                values = (built.nest(trainer.host_values("weights")),
                          built.nest(trainer.host_values("state")))
                metrics = evaluator.evaluate(*values, inputs.eval_pass())
                curve.append({"step": step + 1, "loss": metrics["loss"],
                              "bits_per_byte": metrics["bits_per_byte"], "train_s": train_s})
    return {"curve": curve, "train_losses": losses, "train_s": train_s,
            "bits_per_byte": curve[-1]["bits_per_byte"], "n_params": n_params,
            "vocab_size": inputs.vocab_size, "method": peak.method,
            "peak_bytes": peak.peak_bytes, "peak_rss_bytes": peak.peak_rss_bytes,
            "bytes_per_token": len(inputs.eval_bytes) / len(inputs.eval_tokens)}


# ------------------------------------------------------------------------------------------
# Trax's side: the parent writes the seed's batches, Trax's worker trains on them.

def write_batches(config: dict[str, Any], path: Path) -> None:
    """The train batches of steps ``0 .. steps - 1`` and the eval pass, as ``.npz``."""
    import numpy as np

    inputs = _inputs(config, sentencepiece=False)
    train = list(itertools.islice(inputs.train_stream(0), config["steps"]))
    evals = list(inputs.eval_pass())
    np.savez(path, train_inputs=np.stack([b[0] for b in train]),
             train_targets=np.stack([b[1] for b in train]),
             eval_inputs=np.stack([b[0] for b in evals]),
             eval_targets=np.stack([b[1] for b in evals]),
             eval_weights=np.stack([b[2] for b in evals]))


def run_trax(args: SimpleNamespace, config: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Trax's configuration in a fresh process (its Python), on the seed's batches."""
    path = tmp / f"batches_{config['seed']}.npz"
    if not path.exists():
        write_batches(config, path)
    command = [args.trax_python, str(TRAX_WORKER), json.dumps(config), str(path)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                              env=harness.worker_env(1) | {"XLA_FLAGS": ""})
    except subprocess.TimeoutExpired:
        return config | {"error": f"timed out after {args.timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return config | json.loads(line) | {"worker_wall_s": time.perf_counter() - start}
    tail = "\n".join(done.stderr.strip().splitlines()[-8:])
    return config | {"error": f"trax exited with code {done.returncode}: {tail}"}


# ------------------------------------------------------------------------------------------
# Summaries and targets.

def label(variant: str) -> str:
    return {**VARIANTS, **TRAX_VARIANTS}[variant]


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant: mean and standard deviation (over seeds) of the final bits per byte,
    of the training seconds, the peaks and the parameter count; seeds that failed are
    left out (and counted)."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in results):
        rows = [r for r in results if r["variant"] == variant and "error" not in r]
        failed = sum(1 for r in results if r["variant"] == variant and "error" in r)
        if not rows:
            out[variant] = {"n": 0, "failed": failed}
            continue
        bpb = [r["bits_per_byte"] for r in rows]
        out[variant] = {
            "n": len(rows), "failed": failed, "mean": statistics.fmean(bpb),
            "std": statistics.stdev(bpb) if len(bpb) > 1 else 0.0,
            "train_s": statistics.fmean(r["train_s"] for r in rows),
            "peak_bytes": max((r.get("peak_bytes") or 0) for r in rows) or None,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rows),
            "n_params": rows[0]["n_params"]}
    return out


def at_wall_time(curve: Sequence[dict[str, Any]], seconds: float) -> float:
    """Bits per byte of an eval curve at ``seconds`` of training (linear between points;
    the last point when the curve ends earlier, the first when it starts later)."""
    points = [(p["train_s"], p["bits_per_byte"]) for p in curve]
    if seconds <= points[0][0]:
        return points[0][1]
    for (t0, b0), (t1, b1) in itertools.pairwise(points):
        if t0 <= seconds <= t1:
            return b0 + (b1 - b0) * (seconds - t0) / max(t1 - t0, 1e-12)
    return points[-1][1]


def equal_wall_time(results: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """SentencePiece against bytes (``rev_reversible``) at the byte runs' training time,
    per seed, then averaged: ``{'seconds', 'bytes', 'sentencepiece', 'difference'}``."""
    pairs = []
    for seed in sorted({r["seed"] for r in results}):
        found = {r["variant"]: r for r in results if r["seed"] == seed and "error" not in r}
        if "rev_reversible" in found and "sentencepiece" in found:
            byte_run, sp = found["rev_reversible"], found["sentencepiece"]
            pairs.append((byte_run["train_s"], byte_run["bits_per_byte"],
                          at_wall_time(sp["curve"], byte_run["train_s"])))
    if not pairs:
        return None
    seconds, byte_bpb, sp_bpb = (statistics.fmean(p[i] for p in pairs) for i in range(3))
    return {"seconds": seconds, "bytes": byte_bpb, "sentencepiece": sp_bpb,
            "difference": sp_bpb - byte_bpb,
            "spread": statistics.stdev([p[2] - p[1] for p in pairs]) if len(pairs) > 1
            else 0.0}


def targets(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's quality targets, for the configurations the run has."""
    s, checks = summarize(results), []

    def gap(a: str, b: str) -> tuple[float, str] | None:
        if s.get(a, {}).get("n") and s.get(b, {}).get("n"):
            value = s[a]["mean"] - s[b]["mean"]
            return value, (f"{value:+.4f} ({s[a]['mean']:.4f} ± {s[a]['std']:.4f} vs "
                           f"{s[b]['mean']:.4f} ± {s[b]['std']:.4f})")
        return None

    def check(target: str, a: str, b: str, limit: float | None, absolute: bool = True):
        found = gap(a, b)
        if found:
            value, text = found
            met = True if limit is None else (abs(value) if absolute else value) <= limit
            checks.append({"target": target, "value": text, "met": met})

    for trainer in ("rev_trainer", "rev_reversible", "rev_memory_efficient"):
        check(f"{label(trainer)} within 0.01 bpb of the plain Transformer", trainer,
              "plain", 0.01)
    check("LSH-8 within 0.02 bpb of exact attention", "lsh8", "rev_reversible", 0.02, False)
    check("LSH-2 within 0.05 bpb of exact attention", "lsh2", "rev_reversible", 0.05, False)
    for n in (1, 4):
        check(f"LSH-{n} gap to exact attention (reported)", f"lsh{n}", "rev_reversible", None)
    for trax, ours in TRAX_MATCH.items():
        check(f"{label(ours)} within 0.02 bpb of {label(trax)}", ours, trax, 0.02)
    wall = equal_wall_time(results)
    if wall:
        winner = "SentencePiece" if wall["difference"] < 0 else "bytes"
        checks.append({"target": "SentencePiece vs bytes at equal wall time (reported)",
                       "value": f"{winner} by {abs(wall['difference']):.4f} bpb at "
                                f"{wall['seconds']:.0f} s ({wall['sentencepiece']:.4f} vs "
                                f"{wall['bytes']:.4f}; seed spread {wall['spread']:.4f})",
                       "met": True})
    return checks


# ------------------------------------------------------------------------------------------
# Outputs.

def readme_table(payload: dict[str, Any]) -> str:
    """The documents' table (`benchmarks.render_tables`): one row per configuration."""
    rows = []
    for variant, v in summarize(payload["results"]).items():
        if not v["n"]:
            rows.append([label(variant), "failed", "", "", "", ""])
            continue
        peak = report.mib(v["peak_bytes"]) if v["peak_bytes"] else "—"
        rows.append([label(variant), f"{v['mean']:.4f} ± {v['std']:.4f}", f"{v['n']}",
                     f"{v['n_params']:,}", f"{v['train_s']:.0f}",
                     f"{peak} / {report.mib(v['peak_rss_bytes'])}"])
    return report.markdown_table(
        ["configuration", "held-out bits/byte (mean ± std)", "seeds", "parameters",
         "train s", "peak device / RSS MiB"], rows)


def settings(payload: dict[str, Any]) -> str:
    c = payload["config"]
    note = f" ({payload['label']})" if payload.get("label") else ""
    return (f"{c['steps']} steps{note}, d_model {c['d_model']}, d_ff {c['d_ff']}, "
            f"{c['n_layers']} layers, {c['n_heads']} heads, seq {c['seq_len']}, batch "
            f"{c['batch_size']}, Adam {c['learning_rate']:g} constant, dropout 0, LSH "
            f"chunk_len {c['chunk_len']} ({c['n_buckets']} buckets), SentencePiece "
            f"{c['sp_vocab_size']} pieces")


def markdown(payload: dict[str, Any]) -> str:
    info = payload["machine"]
    lines = [f"Quality: {settings(payload)}.",
             f"Measured {info['date']} on {info['processor']} ({info['cpu_count']} CPUs), "
             f"jax {info['jax']}; each (configuration, seed) a fresh process; same batches "
             f"and initialisation key per seed for every configuration.", "",
             readme_table(payload)]
    checks = targets(payload["results"])
    if checks:
        lines += ["", report.targets_table(checks)]
    return "\n".join(lines) + "\n"


def plot(path: Path, results: Sequence[dict[str, Any]]) -> bool:
    """Held-out bits per byte against step (mean over seeds) and against training time."""
    plt = report.pyplot(path)
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for variant in dict.fromkeys(r["variant"] for r in results):
        rows = [r for r in results if r["variant"] == variant and "error" not in r]
        if not rows:
            continue
        steps = [p["step"] for p in rows[0]["curve"]]
        mean = [statistics.fmean(r["curve"][i]["bits_per_byte"] for r in rows)
                for i in range(len(steps))]
        seconds = [statistics.fmean(r["curve"][i]["train_s"] for r in rows)
                   for i in range(len(steps))]
        style = "--" if variant in TRAX_VARIANTS else "-"
        axes[0].plot(steps, mean, style, marker=".", label=label(variant))
        axes[1].plot(seconds, mean, style, marker=".", label=label(variant))
    for ax, xlabel in zip(axes, ("step", "training wall time (s, eval excluded)"),
                          strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out bits per byte (mean over seeds)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    report.save_figure(plt, fig, path)
    return True


def write(out_dir: Path, payload: dict[str, Any]) -> None:
    report.write_json(out_dir / f"{NAME}.json", payload)
    (out_dir / f"{NAME}.md").write_text(markdown(payload))
    plot(out_dir / f"{NAME}.png", payload["results"])


def _describe(r: dict[str, Any]) -> str:
    return (f"bits/byte {r['bits_per_byte']:.4f}, train {r['train_s']:.1f} s, "
            f"{r['n_params']:,} parameters")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs (or, with ``--render_only``, re-renders) the benchmark; returns the payload."""
    args = parse_flags(argv)
    if args.render_only:
        payload = report.read_json(args.out_dir / f"{NAME}.json")
        write(args.out_dir, payload)
        return payload
    configs, results = configurations(args), []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for k, config in enumerate(configs, 1):
            if config["variant"] in TRAX_VARIANTS:
                result = run_trax(args, config, Path(tmp))
            else:
                result = harness.run_worker(__file__, config, args.timeout)
            outcome = f"ERROR {result['error']}" if "error" in result else _describe(result)
            print(f"[{k}/{len(configs)}] seed {config['seed']}, {label(config['variant'])}: "
                  f"{outcome}", flush=True)
            results.append(result)
    payload = {"benchmark": NAME, "machine": harness.machine_info(args.command),
               "label": args.label, "wall_s": time.perf_counter() - start,
               "config": {k: v for k, v in configs[0].items()
                          if k not in ("variant", "seed")}, "results": results}
    write(args.out_dir, payload)
    print(markdown(payload))
    return payload


if __name__ == "__main__":
    harness.script_main(main, measure)
