"""Ring attention against one-device blockwise attention: equality, time, memory, balance.

Usage (from the repository root, after ``pip install -e '.[bench]'``)::

    python benchmarks/ring_attention.py            # length 16,384 on 4 forced CPU devices
    python benchmarks/ring_attention.py --quick    # length 1,024, seconds

For random float32 ``q, k, v`` ``[batch, length, heads, d_head]`` (default 1 x 16,384 x 4 x
32, the long-context model's attention) and a random output cotangent, it runs

* `revtrain.layers.attention.ring` inside ``shard_map`` over ``--n_shards`` devices (the
  inputs in the striped layout of `revtrain.layers.sequence_layout`), and
* `revtrain.layers.attention.blockwise` on one device,

each as one jitted forward + backward program (output and the gradients of ``q, k, v``),
with the same ``--block_size``. It reports the largest absolute difference of the output
and of each gradient (and that difference relative to the largest reference value), the
compile and run times (median of ``--runs``; on forced CPU devices all shards share this
machine's cores, so the ring's time is not a parallel speed-up), each program's
per-device bytes from XLA's ``memory_analysis`` (temporaries, and in all: arguments,
outputs and temporaries) and the process's peak RSS.

Load balance: ring steps per shard (`revtrain.layers.sequence_parallel.ring_block_counts`)
for the striped layout used, contiguous shards and zig-zag chunks (Llama 3's context
parallelism: ``2n`` chunks, shard ``s`` holding ``s`` and ``2n - 1 - s``): the max / mean
block pairs over shards at the worst step, and the slowdown ``sum_steps max / sum_steps
mean`` (1 = balanced). Writes ``ring_attention.json`` and ``.md`` to ``--out_dir``
(``--compile_only``: ``ring_attention_<length>_memory.json`` and ``.md``, the temporaries
without running, e.g. at ``--length 65536``); the JSON's ``machine`` records the date, the
machine, the versions, the commit and the command (`benchmarks.provenance`).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # Run as a script: make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

from benchmarks import provenance  # noqa: E402

NAME = "ring_attention"
FLAGS = flags.FLAGS
flags.DEFINE_integer("length", 16384, "global sequence length")
flags.DEFINE_integer("n_shards", 4, "devices of the seq axis (forced CPU devices)")
flags.DEFINE_integer("block_size", 512, "rows per block (local rows for the ring)")
flags.DEFINE_integer("batch", 1, "batch size")
flags.DEFINE_integer("heads", 4, "attention heads")
flags.DEFINE_integer("d_head", 32, "features per head")
flags.DEFINE_integer("runs", 2, "timed runs of each program after the compiling one")
flags.DEFINE_boolean("quick", False, "length 1024, block 64, one timed run")
flags.DEFINE_boolean("compile_only", False, "compile both programs and report their "
                     "per-device temporaries only (no runs, no comparison)")
flags.DEFINE_string("out_dir", str(Path(__file__).resolve().parent / "results"),
                    "where the JSON and Markdown go (--quick: its tmp/ folder)")


def zigzag_layout(n_shards: int, length: int) -> Any:
    """Llama 3's layout, for comparison: ``2n`` chunks, shard ``s`` holds ``s, 2n-1-s``."""
    import numpy as np
    chunks = np.arange(length).reshape(2 * n_shards, -1)
    return np.concatenate([np.concatenate([chunks[s], chunks[2 * n_shards - 1 - s]])
                           for s in range(n_shards)])


def balance(n_shards: int, length: int, block_size: int) -> dict[str, dict[str, float]]:
    """Per layout: worst-step max/mean work over shards, slowdown, total block pairs."""
    import numpy as np

    from revtrain.layers import sequence_layout
    from revtrain.layers.sequence_parallel import ring_block_counts
    layouts = {"striped": sequence_layout(n_shards, length),
               "contiguous": np.arange(length), "zigzag": zigzag_layout(n_shards, length)}
    out = {}
    for name, perm in layouts.items():
        counts = ring_block_counts(perm, n_shards, block_size)
        mean = counts.mean(axis=1)
        out[name] = {"worst_step_max_over_mean": float((counts.max(axis=1) / mean).max()),
                     "slowdown": float(counts.max(axis=1).sum() / mean.sum()),
                     "block_pairs": int(counts.sum())}
    return out


def _programs(n_shards: int, block_size: int):
    """The jitted ring and blockwise forward + backward programs."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from revtrain.layers.attention.blockwise import blockwise_attention
    from revtrain.layers.attention.ring import ring_attention

    def fwd_bwd(attention):
        def run(q, k, v, ct):
            out, vjp = jax.vjp(attention, q, k, v)
            return (out, *vjp(ct))
        return run

    split = P(None, "seq")
    mesh = Mesh(np.array(jax.devices()[:n_shards]), ("seq",))
    ring = jax.jit(jax.shard_map(
        fwd_bwd(lambda q, k, v: ring_attention(q, k, v, axis_name="seq",
                                               block_size=block_size)),
        mesh=mesh, in_specs=(split,) * 4, out_specs=(split,) * 4))
    one = jax.jit(fwd_bwd(lambda q, k, v: blockwise_attention(q, k, v,
                                                              block_size=block_size)))
    return ring, one


def _timed(program, args, runs: int | None) -> tuple[Any, dict[str, Any]]:
    """Compiles ``program`` for ``args`` and runs it ``1 + runs`` times (None: not at all)."""
    import jax
    start = time.perf_counter()
    compiled = program.lower(*args).compile()
    compile_s = time.perf_counter() - start
    stats = {"compile_s": compile_s, **_memory(compiled)}
    if runs is None:
        return None, stats
    times, result = [], None
    for _ in range(1 + runs):
        start = time.perf_counter()
        result = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return result, {**stats, "first_run_s": times[0],
                    "run_s": statistics.median(times[1:]) if runs else times[0]}


def _memory(compiled) -> dict[str, int | None]:
    """Per-device bytes of a compiled program: temporaries, and in all (arguments +
    outputs + temporaries - aliased), from XLA's ``memory_analysis``."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {"temp_bytes_per_device": None, "total_bytes_per_device": None}
    total = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
             + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
    return {"temp_bytes_per_device": int(analysis.temp_size_in_bytes),
            "total_bytes_per_device": int(total)}


def measure(length: int, n_shards: int, block_size: int, batch: int, heads: int,
            d_head: int, runs: int | None) -> dict[str, Any]:
    """Runs both programs and compares them (module docstring); ``runs=None`` compiles
    them only."""
    import jax
    import numpy as np

    from revtrain.layers import sequence_layout
    rng = np.random.default_rng(0)
    q, k, v, ct = (rng.standard_normal((batch, length, heads, d_head)).astype(np.float32)
                   for _ in range(4))
    perm = sequence_layout(n_shards, length)
    ring, one = _programs(n_shards, block_size)
    device0 = jax.devices()[0]
    ref, one_stats = _timed(one, [jax.device_put(a, device0) for a in (q, k, v, ct)], runs)
    got, ring_stats = _timed(ring, [a[:, perm] for a in (q, k, v, ct)], runs)
    result = {"ring": ring_stats, "blockwise_one_device": one_stats,
              "balance": balance(n_shards, length, block_size),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if runs is None:
        return result
    errors = {}
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        r = np.asarray(r)[:, perm]
        diff = float(np.abs(np.asarray(g) - r).max())
        errors[name] = {"max_abs_error": diff, "relative": diff / float(np.abs(r).max()),
                        "max_abs_ref": float(np.abs(r).max())}
    return {**result, "errors": errors,
            "max_abs_error": max(e["max_abs_error"] for e in errors.values())}


def _table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (`benchmarks.report` defines flags this script also has)."""
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join([":---"] + ["---:"] * (len(headers) - 1)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2 ** 20:,.1f}"


def markdown(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"Ring attention on {c['n_shards']} {c['platform']} devices vs one-device "
             f"blockwise: length {c['length']:,}, batch {c['batch']}, {c['heads']} heads x "
             f"{c['d_head']}, block {c['block_size']}, float32.", ""]
    if "errors" in result:
        rows = [[name, f"{e['max_abs_error']:.2e}", f"{e['relative']:.1e}"]
                for name, e in result["errors"].items()]
        lines += [_table(["tensor", "max abs error", "relative"], rows), ""]
    rows = [[name, f"{s['compile_s']:.1f}", f"{s['run_s']:.2f}" if "run_s" in s else "-",
             _mib(s["temp_bytes_per_device"]), _mib(s["total_bytes_per_device"])]
            for name, s in (("ring", result["ring"]),
                            ("blockwise, 1 device", result["blockwise_one_device"]))]
    lines += [_table(["program", "compile s", "fwd+bwd s", "temp MiB / device",
                      "all MiB / device"],
                             rows), ""]
    rows = [[name, f"{b['worst_step_max_over_mean']:.2f}", f"{b['slowdown']:.3f}",
             f"{b['block_pairs']:,}"] for name, b in result["balance"].items()]
    lines += [_table(["layout", "worst step max/mean", "slowdown", "block pairs"],
                             rows), "", f"Process peak RSS: {_mib(result['peak_rss_bytes'])} MiB."]
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    length, block, runs = FLAGS.length, FLAGS.block_size, FLAGS.runs
    out_dir = Path(FLAGS.out_dir)
    if FLAGS.quick:
        length, block, runs, out_dir = 1024, 64, 1, out_dir / "tmp"
    from revtrain.layers.sequence_parallel import check_layout
    check_layout(FLAGS.n_shards, length, "--n_shards/--length")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    jax.config.update("jax_num_cpu_devices", FLAGS.n_shards)
    jax.config.update("jax_platforms", "cpu")
    machine = provenance.machine_info(provenance.command_line(None))  # The start.
    result = measure(length, FLAGS.n_shards, block, FLAGS.batch, FLAGS.heads, FLAGS.d_head,
                     None if FLAGS.compile_only else runs)
    result["config"] = {"length": length, "n_shards": FLAGS.n_shards, "block_size": block,
                        "batch": FLAGS.batch, "heads": FLAGS.heads, "d_head": FLAGS.d_head,
                        "platform": jax.devices()[0].platform, "jax": jax.__version__,
                        "cpu_count": os.cpu_count()}
    result["machine"] = machine
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{NAME}_{length}_memory" if FLAGS.compile_only else NAME
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out_dir / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    app.run(main)
