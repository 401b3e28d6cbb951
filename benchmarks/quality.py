"""Held-out bits per byte at a converged budget: does reversal, LSH or a tokenizer cost
quality, and where does the gap to Trax 1.4.1's ReformerLM come from?

Run it on an otherwise idle machine (no other benchmark, no test suite): the load average
is recorded beside every row's wall time. From the repository root, after ``pip install
-e '.[bench]'`` (and ``../shared/peers/trax/install.sh`` for Trax's rows)::

    # 1. The pilot: the plain Transformer alone until its held-out curve has flattened
    #    (the last 20% of the steps improve it by < 0.02 bits/byte); writes
    #    quality_pilot.json, whose step count the runs below take (an estimated 10-20
    #    minutes on 2 idle cores for up to 8,000 steps).
    python benchmarks/quality.py --pilot
    # 2. The runs, one invocation per group (3 seeds, the pilot's steps; a group is a
    #    list of configurations, `benchmarks.quality_variants.GROUPS`), merged by
    #    --update into one quality.json; the main group took about 2 h 10 min on 2
    #    cores with --jobs=2 at 7,900 steps (docs/benchmarks.md, "Quality").
    #    TRAX_PY is a Python with Trax 1.4.1, e.g. /tmp/traxenv/bin/python.
    python benchmarks/quality.py --group=main --jobs=2   # the first one creates the file
    python benchmarks/quality.py --update --group=lsh --jobs=2
    # SentencePiece against bytes at equal wall time: alone, beside its byte reference
    #    (bytes_alone, rev_reversible rerun in the same invocation, so at the same code).
    python benchmarks/quality.py --update --group=tokenizer
    python benchmarks/quality.py --update --group=ablation --jobs=2
    python benchmarks/quality.py --update --group=trax_ablation --jobs=2 --trax_python=$TRAX_PY
    python benchmarks/quality.py --update --group=trax_lsh --jobs=2 --trax_python=$TRAX_PY
    python benchmarks/render_tables.py        # the README's and docs' tables
    python benchmarks/quality.py --quick      # tiny sizes, seconds (tests)

Without a pilot file, ``--steps`` (default 400) sets the budget and the run is marked not
converged unless the rule holds on its own plain curve. Targets are judged only on a
converged run; otherwise they read "not converged (budget)".

A group too long for one sitting splits into invocations by configuration
(``--configurations``) or by seed (``--seed=K --seeds=1`` runs seed K alone): a row
depends only on its configuration, its seed and the code it ran (a change of numerics
moves a seed by up to 0.005 bits/byte after 7,900 steps), and ``--update`` replaces rows
of the same (configuration, seed), so at unchanged code the merged file is the same as
one long run's. Each row records the date, machine and revtrain commit it ran at.

``--jobs=2`` runs two (configuration, seed) workers at a time, each on its own CPUs
(`taskset`): about 1.7x the throughput on 2 cores, and the same bits per byte, but each
row's wall time is then not an idle one; the table says so beside its load, and the
tokenizer group (compared at equal wall time) refuses it.

Data: `revtrain.data.TextFiles` on the embedded corpus (466 KB), the last 5% held out. All
configurations of a seed (at one length) see the same train batches and start from the
seed's key; the long configurations (``--long_seq_len``, LSH and its exact reference) see
as many tokens per step. Held-out bits per byte of the eval part's UTF-8 text, so byte
and SentencePiece models compare. Each (configuration, seed) runs in a fresh process.

Configurations (`benchmarks.quality_variants`, 2 layers, ReLU, dropout 0, Adam at
``--learning_rate``): the plain Transformer at equal width and at equal parameters (its
``d_ff`` computed), the reversible one with each trainer, LSH with 1, 2, 4, 8 hashes
(``--lsh_chunk_len`` 64 at 512 tokens), SentencePiece at equal wall time, the ablation
(one factor of Trax's at a time on revtrain's side, revtrain's on Trax's), and Trax's
ReformerLM (`benchmarks/trax_quality_worker.py`) on the same batches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):  # Run as a script: make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import flags  # noqa: E402

# sequence_length defines --trax_python and --update, which this script shares (--update:
# this run's rows merge into quality.json, replacing those of the same configuration and seed).
from benchmarks import harness, report, sequence_length  # noqa: E402, F401
from benchmarks import quality_report as qr  # noqa: E402
from benchmarks.quality_variants import (  # noqa: E402
    DEFAULT_VARIANTS,
    GROUPS,
    VARIANTS,
    needs_trax,
)
from benchmarks.quality_worker import measure, write_batches  # noqa: E402

NAME = "quality"
PILOT = "quality_pilot.json"
DEFAULTS = {"steps": 400, "seeds": qr.SEEDS, "eval_every": 50, "d_model": 64, "d_ff": 256,
            "n_heads": 4, "n_layers": 2, "seq_len": 128, "batch_size": 16,
            "long_seq_len": 512, "chunk_len": 64, "sp_vocab_size": 1024,
            "learning_rate": 2e-3, "schedule_warmup": 400, "pilot_max_steps": 8000}
QUICK = {"steps": 4, "seeds": 2, "eval_every": 2, "d_model": 16, "d_ff": 32, "n_heads": 2,
         "seq_len": 32, "batch_size": 4, "long_seq_len": 64, "chunk_len": 16,
         "sp_vocab_size": 400, "schedule_warmup": 2, "pilot_max_steps": 8}
FLAGS = flags.FLAGS
OWN_FLAGS = ("seeds", "eval_every", "long_seq_len", "sp_vocab_size", "learning_rate",
             "schedule_warmup", "pilot_max_steps")

flags.DEFINE_integer("seeds", None, f"seeds per configuration (default {DEFAULTS['seeds']})",
                     lower_bound=1)
flags.DEFINE_integer("eval_every", None, "steps between held-out evaluations (default "
                     f"{DEFAULTS['eval_every']})", lower_bound=1)
flags.DEFINE_integer("lsh_chunk_len", None, "LSH chunk (default "
                     f"{DEFAULTS['chunk_len']})", lower_bound=1)
flags.DEFINE_integer("long_seq_len", None, "length of the LSH rows and their exact "
                     f"reference (default {DEFAULTS['long_seq_len']})", lower_bound=2)
flags.DEFINE_integer("sp_vocab_size", None, "pieces of the SentencePiece model (default "
                     f"{DEFAULTS['sp_vocab_size']})", lower_bound=259)
flags.DEFINE_float("learning_rate", None, "Adam's (peak) rate (default "
                   f"{DEFAULTS['learning_rate']})", lower_bound=0.0)
flags.DEFINE_integer("schedule_warmup", None, "warmup steps of the warmup + rsqrt schedule "
                     f"rows (default {DEFAULTS['schedule_warmup']}, Trax's)", lower_bound=1)
flags.DEFINE_list("configurations", None, f"subset of {','.join(VARIANTS)} (default: "
                  f"{','.join(DEFAULT_VARIANTS)}, plus Trax's with --trax_python)")
flags.DEFINE_enum("group", None, list(GROUPS), "a named list of configurations, in place "
                  "of --configurations: " + "; ".join(f"{k}: {','.join(v)}"
                                                      for k, v in GROUPS.items()))
flags.DEFINE_boolean("pilot", False, "run the plain Transformer alone for "
                     "--pilot_max_steps and write the step count at which its held-out "
                     f"curve has flattened to {PILOT}, which later runs take as --steps")
flags.DEFINE_integer("pilot_max_steps", None, "the pilot's longest run (default "
                     f"{DEFAULTS['pilot_max_steps']})", lower_bound=1)
flags.DEFINE_string("label", None, "a note stored with the results (e.g. 'reduced run')")

TRAX_WORKER = Path(__file__).resolve().parent / "trax_quality_worker.py"


def parse_flags(argv: Sequence[str] | None) -> SimpleNamespace:
    """The run's settings: the shared harness flags plus this script's; ``--steps`` comes
    from the pilot file in ``--out_dir`` when it is not given.

    Raises:
      ValueError: for an unknown configuration, or one needing Trax without
        ``--trax_python``, or ``--lsh_chunk_len`` not below ``--long_seq_len``, or
        ``--jobs`` above the CPUs or with the equal-wall-time ``sentencepiece``.
    """
    args = harness.parse_flags(argv, steps=DEFAULTS["steps"], warmup=1)
    defaults = {**DEFAULTS, **(QUICK if args.quick else {})}
    for name in ("steps", "d_model", "d_ff", "n_heads", "seq_len", "batch_size", *OWN_FLAGS):
        setattr(args, name, getattr(FLAGS, name) if FLAGS[name].present else defaults[name])
    args.chunk_len = (FLAGS.lsh_chunk_len if FLAGS["lsh_chunk_len"].present
                      else defaults["chunk_len"])
    args.n_layers, args.pilot_steps = defaults["n_layers"], None
    pilot = args.out_dir / PILOT
    if not args.pilot and not FLAGS["steps"].present and pilot.exists():
        args.pilot_steps = json.loads(pilot.read_text())["steps"]
        args.steps = args.pilot_steps or args.steps
    if args.group and args.configurations:
        raise ValueError("--group and --configurations both given; pass one")
    names = GROUPS[args.group] if args.group else args.configurations or [*DEFAULT_VARIANTS, *(
        [v for v in VARIANTS if needs_trax(v)] if args.trax_python else [])]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"--configurations: unknown {unknown[0]!r}; use names from "
                         f"{', '.join(VARIANTS)}")
    trax = [n for n in names if needs_trax(n)]
    if trax and not args.trax_python:
        raise ValueError(f"--configurations={trax[0]} needs Trax: pass --trax_python=PATH "
                         f"(a Python with Trax 1.4.1, ../shared/peers/trax/install.sh)")
    harness.cpu_slots(args.jobs)
    timed = [n for n in GROUPS["tokenizer"] if n in names]
    if args.jobs > 1 and timed:
        raise ValueError(f"--jobs={args.jobs}: {timed[0]} is timed for SentencePiece's "
                         f"equal-wall-time comparison with bytes, which workers sharing "
                         f"the machine distort; run it with --jobs=1")
    if args.chunk_len >= args.long_seq_len:
        raise ValueError(f"--lsh_chunk_len={args.chunk_len} covers --long_seq_len="
                         f"{args.long_seq_len}; LSH needs chunks shorter than the sequence")
    args.configurations = names
    return args


def configurations(args: SimpleNamespace) -> list[dict[str, Any]]:
    """One config per (seed, variant), seed-major so that a partial run has whole seeds."""
    base = {name: getattr(args, name) for name in (
        "steps", "eval_every", "d_model", "d_ff", "n_heads", "n_layers", "seq_len",
        "batch_size", "long_seq_len", "chunk_len", "sp_vocab_size", "learning_rate",
        "schedule_warmup")}
    base |= {"vocab_size": 256, "dropout": 0.0}
    base |= harness.cache_setting(args)
    return [base | {"variant": v, "seed": args.seed + s}
            for s in range(args.seeds) for v in args.configurations]


# ------------------------------------------------------------------------------------------
# Trax's side: the parent writes the seed's batches, Trax's worker trains on them.

def _trax(args: SimpleNamespace, config: dict[str, Any], batches: Path,
          extra: Sequence[str] = (), cpus: Sequence[int] | None = None) -> dict[str, Any]:
    spec = VARIANTS[config["variant"]]
    payload = config | {"spec": dataclasses.asdict(spec)}
    command = harness.pinned([args.trax_python, str(TRAX_WORKER), json.dumps(payload),
                              str(batches), *extra], cpus)
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


_WRITING = threading.Lock()  # Concurrent workers of one seed share its batch file.


def _batches(config: dict[str, Any], tmp: Path) -> Path:
    length = VARIANTS[config["variant"]].length
    path = tmp / f"batches_{config['seed']}_{length}.npz"
    with _WRITING:
        if not path.exists():
            write_batches(config, path)
    return path


def run_one(args: SimpleNamespace, config: dict[str, Any], tmp: Path,
            cpus: Sequence[int] | None = None) -> dict[str, Any]:
    """One (configuration, seed) in a fresh process (on ``cpus`` only, when given), with
    the load average before and after, the date, the machine, the revtrain commit it ran
    (rows of one results file come from several invocations) and the number of workers
    that ran at once (``jobs``) beside its wall time."""
    before, spec = os.getloadavg()[0], VARIANTS[config["variant"]]
    if spec.framework == "trax":
        result = _trax(args, config, _batches(config, tmp), cpus=cpus)
    else:
        if spec.init == "trax":  # Trax's initial weights of the matched model, same seed.
            init = tmp / f"trax_init_{config['seed']}.npz"
            trax_config = config | {"variant": "trax_full"}
            dumped = _trax(args, trax_config, _batches(trax_config, tmp),
                           ["--dump_init", str(init)], cpus=cpus)
            if "error" in dumped:
                return config | {"error": f"Trax's initial weights: {dumped['error']}"}
            config = config | {"init_path": str(init)}
        result = harness.run_worker(__file__, config, args.timeout, cpus)
    info = harness.machine_info()
    return result | {"load_avg": [before, os.getloadavg()[0]], "measured": info["date"],
                     "host": f"{info['processor']} ({info['cpu_count']} CPUs)",
                     "commit": info["commit"], "jobs": args.jobs}


def run_all(args: SimpleNamespace, configs: list[dict[str, Any]], tmp: Path
            ) -> list[dict[str, Any]]:
    """Every (configuration, seed), ``args.jobs`` at a time, each on its own CPUs
    (`harness.cpu_slots`); the results in the order of ``configs``."""
    def line(config: dict[str, Any], result: dict[str, Any]) -> str:
        outcome = f"ERROR {result['error']}" if "error" in result else _describe(result)
        return f"seed {config['seed']}, {qr.label(config['variant'])}: {outcome}"

    return harness.run_each(lambda config, cpus: run_one(args, config, tmp, cpus), configs,
                            line, args.jobs, harness.cpu_slots(args.jobs))


# ------------------------------------------------------------------------------------------
# Outputs.

def settings(payload: dict[str, Any]) -> str:
    c = payload["config"]
    note = f" ({payload['label']})" if payload.get("label") else ""
    lsh = (f"LSH at {c['long_seq_len']} tokens, chunk_len {c['chunk_len']}"
           if "long_seq_len" in c else
           f"LSH at {c['seq_len']} tokens, chunk_len {c['chunk_len']} ({c['n_buckets']} "
           f"buckets)")  # The first results file ran LSH at seq_len.
    return (f"{c['steps']} steps{note}, d_model {c['d_model']}, d_ff {c['d_ff']}, "
            f"{c['n_layers']} layers, {c['n_heads']} heads, seq {c['seq_len']}, batch "
            f"{c['batch_size']}, Adam {c['learning_rate']:g} constant unless a row says "
            f"otherwise, dropout 0, {lsh}, SentencePiece {c['sp_vocab_size']} pieces")


def pilot_settings(pilot: dict[str, Any]) -> str:
    """The pilot's line under the quality table: its run and the budget it set."""
    c = pilot["config"]
    found = (f"flattened at {pilot['steps']:,} steps, the budget of a converged run"
             if pilot["steps"] else "did not flatten")
    return (f"the pilot ({qr.label(c['variant'])}, seed {c['seed']}, {c['steps']:,} steps, "
            f"held-out {pilot['result']['bits_per_byte']:.3f} bits/byte at the end) "
            f"{found} ({pilot['rule']})")


def verdict(payload: dict[str, Any]) -> str:
    state = qr.convergence(payload)
    word = "Converged" if state["converged"] else "Not converged (budget)"
    return f"{word}: {state['reason']}."


def summary_tables(payload: dict[str, Any], ablation_rows: bool = False) -> str:
    """The main table (the ablation's own rows only with ``ablation_rows``), the
    comparison it makes, the convergence verdict and the notes (added by hand, e.g. a
    known defect): what the README shows."""
    return "\n\n".join([qr.readme_table(payload, ablation_rows), qr.REFORMER_NOTE,
                         verdict(payload), *payload.get("notes", [])])


def tables(payload: dict[str, Any]) -> str:
    """`summary_tables` with every row, then the ablation and the targets."""
    converged = qr.convergence(payload)["converged"]
    parts = [summary_tables(payload, ablation_rows=True)]
    ablation = qr.ablation_table(payload["results"])
    if ablation:
        parts.append(ablation)
    checks = qr.targets(payload["results"], converged)
    if checks:
        parts.append(qr.targets_table(checks))
    return "\n\n".join(parts)


def markdown(payload: dict[str, Any]) -> str:
    info = payload["machine"]
    return "\n".join([
        f"Quality: {settings(payload)}.",
        f"Measured {info['date']} on {info['processor']} ({info['cpu_count']} CPUs), jax "
        f"{info['jax']}; each (configuration, seed) a fresh process; same batches and "
        f"initialisation key per seed for every configuration.", "", tables(payload)]) + "\n"


def write(out_dir: Path, payload: dict[str, Any]) -> None:
    payload["convergence"] = qr.convergence(payload)
    report.write_json(out_dir / f"{NAME}.json", payload)
    (out_dir / f"{NAME}.md").write_text(markdown(payload))
    qr.plot(out_dir / f"{NAME}.png", payload["results"])


def _describe(r: dict[str, Any]) -> str:
    return (f"bits/byte {r['bits_per_byte']:.4f}, train {r['train_s']:.1f} s, "
            f"{r['n_params']:,} parameters, load {r['load_avg'][0]:.1f}")


def run_pilot(args: SimpleNamespace) -> dict[str, Any]:
    """The plain Transformer for ``--pilot_max_steps``; writes `PILOT` with the steps
    from which its curve meets the rule (None when it never does)."""
    config = configurations(SimpleNamespace(**{**vars(args), "seeds": 1,
                                               "configurations": ["plain"],
                                               "steps": args.pilot_max_steps}))[0]
    with tempfile.TemporaryDirectory() as tmp:
        result = run_one(args, config, Path(tmp))
    if "error" in result:
        raise RuntimeError(f"the pilot failed: {result['error']}")
    steps = qr.pilot_steps(result["curve"])
    pilot = {"steps": steps, "rule": f"last {qr.FLAT_FRACTION:.0%} of the steps improve "
             f"{qr.label('plain')} by < {qr.FLAT_BITS} bits/byte",
             "machine": harness.machine_info(args.command), "config": config,
             "result": result}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(args.out_dir / PILOT, pilot)
    print(f"pilot: {'flattened at ' + str(steps) + ' steps' if steps else 'not flattened'} "
          f"within {args.pilot_max_steps} steps"
          f"{'' if steps else '; raise --pilot_max_steps'}", flush=True)
    return pilot


def _shared(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in ("variant", "seed")}


def _cli() -> None:
    """``main`` from the shell: bad settings are one line and exit status 2."""
    try:
        main()
    except ValueError as e:
        print(f"quality.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the pilot, the benchmark (``--update``: merged into the results file) or,
    with ``--render_only``, re-renders it; returns the payload."""
    args = parse_flags(argv)
    path = args.out_dir / f"{NAME}.json"
    if args.render_only:
        payload = report.read_json(path)
        write(args.out_dir, payload)
        return payload
    if args.pilot:
        return run_pilot(args)
    if args.update and not path.exists():
        raise ValueError(f"--update: {path} does not exist; run once without --update")
    old = report.read_json(path) if args.update else None
    configs, start = configurations(args), time.perf_counter()
    if old is not None:  # Before hours of training, not after.
        qr.check_mergeable(old["config"], _shared(configs[0]))
    with tempfile.TemporaryDirectory() as tmp:
        results = run_all(args, configs, Path(tmp))
    payload = {"benchmark": NAME, "machine": harness.machine_info(args.command),
               "label": args.label, "wall_s": time.perf_counter() - start,
               "pilot_steps": args.pilot_steps,
               "config": _shared(configs[0]),
               "results": results}
    if old is not None:
        payload = qr.merge(old, payload)
    write(args.out_dir, payload)
    print(markdown(payload))
    return payload


if __name__ == "__main__":
    harness.script_main(_cli, measure)
