"""Peak memory and step time against sequence length, by attention and feed-forward kind.

Usage (from the repository root, after ``pip install -e '.[bench]'``)::

    python benchmarks/sequence_length.py                 # 1K..64K, the issue's model
    python benchmarks/sequence_length.py --quick         # tiny sizes, seconds
    python benchmarks/sequence_length.py --trax_python=/tmp/traxenv/bin/python  # + Trax
    python benchmarks/sequence_length.py --mesh          # named meshes of 4 devices

The model is the long-context one of ``configs/reversible_lm_64k.gin`` at benchmark sizes:
`ReversibleTransformerLM` (vocab 256, d_model 128, d_ff 512, 2 layers, 4 heads, dropout 0)
with ``CrossEntropyLoss(n_chunks=length // 4096)``, batch 1, Adam, trained by ``--trainer`` (default
`ReversibleSerialTrainer`) on one device. Variants (``--attention_kinds``):

* ``full`` -- ``CausalAttention(implementation='xla')``: the ``length x length`` path,
  run up to ``--full_max_length`` (beyond it the buffers exceed this machine's memory);
* ``blockwise`` -- ``implementation='blockwise'`` (``--block_size``), feed-forward whole;
* ``blockwise_chunked`` -- the same with ``ff_chunk_size=--ff_chunk_size``;
* ``default`` -- ``implementation=None`` (chosen by size) with the chunked feed-forward;
* ``lsh`` -- `LSHCausalAttention` (``--chunk_len``, ``--n_hashes``, one chunk before)
  with the chunked feed-forward: Reformer's configuration, as Trax's LSH rows.

Each (variant, length) runs in a fresh process: model construction and initialisation
(``build_s``), ``--warmup`` steps (the first compiles, its time is ``first_step_s``), then
``--steps`` measured steps; above ``--one_step_above`` positions (the 1,048,576-token LSH
row) one step, no warm-up, and only LSH runs above ``--exact_max_length``. Reported: the
peak device bytes (``memory_stats`` on GPU/TPU, the dispatch ledger on CPU:
`revtrain.memory`), also per token and model dimension (B/tok/dim, beside the analytic
floor of `floor_bytes`), the process's peak RSS, the median step time, the model FLOPs per
step (``6 x`` the forward
multiply-adds' FLOPs of the projections, the causal half of the attention products, the
feed-forward and the head: the usual training estimate, reversal's recomputation not
counted) and their rate as a fraction of a dense float32 ``4096 x 4096`` matmul's FLOP/s
measured in the same process (the machine's practical peak).

With ``--trax_python`` (a Python with Trax 1.4.1: ``../shared/peers/trax/install.sh``),
the same lengths also run Trax's ``ReformerLM`` with its ``ReversibleSerialTrainer``
(``--trax_script``: full attention up to ``--full_max_length``, LSH attention up to
``--trax_max_length``), interleaved with revtrain's, each in a fresh process, so the two
sides share the hour and the machine. Trax runs at revtrain's per-head attention width
(``d_model // n_heads``; ``--trax_d_attention`` sets another: Trax's ``ReformerLM``
defaults to 64), and its ``ReformerLM`` trains an ``[L, d_model]`` position table
(``axial_pos_shape=None``) that revtrain's sinusoidal table is not. Its ``setup_s`` is the
process's time less its steps: imports, construction and initialisation. Writes
``sequence_length.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):  # Run as a script: make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import flags  # noqa: E402

from benchmarks import harness, report, sequence_mesh  # noqa: E402

NAME = "sequence_length"
VARIANTS = {
    "full": "full (xla)",
    "blockwise": "blockwise",
    "blockwise_chunked": "blockwise + ff chunks",
    "default": "default + ff chunks",
    "lsh": "LSH + ff chunks",
}
TRAX_VARIANTS = {"trax_full": "Trax full", "trax_lsh": "Trax LSH"}
DEFAULTS = {"lengths": "1024,4096,8192,16384,65536", "trax_max_length": 65536,
            "d_model": 128, "d_ff": 512, "n_layers": 2, "n_heads": 4, "vocab_size": 256,
            "block_size": 512, "ff_chunk_size": 4096,
            "full_max_length": 8192, "chunk_len": 128, "n_hashes": 2,
            "exact_max_length": 65536, "one_step_above": 524288}
QUICK = {"lengths": "64,256", "d_model": 32, "d_ff": 64, "block_size": 32,
         "ff_chunk_size": 64, "full_max_length": 256, "chunk_len": 16,
         "trax_max_length": 256, "exact_max_length": 256, "one_step_above": 256}
TRAX_SCRIPT = Path(__file__).resolve().parents[2] / "shared" / "peers" / "trax" / (
    "reformer_length.py")
FLAGS = flags.FLAGS

flags.DEFINE_list("lengths", None, f"sequence lengths (default {DEFAULTS['lengths']})")
flags.DEFINE_list("attention_kinds", list(VARIANTS), f"subset of {','.join(VARIANTS)}")
flags.DEFINE_enum("trainer", "reversible", ["trainer", "reversible", "memory_efficient"],
                  "which trainer runs the revtrain variants")
flags.DEFINE_integer("n_layers", None, "model depth (default 2)", lower_bound=1)
flags.DEFINE_integer("block_size", None, "blockwise attention's block (default 512)",
                     lower_bound=1)
flags.DEFINE_integer("ff_chunk_size", None, "positions per feed-forward chunk (default "
                     "4096)", lower_bound=1)
flags.DEFINE_integer("chunk_len", None, "LSH attention's chunk (default 128)", lower_bound=1)
flags.DEFINE_integer("n_hashes", None, "LSH attention's hashing rounds (default 2)",
                     lower_bound=1)
flags.DEFINE_integer("full_max_length", None, "longest length the full path and Trax's "
                     "full attention run at (default 8192)", lower_bound=1)
flags.DEFINE_integer("trax_max_length", None, "longest length Trax's LSH attention runs "
                     "at (default 65536)", lower_bound=1)
flags.DEFINE_string("trax_python", None, "a Python with Trax 1.4.1 installed: also run "
                    "Trax's ReformerLM (full and LSH attention) at each length")
flags.DEFINE_string("trax_script", str(TRAX_SCRIPT), "the Trax side's script")
flags.DEFINE_integer("trax_d_attention", None, "Trax's per-head attention width "
                     "(d_attention_key = d_attention_value; default d_model // n_heads, "
                     "revtrain's: matched)", lower_bound=1)
flags.DEFINE_integer("exact_max_length", None, "longest length the exact variants run at "
                     "(default 65536); only LSH runs above", lower_bound=1)
flags.DEFINE_integer("one_step_above", None, "above this length a configuration runs one "
                     "step, no warm-up (default 524288: the 1,048,576-token row)",
                     lower_bound=1)
flags.DEFINE_boolean("update", False, "re-measure only the configurations asked for and "
                     "replace their rows in the JSON already in --out_dir (the other rows, "
                     "and the run's date, are kept; each row records its own time)")
flags.register_validator("attention_kinds",
                         lambda v: bool(v) and set(v) <= set(VARIANTS),
                         f"--attention_kinds must be a subset of {','.join(VARIANTS)}")
flags.register_validator("lengths", lambda v: v is None or harness.positive_ints(v),
                         "--lengths must be positive integers, e.g. 1024,4096")


def parse_flags(argv: Sequence[str] | None) -> SimpleNamespace:
    """The run's settings (shared harness flags plus this script's); see `harness`."""
    args = harness.parse_flags(argv, steps=2, warmup=1)
    defaults = {**DEFAULTS, **(QUICK if args.quick else {})}
    for name in ("lengths", "n_layers", "block_size", "ff_chunk_size", "full_max_length",
                 "d_model", "d_ff", "n_heads", "vocab_size", "chunk_len", "n_hashes",
                 "trax_max_length", "exact_max_length", "one_step_above"):
        value = getattr(FLAGS, name)
        explicit = FLAGS[name].present
        setattr(args, name, value if explicit and value is not None else defaults[name])
    lengths = args.lengths.split(",") if isinstance(args.lengths, str) else args.lengths
    args.lengths = [int(n) for n in lengths]
    args.dropout = 0.0 if not FLAGS["dropout"].present else args.dropout
    args.batch_size = 1 if not FLAGS["batch_size"].present else args.batch_size
    args.trax_d_attention = FLAGS.trax_d_attention or args.d_model // args.n_heads
    return args


def base_config(args: SimpleNamespace) -> dict[str, Any]:
    """The model and run settings every configuration shares."""
    base = {name: getattr(args, name) for name in (
        "d_model", "d_ff", "n_heads", "n_layers", "vocab_size", "batch_size", "dropout",
        "block_size", "ff_chunk_size", "chunk_len", "n_hashes", "steps", "warmup", "seed",
        "trainer")}
    base |= harness.cache_setting(args)
    return base | {"n_devices": 1, "host_allocator": harness.host_heap.host_allocator_choice()}


def configurations(args: SimpleNamespace) -> list[dict[str, Any]]:
    """One config per (length, variant), length-major; Trax's runs beside revtrain's."""
    base, configs = base_config(args), []
    for length in args.lengths:
        at = base | {"seq_len": length}
        if length > args.one_step_above:
            at |= {"warmup": 0, "steps": 1}
        for variant in args.attention_kinds:
            if variant == "full" and length > args.full_max_length:
                continue
            if variant != "lsh" and length > args.exact_max_length:
                continue
            configs.append(at | {"variant": variant})
        trax = at | {"trax_d_attention": args.trax_d_attention}
        if args.trax_python:
            if length <= args.full_max_length and "full" in args.attention_kinds:
                configs.append(trax | {"variant": "trax_full"})
            if length <= args.trax_max_length:
                configs.append(trax | {"variant": "trax_lsh"})
    return configs


def floor_bytes(config: dict[str, Any]) -> float:
    """The analytic floor of a reversible step's device memory, in bytes
    (``docs/long_sequences.md``): per token, the two float32 residual streams and their
    cotangents (``4 x 4 d_model`` bytes) and one layer's irreducible temporaries, heads
    one at a time: one head's queries, keys and values, their cotangents and its output
    (``4 (2 (2 d_key + d_value) + d_value)`` bytes, ``d_key = d_value = d_model //
    n_heads``). 23 B per token and model dimension at d_model 128 and 4 heads."""
    d = config["d_model"]
    width = d // config["n_heads"]
    per_token = 4 * (4 * d + 2 * (2 * width + width) + width)
    return float(per_token * config["seq_len"] * config["batch_size"])


def per_token_dim(n_bytes: float, config: dict[str, Any]) -> float:
    """``n_bytes / (length x d_model x batch)``: bytes per token per model dimension."""
    return n_bytes / (config["seq_len"] * config["d_model"] * config["batch_size"])


# ------------------------------------------------------------------------------------------
# Worker side.

def model_flops(config: dict[str, Any]) -> float:
    """Training FLOPs of one step: 6 x (multiply-adds of the forward pass) per token (for
    LSH, the products its kernel computes: each query against two chunks per round)."""
    n, d, f = config["seq_len"], config["d_model"], config["d_ff"]
    if config["variant"] == "lsh":  # shared query/key; 2 chunks of keys per query, per round
        window = 2 * min(config["chunk_len"], n)
        per_layer = 3 * d * d + 2 * d * f + 2 * config["n_hashes"] * window * d
    else:
        per_layer = 4 * d * d + 2 * d * f + 2 * (n + 1) / 2 * d  # attention: causal half
    macs = config["batch_size"] * n * (config["n_layers"] * per_layer
                                       + 2 * d * config["vocab_size"])
    return 6.0 * macs


def matmul_flops_per_second(n: int = 4096, repeats: int = 3) -> float:
    """FLOP/s of a dense float32 ``n x n`` matmul on the default device (best of a few)."""
    import jax
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(jnp.dot)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best


def build(config: dict[str, Any]):
    """The configured trainer on the long-context model, and a batch."""
    import functools
    import math

    import jax
    import optax

    from revtrain import layers as tl
    from revtrain.models import ReversibleTransformerLM
    from revtrain.parallel.mesh import mesh_from_shape
    from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer

    variant = config["variant"]
    implementation = {"full": "xla", "default": None}.get(variant, "blockwise")
    if variant == "lsh":
        attention = functools.partial(tl.LSHCausalAttention, chunk_len=config["chunk_len"],
                                      n_hashes=config["n_hashes"])
    else:
        attention = functools.partial(tl.CausalAttention, implementation=implementation,
                                      block_size=config["block_size"])
    chunk = config["ff_chunk_size"] if variant in ("blockwise_chunked", "default", "lsh") else (
        None)
    model = ReversibleTransformerLM(
        vocab_size=config["vocab_size"], d_model=config["d_model"], d_ff=config["d_ff"],
        n_layers=config["n_layers"], n_heads=config["n_heads"], max_len=config["seq_len"],
        dropout=config["dropout"], attention_type=attention, ff_chunk_size=chunk,
        ff_activation=tl.Relu)
    batch = harness.make_batch(config)
    signature = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in batch)
    # The fused loss in chunks of 4,096 positions (as configs/reversible_lm_64k.gin binds).
    n_chunks = max(1, config["seq_len"] // 4096)
    blocks, loss = tl.extract_reversible_blocks([model, tl.CrossEntropyLoss(n_chunks=n_chunks)])
    tl.init_reversible_blocks(blocks, loss, signature, jax.random.key(config["seed"]))

    def optimizer_fn():
        return optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)

    # ``--mesh`` runs: a named mesh of the worker's devices (`sequence_mesh`).
    mesh = None
    if "mesh" in config:  # Over the first devices of the worker's (its seq=1 run: one).
        mesh = mesh_from_shape(config["mesh"], n_devices=math.prod(config["mesh"].values()))
    if config["trainer"] == "trainer":
        return Trainer(tl.fuse_loss_heads(tl.Serial(tl.blocks_to_layers(blocks, loss))),
                       optimizer_fn, mesh=mesh), batch
    cls = {"reversible": ReversibleSerialTrainer,
           "memory_efficient": MemoryEfficientTrainer}[config["trainer"]]
    return cls(blocks, loss, optimizer_fn, mesh=mesh), batch


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """One revtrain configuration: first step, measured steps, peak memory, FLOP/s."""
    import jax

    from revtrain import memory

    start = time.perf_counter()
    trainer, batch = build(config)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(config["warmup"]):
        trainer.one_step(batch, jax.random.key(step), step=step)
        trainer.block_until_ready()
        if step == 0:
            first = time.perf_counter() - start
    times, cpu_times, losses = [], [], []
    with memory.track_peak(trainer) as peak:
        for step in range(config["warmup"], config["warmup"] + config["steps"]):
            begin, cpu_begin = time.perf_counter(), time.process_time()
            loss, _ = trainer.one_step(batch, jax.random.key(step), step=step)
            trainer.block_until_ready()
            times.append(time.perf_counter() - begin)
            cpu_times.append(time.process_time() - cpu_begin)
            losses.append(float(loss))
    step_s = statistics.median(times)
    if not config["warmup"]:  # One step, compile included (the longest rows).
        first = times[0]
    if "mesh" in config:
        return {"method": peak.method, "peak_bytes": peak.peak_bytes, "step_s": step_s,
                "step_times_s": times, "step_cpu_s": statistics.median(cpu_times),
                "losses": losses, "first_step_s": first, **sequence_mesh.footprint(trainer)}
    flops = model_flops(config)
    matmul = matmul_flops_per_second()
    return {"method": peak.method, "peak_bytes": peak.peak_bytes,
            "peak_label": peak.peak_label, "peak_rss_bytes": peak.peak_rss_bytes,
            "first_step_s": first, "build_s": build_s, "step_s": step_s, "step_times_s": times,
            "losses": losses, "model_flops": flops, "model_flops_per_s": flops / step_s,
            "matmul_flops_per_s": matmul, "fraction_of_matmul": flops / step_s / matmul}


def run_trax(args: SimpleNamespace, config: dict[str, Any]) -> dict[str, Any]:
    """Trax's side in a fresh process: its script prints one JSON line."""
    attention = "full" if config["variant"] == "trax_full" else "lsh"
    command = [args.trax_python, args.trax_script, str(config["seq_len"]),
               str(config["d_model"]), attention, str(config["trax_d_attention"])]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                              env=harness.worker_env(1) | {"XLA_FLAGS": ""})
    except subprocess.TimeoutExpired:
        return config | {"error": f"timed out after {args.timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            out = json.loads(line)
            wall = time.perf_counter() - start
            # Its script runs three steps (the first compiles; step_s is the faster other).
            setup = wall - out["first_s"] - 2 * out["step_s"]
            return config | {"peak_rss_bytes": out["peak_rss_MiB"] * harness.MIB,
                             "first_step_s": out["first_s"], "step_s": out["step_s"],
                             "losses": [out["loss"]], "worker_wall_s": wall,
                             "setup_s": setup, "trax_d_attention": out.get(
                                 "d_attention", config["trax_d_attention"])}
    tail = "\n".join(done.stderr.strip().splitlines()[-8:])
    return config | {"error": f"trax exited with code {done.returncode}: {tail}"}


# ------------------------------------------------------------------------------------------
# Parent side: run, write, render.

def _describe(r: dict[str, Any]) -> str:
    peak = f"peak {report.mib(r.get('peak_bytes'))} MiB ({r['method']}), " if (
        "method" in r) else ""
    return (f"{peak}peak RSS {report.mib(r['peak_rss_bytes'])} MiB, step {r['step_s']:.2f} s,"
            f" first step {r['first_step_s']:.1f} s")


def variant_label(variant: str) -> str:
    return {**VARIANTS, **TRAX_VARIANTS}[variant]


# The issue's figures, before blockwise attention: the ledger peak of the full path at 8K and
# Trax 1.4.1's LSH peak RSS at 64K (used when a run has no Trax rows of its own).
BEFORE_8K_PEAK_MIB = 4180
TRAX_LSH_64K_RSS_MIB = 1715


def _find(results: Sequence[dict[str, Any]], variant: str, length: int) -> dict | None:
    found = [r for r in results if r["variant"] == variant and r["seq_len"] == length
             and "error" not in r]
    return found[0] if found else None


def targets(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The long-sequence targets, checked against ``results`` (those it has rows for)."""
    checks = []

    def check(target, value, met):
        checks.append({"target": target, "value": value, "met": bool(met)})

    long = _find(results, "default", 65536) or _find(results, "blockwise_chunked", 65536)
    if long:
        peak = long["peak_bytes"] / harness.MIB
        check("64K peak device memory <= 512 MiB", f"{peak:,.1f} MiB", peak <= 512)
        trax = _find(results, "trax_lsh", 65536)
        limit = trax["peak_rss_bytes"] / harness.MIB if trax else TRAX_LSH_64K_RSS_MIB
        rss = long["peak_rss_bytes"] / harness.MIB
        check(f"64K peak RSS <= Trax LSH's ({limit:,.0f} MiB)", f"{rss:,.0f} MiB",
              rss <= limit)
        mid = _find(results, long["variant"], 16384)
        if mid:
            ratio = long["peak_bytes"] / mid["peak_bytes"]
            check("linear: 64K peak <= 4.5x 16K peak", f"{ratio:.2f}x", ratio <= 4.5)
    default = _find(results, "default", 8192)
    if default:
        ratio = default["peak_bytes"] / harness.MIB / BEFORE_8K_PEAK_MIB
        check(f"8K default peak <= 0.15x the full path's {BEFORE_8K_PEAK_MIB:,} MiB before",
              f"{ratio:.3f}x", ratio <= 0.15)
    full, trax_full = _find(results, "full", 8192), _find(results, "trax_full", 8192)
    if full and trax_full:
        ratio = full["peak_rss_bytes"] / trax_full["peak_rss_bytes"]
        check("8K full path peak RSS <= Trax full attention's", f"{ratio:.2f}x", ratio <= 1.0)
    checks += _lsh_targets(results)
    return checks


def _lsh_targets(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The LSH attention targets: 64K against Trax's LSH step, 512K under 4 GiB, linear."""
    checks = []
    lsh, trax = _find(results, "lsh", 65536), _find(results, "trax_lsh", 65536)
    if lsh:
        peak = lsh["peak_bytes"] / harness.MIB
        checks.append({"target": "LSH 64K peak device memory <= 512 MiB",
                       "value": f"{peak:,.1f} MiB", "met": peak <= 512})
        if trax:
            ratio = lsh["step_s"] / trax["step_s"]
            checks.append({"target": "LSH 64K step <= Trax LSH's step",
                           "value": f"{lsh['step_s']:.2f} s vs {trax['step_s']:.2f} s "
                                    f"({ratio:.2f}x)", "met": ratio <= 1.0})
            rss, limit = (r["peak_rss_bytes"] / harness.MIB for r in (lsh, trax))
            checks.append({"target": f"LSH 64K peak RSS <= Trax LSH's ({limit:,.0f} MiB)",
                           "value": f"{rss:,.0f} MiB", "met": rss <= limit})
        mid = _find(results, "lsh", 16384)
        if mid:
            for key, what in (("step_s", "step time"), ("peak_bytes", "peak")):
                ratio = lsh[key] / mid[key]
                checks.append({"target": f"LSH linear: 64K {what} <= 4.5x 16K's",
                               "value": f"{ratio:.2f}x", "met": ratio <= 4.5})
    checks += _floor_targets(results)
    half_million = _find(results, "lsh", 524288)
    if half_million:
        peak = half_million["peak_bytes"] / 2 ** 30
        checks.append({"target": "LSH 512K: a step completes, peak device memory <= 4 GiB",
                       "value": f"{peak:.2f} GiB, step {half_million['step_s']:.1f} s",
                       "met": peak <= 4})
    return checks


def _floor_targets(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 38's targets: 32 B/tok/dim at 64K (exact and LSH), the 1M LSH step, RSS and
    first steps against Trax's in the same run."""
    checks = []

    def check(target, value, met):
        checks.append({"target": target, "value": value, "met": bool(met)})

    for variant in ("default", "lsh"):
        r = _find(results, variant, 65536)
        if r and "peak_bytes" in r:
            per_dim = per_token_dim(r["peak_bytes"], r)
            check(f"{variant_label(variant)} 64K ledger <= 32 B/tok/dim", f"{per_dim:.1f}",
                  per_dim <= 32)
    million = _find(results, "lsh", 1048576)
    if million:
        peak, rss = million["peak_bytes"] / 2 ** 30, million["peak_rss_bytes"] / 2 ** 30
        check("LSH 1M: ledger <= 4 GiB, RSS <= 5.5 GiB", f"{peak:.2f} / {rss:.2f} GiB",
              peak <= 4 and rss <= 5.5)
    lsh, trax = _find(results, "lsh", 65536), _find(results, "trax_lsh", 65536)
    if lsh and trax:
        ratio = lsh["peak_rss_bytes"] / trax["peak_rss_bytes"]
        check("LSH 64K RSS <= 0.8x Trax LSH's", f"{ratio:.2f}x", ratio <= 0.8)
    for length in (16384, 65536):
        lsh, trax = _find(results, "lsh", length), _find(results, "trax_lsh", length)
        if lsh and trax:
            check(f"LSH {length // 1024}K first step <= Trax's",
                  f"{lsh['first_step_s']:.1f} s vs {trax['first_step_s']:.1f} s",
                  lsh["first_step_s"] <= trax["first_step_s"])
    return checks


def readme_table(payload: dict[str, Any]) -> str:
    """The documents' table (`benchmarks.render_tables`): per length, revtrain's full,
    default and LSH paths beside Trax's."""
    results = payload["results"]
    lengths = sorted({r["seq_len"] for r in results})

    def cell(variant, length, device=True):
        r = _find(results, variant, length)
        if r is None:
            return "—"
        memory = (f"{report.mib(r['peak_bytes'])} ({per_token_dim(r['peak_bytes'], r):.0f}) / "
                  if device and "peak_bytes" in r else "")
        return f"{memory}{report.mib(r['peak_rss_bytes'])} / {r['step_s']:.2f} s"

    def floor(length):
        r = next(r for r in results if r["seq_len"] == length)
        return f"{per_token_dim(floor_bytes(r), r):.0f}"

    rows = [[f"{n:,}", cell("full", n), cell("default", n), cell("lsh", n),
             cell("trax_full", n, False), cell("trax_lsh", n, False), floor(n)]
            for n in lengths]
    return report.markdown_table(
        ["length", "revtrain full: peak MiB (B/tok/dim) / RSS MiB / step",
         "revtrain default: peak MiB (B/tok/dim) / RSS MiB / step",
         "revtrain LSH: peak MiB (B/tok/dim) / RSS MiB / step",
         "Trax full: RSS MiB / step", "Trax LSH: RSS MiB / step", "floor B/tok/dim"], rows)


def notes(payload: dict[str, Any]) -> str:
    """What the table's columns hold beyond their headers, for the documents."""
    widths = sorted({r["trax_d_attention"] for r in payload["results"]
                     if "trax_d_attention" in r})
    c = payload["config"]
    trax = (f"Trax at per-head attention width {', '.join(map(str, widths))} (revtrain's is "
            f"{c['d_model'] // c['n_heads']})" if widths else
            "Trax at its ReformerLM's default per-head attention width 64 (revtrain's is "
            f"{c['d_model'] // c['n_heads']})")
    return (f"B/tok/dim: peak device bytes per token per model dimension; floor: the "
            f"analytic floor (`floor_bytes`). {trax}; Trax's ReformerLM also trains an "
            f"`[L, d_model]` position table (`axial_pos_shape=None`), where revtrain's "
            f"sinusoidal table has no weights.")


def _measured_on(r: dict[str, Any], info: dict[str, Any]) -> str:
    """A row's processor and date: rows replaced by ``--update`` carry their own."""
    return f"{r.get('processor', info['processor'])}, {r.get('measured', info['date'])[:16]}"


def markdown(payload: dict[str, Any]) -> str:
    """The results as a Markdown table (one row per length and variant)."""
    c, info = payload["config"], payload["machine"]
    lines = [f"Sequence length: {c['trainer']} trainer, d_model {c['d_model']}, d_ff "
             f"{c['d_ff']}, {c['n_layers']} layers, {c['n_heads']} heads, batch "
             f"{c['batch_size']}, vocab {c['vocab_size']}, dropout {c['dropout']}, Adam; "
             f"block_size {c['block_size']}, ff_chunk_size {c['ff_chunk_size']}; host "
             f"allocator {c.get('host_allocator', 'system')}.",
             f"Measured {info['date']} on {info['processor']} ({info['cpu_count']} CPUs), "
             f"jax {info['jax']}, except the rows whose 'measured' column names another "
             f"machine or date (replaced by --update); each row a fresh process, Trax's "
             f"rows interleaved with revtrain's of the same run.", ""]
    rows = []
    for r in payload["results"]:
        if "error" in r:
            rows.append([f"{r['seq_len']:,}", variant_label(r["variant"]), "failed",
                         "", "", "", ""])
            continue
        peak = f"{report.mib(r['peak_bytes'])} ({r['method']})" if "peak_bytes" in r else "—"
        per_dim = "—" if "peak_bytes" not in r else (
            f"{per_token_dim(r['peak_bytes'], r):.1f} ({per_token_dim(floor_bytes(r), r):.1f})")
        fraction = f"{100 * r['fraction_of_matmul']:.1f}%" if "fraction_of_matmul" in r else "—"
        setup = r.get("build_s", r.get("setup_s"))
        rows.append([f"{r['seq_len']:,}", variant_label(r["variant"]), peak, per_dim,
                     report.mib(r["peak_rss_bytes"]), f"{r['step_s']:.2f}",
                     f"{r['first_step_s']:.1f}", "—" if setup is None else f"{setup:.1f}",
                     fraction, _measured_on(r, info)])
    lines.append(report.markdown_table(
        ["length", "variant", "peak device MiB", "B/tok/dim (floor)", "peak RSS MiB",
         "step s", "first step s", "build s", "model FLOP/s vs matmul", "measured"], rows))
    lines += ["", notes(payload) + " Build s: model construction and initialisation "
              "(Trax: its process's time less its steps, imports included)."]
    checks = targets(payload["results"])
    if checks:
        lines += ["", report.targets_table(checks)]
    return "\n".join(lines) + "\n"


def plot(path: Path, results: Sequence[dict[str, Any]]) -> bool:
    """Peak memory and step time against length, log-log, one line per variant."""
    plt = report.pyplot(path)
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("peak device memory", "MiB", "peak_bytes", harness.MIB),
              ("peak RSS", "MiB", "peak_rss_bytes", harness.MIB),
              ("step time", "s", "step_s", 1.0))
    variants = dict.fromkeys(r["variant"] for r in results)
    for ax, (title, unit, key, scale) in zip(axes, panels, strict=True):
        for variant in variants:
            points = [(r["seq_len"], r[key] / scale) for r in results
                      if r["variant"] == variant and "error" not in r and key in r]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=variant_label(variant))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes:  # Trax's rows have no device-memory figure: a legend per panel.
        ax.legend(fontsize=7)
    report.save_figure(plt, fig, path)
    return True


def write(out_dir: Path, payload: dict[str, Any]) -> None:
    report.write_json(out_dir / f"{NAME}.json", payload)
    (out_dir / f"{NAME}.md").write_text(markdown(payload))
    plot(out_dir / f"{NAME}.png", payload["results"])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs (or, with ``--render_only``, re-renders) the benchmark; returns the payload."""
    args = parse_flags(argv)
    if FLAGS.mesh and args.render_only:
        payload = report.read_json(args.out_dir / f"{sequence_mesh.NAME}.json")
        (args.out_dir / f"{sequence_mesh.NAME}.md").write_text(sequence_mesh.markdown(payload))
        return payload
    if FLAGS.mesh:
        return sequence_mesh.run(args, base_config(args), __file__)
    if args.render_only:
        payload = report.read_json(args.out_dir / f"{NAME}.json")
        write(args.out_dir, payload)
        return payload
    configs = configurations(args)
    results = []
    previous = report.read_json(args.out_dir / f"{NAME}.json") if args.update else None
    for k, config in enumerate(configs, 1):
        if config["variant"] in TRAX_VARIANTS:
            result = run_trax(args, config)
        else:
            result = harness.run_worker(__file__, config, args.timeout)
        outcome = f"ERROR {result['error']}" if "error" in result else _describe(result)
        print(f"[{k}/{len(configs)}] length {config['seq_len']:,}, "
              f"{variant_label(config['variant'])}: {outcome}", flush=True)
        info = harness.machine_info()
        results.append(result | {"measured": info["date"], "processor": info["processor"]})
    if previous is not None:
        new = {(r["variant"], r["seq_len"]): r for r in results}
        old = previous["results"]
        results = [new.pop((r["variant"], r["seq_len"]), r) for r in old] + list(new.values())
        payload = previous | {"results": results}
        write(args.out_dir, payload)
        print(markdown(payload))
        return payload
    payload = {"benchmark": NAME, "machine": harness.machine_info(args.command),
               "config": harness.with_workers_host_allocator(configs[0], results),
               "results": results}
    write(args.out_dir, payload)
    print(markdown(payload))
    return payload


if __name__ == "__main__":
    harness.script_main(main, measure)
