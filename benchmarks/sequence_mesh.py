"""``sequence_length.py --mesh``: the long-context model on named meshes of 4 devices.

Two measurements, every configuration in a fresh process with 4 forced host devices (on
CPU; a GPU/TPU machine's own devices otherwise), the model of ``sequence_length.py``
(its ``default`` variant: blockwise attention, feed-forward in chunks) trained by
``--trainer``:

* **Sequence parallelism.** Batch 1 at ``--mesh_length`` (default 65,536) on the mesh
  ``(data, fsdp, seq) = (1, 1, 1)`` (one device of the four) and ``(1, 1, 4)`` (ring
  attention over four), ``--warmup`` steps then one measured step: the per-device peak
  (`revtrain.memory.track_peak` on the mesh's first device) with ``seq = 4`` against
  ``seq = 1``. Target: <= 0.3x.
* **Hybrid sharding.** Batch 4 at ``--hybrid_length`` (default 1,024) on ``(2, 2, 1)``
  (weights and slots sharded over ``fsdp = 2``, replicated over ``data = 2``) and on
  ``(1, 4, 1)`` (``fsdp = 4``), interleaved over ``--mesh_rounds`` rounds so both see the
  same machine load: the weight + slot bytes on one device (``device_footprint``) against
  the whole model's (unsharded), target 0.5x for ``(2, 2, 1)``; and the median step time,
  target ``(2, 2, 1)`` no slower than ``(1, 4, 1)`` (the median over rounds of each
  round's median), with the process CPU time per step beside it (the work done, less
  sensitive to a shared machine's load than the wall clock).

Writes ``sequence_mesh.json`` and ``.md`` to ``--out_dir``; with ``--update``, the rows of
the measurements not in ``--mesh_runs`` are kept from the JSON already there (e.g.
``--mesh --mesh_runs=hybrid --update`` re-times the hybrid runs and keeps the 65,536-token
ones).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from absl import flags

from benchmarks import harness, report

NAME = "sequence_mesh"
N_DEVICES = 4
SEQUENCE_MESHES = ((1, 1, 1), (1, 1, 4))
HYBRID_MESHES = ((2, 2, 1), (1, 4, 1))

flags.DEFINE_boolean("mesh", False, "run the named-mesh measurements instead (see "
                     "benchmarks/sequence_mesh.py): seq=4 against seq=1 at --mesh_length, "
                     "(2,2,1) against (1,4,1) at --hybrid_length")
flags.DEFINE_integer("mesh_length", None, "sequence length of the seq=1/seq=4 runs "
                     "(default 65536; 256 with --quick)", lower_bound=4)
flags.DEFINE_integer("hybrid_length", None, "sequence length of the (2,2,1)/(1,4,1) runs "
                     "(default 1024; 64 with --quick)", lower_bound=1)
flags.DEFINE_integer("mesh_rounds", 5, "interleaved rounds of the hybrid runs",
                     lower_bound=1)
flags.DEFINE_list("mesh_runs", ["sequence", "hybrid"], "which of the --mesh measurements "
                  "to run: sequence, hybrid")
flags.register_validator("mesh_runs", lambda v: bool(v) and set(v) <= {"sequence", "hybrid"},
                         "--mesh_runs must be a subset of sequence,hybrid")


def _mesh(shape: Sequence[int]) -> dict[str, int]:
    return dict(zip(("data", "fsdp", "seq"), shape, strict=True))


def configurations(args: SimpleNamespace, base: dict[str, Any]) -> list[dict[str, Any]]:
    """The sequence runs, then the hybrid runs interleaved round by round."""
    quick, FLAGS = args.quick, flags.FLAGS
    length = FLAGS.mesh_length or (256 if quick else 65536)
    hybrid = FLAGS.hybrid_length or (64 if quick else 1024)
    base = base | {"variant": "default", "n_devices": N_DEVICES}
    configs = []
    if "sequence" in FLAGS.mesh_runs:
        configs += [base | {"kind": "sequence", "mesh": _mesh(m), "seq_len": length,
                            "batch_size": 1, "steps": 1} for m in SEQUENCE_MESHES]
    for k in range(FLAGS.mesh_rounds if "hybrid" in FLAGS.mesh_runs else 0):
        configs += [base | {"kind": "hybrid", "mesh": _mesh(m), "seq_len": hybrid,
                            "batch_size": N_DEVICES, "round": k} for m in HYBRID_MESHES]
    return configs


def footprint(trainer: Any) -> dict[str, int]:
    """Weight + slot bytes on the mesh's first device, and of the whole model."""
    import jax
    import numpy as np
    here = trainer.device_footprint()
    whole = sum(np.asarray(leaf).nbytes for part in ("weights", "slots")
                for leaf in jax.tree.leaves(trainer.host_values(part)))
    return {"device_values_bytes": here.weights_bytes + here.slots_bytes,
            "unsharded_values_bytes": int(whole)}


def label(r: dict[str, Any]) -> str:
    m = r["mesh"]
    return f"({m['data']},{m['fsdp']},{m['seq']})"


def _rows(results: Sequence[dict[str, Any]], kind: str, shape: Sequence[int]) -> list[dict]:
    return [r for r in results if r.get("kind") == kind and r["mesh"] == _mesh(shape)
            and "error" not in r]


def targets(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's mesh targets, for those ``results`` has rows for."""
    checks = []
    one, four = (_rows(results, "sequence", m) for m in SEQUENCE_MESHES)
    if one and four:
        ratio = four[0]["peak_bytes"] / one[0]["peak_bytes"]
        checks.append({"target": f"length {one[0]['seq_len']:,}: per-device peak with "
                                 f"seq=4 <= 0.3x seq=1's", "value": f"{ratio:.3f}x",
                       "met": ratio <= 0.3})
    hybrid, fsdp = (_rows(results, "hybrid", m) for m in HYBRID_MESHES)
    if hybrid:
        ratio = hybrid[0]["device_values_bytes"] / hybrid[0]["unsharded_values_bytes"]
        checks.append({"target": "(2,2,1): weights + slots per device = 0.5x unsharded",
                       "value": f"{ratio:.3f}x", "met": abs(ratio - 0.5) <= 0.05})
    if hybrid and fsdp:
        a, b = (statistics.median(r["step_s"] for r in rows) for rows in (hybrid, fsdp))
        value = f"{a:.3f} s vs {b:.3f} s ({a / b:.2f}x)"
        if all("step_cpu_s" in r for r in hybrid + fsdp):
            ca, cb = (statistics.median(r["step_cpu_s"] for r in rows)
                      for rows in (hybrid, fsdp))
            value += f"; process CPU {ca:.2f} s vs {cb:.2f} s ({ca / cb:.2f}x)"
        checks.append({"target": "(2,2,1) step time <= (1,4,1)'s (fsdp=4), interleaved",
                       "value": value, "met": a <= b})
    return checks


def markdown(payload: dict[str, Any]) -> str:
    """The results and targets as Markdown tables, after a settings header."""
    c, info = payload["config"], payload["machine"]
    return (f"Named meshes of {N_DEVICES} devices: {c['trainer']} trainer, d_model "
            f"{c['d_model']}, d_ff {c['d_ff']}, {c['n_layers']} layers, {c['n_heads']} "
            f"heads, vocab {c['vocab_size']}, blockwise attention (block {c['block_size']})"
            f" + ff chunks {c['ff_chunk_size']}, Adam, dropout {c['dropout']}.\n"
            f"Measured {info['date']} on {info['processor']} ({info['cpu_count']} CPUs), "
            f"jax {info['jax']}; each row a fresh process.\n\n" + tables(payload))


def tables(payload: dict[str, Any]) -> str:
    """The results table and the targets table (`benchmarks.render_tables` shows them)."""
    lines, rows = [], []
    for r in payload["results"]:
        if "error" in r:
            rows.append([r["kind"], label(r), f"{r['seq_len']:,}", "failed", "", "", "", ""])
            continue
        values = (f"{report.mib(r['device_values_bytes'])} / "
                  f"{report.mib(r['unsharded_values_bytes'])}")
        rows.append([r["kind"], label(r), f"{r['seq_len']:,}", r["batch_size"],
                     f"{report.mib(r['peak_bytes'])} ({r['method']})", values,
                     f"{r['step_s']:.3f}", r.get("round", 0) + 1])
    lines.append(report.markdown_table(
        ["run", "mesh (data,fsdp,seq)", "length", "batch", "peak per device MiB",
         "weights+slots per device / unsharded MiB", "step s", "round"], rows))
    checks = targets(payload["results"])
    if checks:
        lines += ["", report.targets_table(checks)]
    return "\n".join(lines) + "\n"


def run(args: SimpleNamespace, base: dict[str, Any], script: str) -> dict[str, Any]:
    """Runs every mesh configuration of ``script``'s worker; writes and returns the payload."""
    configs = configurations(args, base)
    results = []
    for k, config in enumerate(configs, 1):
        result = harness.run_worker(script, config, args.timeout)
        outcome = (f"ERROR {result['error']}" if "error" in result else
                   f"peak {report.mib(result['peak_bytes'])} MiB, step "
                   f"{result['step_s']:.3f} s")
        print(f"[{k}/{len(configs)}] {config['kind']} {label(config)}, length "
              f"{config['seq_len']:,}: {outcome}", flush=True)
        results.append(result)
    path = args.out_dir / f"{NAME}.json"
    if flags.FLAGS.update and path.exists():  # Keep the rows of the measurements not rerun.
        previous = report.read_json(path)
        when = {"measured": previous["machine"]["date"],
                "processor": previous["machine"]["processor"]}
        kept = [when | r for r in previous["results"]
                if r.get("kind") not in flags.FLAGS.mesh_runs]
        results = kept + results
    payload = {"benchmark": NAME, "machine": harness.machine_info(args.command),
               "config": configs[0], "results": results}
    report.write_json(path, payload)
    (args.out_dir / f"{NAME}.md").write_text(markdown(payload))
    print(markdown(payload))
    return payload
