"""Host time of one block-trainer step on a tiny, deep model: the Python-side cost.

On an accelerator a layer's kernels take milliseconds, so what the host does between
dispatches (argument handling, cache look-ups, transfers) decides whether the device waits.
This script times ``one_step`` of the block trainers on a model so small that the device
work is negligible: a ``ReversibleTransformerLM`` with ``d_model=16`` (66 flat layers at
depth 16, 130 at depth 32). ``dispatch_s`` is the time until ``one_step`` returns
(everything dispatched, nothing awaited; the step's key is made before the clock starts);
``step_s`` also waits for every update (``trainer.block_until_ready()``). Medians over
``--steps`` steps after ``--warmup`` steps, and the programs dispatched per step
(``n_dispatches_per_step``). Beside the wall times: the CPU time of the calling thread
during the dispatch (``dispatch_thread_cpu_s``, the host's own work: a shared machine
slows wall time far more than CPU time) and of the whole process (XLA's threads included).

The variants (`VARIANTS`): ``reversible`` (`ReversibleSerialTrainer`, runs scanned, the
default), ``reversible_per_layer`` (``scan_layers=False``), ``memory_efficient``
(`MemoryEfficientTrainer`, one program per layer, the default) and
``memory_efficient_window<W>`` (``scan_window=W``). Each variant and depth runs in a
fresh Python process as a plain script would: no allocator tuning (glibc's defaults
unless ``MALLOC_*`` is set), nothing inherited from another configuration.

    python benchmarks/host_overhead.py                    # every variant, depths 16 and 32
    python benchmarks/host_overhead.py --depths=16 --variants=reversible --steps=20

Writes ``host_overhead.json`` and ``.md`` (with the targets) to ``--out_dir``;
``--render_only`` rewrites the Markdown from the JSON. Only public API is used, so the
same script measures an older checkout (put it first on ``PYTHONPATH``); the JSON records
which ``revtrain`` it imported.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # Run as a script: make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

from benchmarks import harness, report  # noqa: E402
from benchmarks.provenance import command_line, machine_info  # noqa: E402

FLAGS = flags.FLAGS
NAME = "host_overhead"
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "reversible": ("reversible", {}),
    "reversible_per_layer": ("reversible", {"scan_layers": False}),
    "memory_efficient": ("memory_efficient", {}),
    "memory_efficient_window2": ("memory_efficient", {"scan_window": 2}),
    "memory_efficient_window4": ("memory_efficient", {"scan_window": 4}),
}
"""Variant name -> (trainer kind, its constructor's arguments beyond the defaults)."""
LABELS = {"reversible": "ReversibleSerialTrainer",
          "reversible_per_layer": "ReversibleSerialTrainer, scan_layers=False",
          "memory_efficient": "MemoryEfficientTrainer",
          "memory_efficient_window2": "MemoryEfficientTrainer, scan_window=2",
          "memory_efficient_window4": "MemoryEfficientTrainer, scan_window=4"}
DEFAULTS = {"depths": ["16", "32"], "d_model": 16, "steps": 50, "warmup": 3}
"""This script's defaults for the shared benchmark flags it reads."""
USED_FLAGS = {"depths", "d_model", "steps", "warmup", "out_dir", "render_only", "variants"}
DISPATCH_LIMIT_S = 3e-3
PROGRAMS_LIMIT = 8



def _define_flags() -> None:
    """The flag only this script has, defined when it runs (another benchmark that the
    tests import beside it has a ``--variants`` of its own)."""
    flags.DEFINE_list("variants", list(VARIANTS), f"any of {', '.join(VARIANTS)}. The script "
                      f"also reads the shared benchmark flags --depths (here default "
                      f"{','.join(DEFAULTS['depths'])}), --d_model ({DEFAULTS['d_model']}), "
                      f"--steps ({DEFAULTS['steps']}), --warmup ({DEFAULTS['warmup']}), "
                      f"--out_dir and --render_only (--helpfull describes them)")


def _wait(trainer, out) -> None:
    """Waits for every layer's update; an older checkout without
    ``block_until_ready`` waits for the step's loss and stats."""
    import jax
    if hasattr(trainer, "block_until_ready"):
        trainer.block_until_ready()
    else:
        jax.block_until_ready(out)


class _DispatchCounter:
    """A trainer observer counting the programs dispatched."""

    def __init__(self):
        self.n = 0

    def on_dispatch(self, label, fn, args) -> None:
        del label, fn, args
        self.n += 1


def measure(depth: int, d_model: int, steps: int, warmup: int, n_devices: int,
            trainer_kind: str, **options: Any) -> dict:
    """Builds the trainer and returns median dispatch/step seconds and CPU seconds, and
    the programs dispatched per step (observers' ``on_dispatch`` calls).

    ``options`` go to the trainer's constructor (a `VARIANTS` entry's; none for the
    defaults, so an older checkout without those arguments is measured too)."""
    import jax
    import numpy as np
    import optax

    import revtrain
    from revtrain import layers as tl
    from revtrain.models import ReversibleTransformerLM
    from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer

    model = ReversibleTransformerLM(vocab_size=32, d_model=d_model, d_ff=2 * d_model,
                                    n_layers=depth, n_heads=2, max_len=16, dropout=0.1)
    rs = np.random.RandomState(0)
    tokens = rs.randint(0, 32, (4 * n_devices, 17)).astype(np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:], np.ones((4 * n_devices, 16), np.float32))
    blocks, loss = tl.extract_reversible_blocks([model, tl.CrossEntropyLoss()])
    tl.init_reversible_blocks(blocks, loss, batch, jax.random.key(0))
    adam = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    cls = ReversibleSerialTrainer if trainer_kind == "reversible" else MemoryEfficientTrainer
    trainer = cls(blocks, loss, adam, n_devices=n_devices, **options)
    counter = _DispatchCounter()
    trainer.observers.append(counter)
    for step in range(warmup):
        _wait(trainer, trainer.one_step(batch, jax.random.key(step)))
    counter.n = 0
    dispatch, cpu, thread, total = [], [], [], []
    for step in range(warmup, warmup + steps):
        key = jax.random.key(step)
        start, cpu_start = time.perf_counter(), time.process_time()
        thread_start = time.thread_time()
        out = trainer.one_step(batch, key)
        dispatch.append(time.perf_counter() - start)
        thread.append(time.thread_time() - thread_start)
        cpu.append(time.process_time() - cpu_start)
        _wait(trainer, out)
        total.append(time.perf_counter() - start)
    return {"revtrain": revtrain.__file__, "trainer": trainer_kind, "depth": depth,
            "d_model": d_model, "n_flat_layers": len(trainer.layers), "steps": steps,
            "n_devices": n_devices, "median_dispatch_s": statistics.median(dispatch),
            "median_dispatch_cpu_s": statistics.median(cpu),
            "median_dispatch_thread_cpu_s": statistics.median(thread),
            "median_step_s": statistics.median(total),
            "scan_layers": getattr(trainer, "scan_layers", False),
            "scan_window": getattr(trainer, "scan_window", None),
            "n_dispatches_per_step": counter.n / steps}


def targets(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`ReversibleSerialTrainer`'s (runs scanned) dispatch targets at each measured depth:
    programs per step <= `PROGRAMS_LIMIT` and the same at every depth, host dispatch time
    <= `DISPATCH_LIMIT_S` (flat in depth)."""
    rows = sorted((r for r in results if r["variant"] == "reversible"),
                  key=lambda r: r["depth"])
    checks = []
    if rows:
        counts = [r["n_dispatches_per_step"] for r in rows]
        depths = "/".join(str(r["depth"]) for r in rows)
        checks.append({"target": f"ReversibleSerialTrainer programs per step at depth "
                                 f"{depths} <= {PROGRAMS_LIMIT}, the same at every depth",
                       "value": " / ".join(f"{c:g}" for c in counts),
                       "met": max(counts) <= PROGRAMS_LIMIT and len(set(counts)) == 1})
    for r in rows:
        checks.append({"target": f"ReversibleSerialTrainer host dispatch time per step at "
                                 f"depth {r['depth']} <= {DISPATCH_LIMIT_S * 1e3:g} ms",
                       "value": f"{r['median_dispatch_s'] * 1e3:.1f} ms (thread CPU "
                                f"{r['median_dispatch_thread_cpu_s'] * 1e3:.1f} ms)",
                       "met": r["median_dispatch_s"] <= DISPATCH_LIMIT_S})
    return checks


def table(payload: dict[str, Any]) -> str:
    """The results as a Markdown table (variants in `VARIANTS` order, then depth)."""
    order = list(VARIANTS)
    rows = [[LABELS.get(r["variant"], r["variant"]), r["depth"], r["n_flat_layers"],
             f"{r['n_dispatches_per_step']:g}", f"{r['median_dispatch_s'] * 1e3:.1f}",
             f"{r['median_dispatch_thread_cpu_s'] * 1e3:.1f}",
             f"{r['median_step_s'] * 1e3:.1f}"]
            for r in sorted(payload["results"],
                            key=lambda r: (order.index(r["variant"]) if r["variant"] in order
                                           else len(order), r["depth"]))]
    return report.markdown_table(
        ["trainer", "depth", "flat layers", "programs/step", "dispatch (ms)",
         "of which thread CPU (ms)", "step (ms)"], rows)


def markdown(payload: dict[str, Any]) -> str:
    c, m = payload["config"], payload["machine"]
    return (f"Host time of one step: ReversibleTransformerLM d_model {c['d_model']}, d_ff "
            f"{2 * c['d_model']}, 2 heads, seq 16, batch 4, dropout 0.1, Adam, one device; "
            f"median of {c['steps']} steps after {c['warmup']}; {m['processor']}, "
            f"{m['cpu_count']} cores, {m['date'][:10]}.\n\n{table(payload)}\n\n"
            f"{report.targets_table(payload['targets'])}\n")


def _in_fresh_process(variant: str, depth: int, d_model: int, steps: int,
                      warmup: int) -> dict[str, Any]:
    """`measure` of one variant and depth in a new Python process (this script with
    `harness.WORKER_FLAG`), so no configuration inherits another's compiled programs,
    live objects or heap; the environment (``MALLOC_*`` included) is this process's.

    Raises:
      RuntimeError: when the worker fails, with the end of its output.
    """
    config = {"variant": variant, "depth": depth, "d_model": d_model, "steps": steps,
              "warmup": warmup}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()),
                           harness.WORKER_FLAG, json.dumps(config)],
                          capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines()
             if line.startswith(harness.RESULT_MARKER)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} at depth {depth} failed (exit {done.returncode}): "
                           f"{done.stderr[-2000:]}")
    return json.loads(lines[-1][len(harness.RESULT_MARKER):])


def _worker(config_json: str) -> None:
    config = json.loads(config_json)
    kind, options = VARIANTS[config["variant"]]
    result = measure(config["depth"], config["d_model"], config["steps"], config["warmup"],
                     1, kind, **options)
    print(harness.RESULT_MARKER + json.dumps(result), flush=True)


def main(argv: Sequence[str]) -> None:
    """Measures each variant at each depth; writes JSON and Markdown to ``--out_dir``.

    Reads the shared benchmark flags in `USED_FLAGS` (``--depths``, ``--d_model``,
    ``--steps``, ``--warmup``, ``--out_dir``, ``--render_only``; `DEFAULTS` where unset)
    and ``--variants``; any other benchmark flag is a usage error, not ignored."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
    ignored = sorted(f.name for f in FLAGS.get_flags_for_module(harness)
                     if f.present and f.name not in USED_FLAGS)
    if ignored:
        raise app.UsageError(f"host_overhead.py does not take --{', --'.join(ignored)}; it "
                             f"takes --{', --'.join(sorted(USED_FLAGS))}")
    unknown = sorted(set(FLAGS.variants) - set(VARIANTS))
    if unknown or not FLAGS.variants or len(set(FLAGS.variants)) < len(FLAGS.variants):
        raise app.UsageError(f"--variants={','.join(FLAGS.variants)} must name each "
                             f"variant at most once, at least one, from "
                             f"{','.join(VARIANTS)}")
    depths = [int(d) for d in FLAGS.depths or DEFAULTS["depths"]]
    d_model, steps, warmup = (FLAGS[name].value or DEFAULTS[name]
                              for name in ("d_model", "steps", "warmup"))
    out = Path(FLAGS.out_dir or harness.RESULTS_DIR)
    if FLAGS.render_only:
        payload = report.read_json(out / f"{NAME}.json")
    else:
        payload = {"benchmark": NAME, "machine": machine_info(command_line(None)),
                   "config": {"d_model": d_model, "steps": steps, "warmup": warmup,
                              "malloc_env": sorted(k for k in os.environ
                                                   if k.startswith("MALLOC_"))},
                   "results": []}
        for depth in depths:
            for variant in FLAGS.variants:
                result = _in_fresh_process(variant, depth, d_model, steps, warmup)
                payload["results"].append({"variant": variant, **result})
                print(f"{LABELS[variant]}, depth {depth}: "
                      f"{result['median_dispatch_s'] * 1e3:.1f} ms dispatch, "
                      f"{result['n_dispatches_per_step']:g} programs/step", flush=True)
    payload["targets"] = targets(payload["results"])
    report.write_json(out / f"{NAME}.json", payload)
    (out / f"{NAME}.md").write_text(markdown(payload))
    print(markdown(payload))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == harness.WORKER_FLAG:
        _worker(sys.argv[2])
    else:
        _define_flags()
        app.run(main, argv=sys.argv)
