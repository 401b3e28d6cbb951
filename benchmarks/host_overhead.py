"""Host time of one block-trainer step on a tiny, deep model: the Python-side cost.

On an accelerator a layer's kernels take milliseconds, so what the host does between
dispatches (argument handling, cache look-ups, transfers) decides whether the device waits.
This script times ``ReversibleSerialTrainer.one_step`` on a model so small that the device
work is negligible: a ``ReversibleTransformerLM`` with ``d_model=16`` and 16 layers (66 flat
layers). ``dispatch_s`` is the time until ``one_step`` returns (everything dispatched,
nothing awaited); ``step_s`` also waits for every update (``trainer.block_until_ready()``).
Medians over ``--steps`` steps after ``--warmup`` steps, and the programs dispatched per
step (``n_dispatches_per_step``: 5 with ``scan_layers``, the default, whatever the depth;
``6 * depth + 3`` with ``--noscan_layers``). Beside the wall times: the CPU
time of the calling thread during the dispatch (``dispatch_thread_cpu_s``, the host's own
work: a shared machine slows wall time far more than CPU time) and of the whole process
(XLA's threads included).

    python benchmarks/host_overhead.py --depth=16 --steps=50 --trainers=reversible

Only public API is used, so the same script measures an older checkout (put it first on
``PYTHONPATH``); the JSON records which ``revtrain`` it imported.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """Flags of the script run on its own (not at import: the tests import this module
    beside the other benchmarks, whose shared flags use the same names)."""
    flags.DEFINE_integer("depth", 16, "n_layers of the ReversibleTransformerLM", lower_bound=1)
    flags.DEFINE_integer("d_model", 16, "model width", lower_bound=2)
    flags.DEFINE_integer("steps", 50, "measured steps", lower_bound=1)
    flags.DEFINE_integer("warmup", 3, "steps before measuring (the first compiles)",
                         lower_bound=1)
    flags.DEFINE_list("trainers", ["reversible"], "block trainers to measure: reversible, "
                      "memory_efficient")
    flags.DEFINE_boolean("scan_layers", True, "ReversibleSerialTrainer scans runs of equal "
                         "layers (--noscan_layers: one program per layer)")
    flags.DEFINE_string("json_out", None, "also write the results here")


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
            trainer_kind: str, scan_layers: bool = True) -> dict:
    """Builds the trainer and returns median dispatch/step seconds and CPU seconds, and
    the programs dispatched per step (observers' ``on_dispatch`` calls).

    ``scan_layers=False`` is passed to `ReversibleSerialTrainer` only (the default is
    not passed at all, so an older checkout without the argument is measured too)."""
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
    scan = {"scan_layers": scan_layers} if trainer_kind == "reversible" else {}
    trainer = cls(blocks, loss, adam, n_devices=n_devices, **scan)
    counter = _DispatchCounter()
    trainer.observers.append(counter)
    for step in range(warmup):
        _wait(trainer, trainer.one_step(batch, jax.random.key(step)))
    counter.n = 0
    dispatch, cpu, thread, total = [], [], [], []
    for step in range(warmup, warmup + steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        thread_start = time.thread_time()
        out = trainer.one_step(batch, jax.random.key(step))
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
            "n_dispatches_per_step": counter.n / steps}


def main(argv: Sequence[str]) -> None:
    """Measures each trainer of ``--trainers``; prints JSON (and writes ``--json_out``)."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
    unknown = set(FLAGS.trainers) - {"reversible", "memory_efficient"}
    if unknown:
        raise app.UsageError(f"--trainers={','.join(FLAGS.trainers)}: {sorted(unknown)} are "
                             f"not block trainers; use reversible and/or memory_efficient")
    results = [measure(FLAGS.depth, FLAGS.d_model, FLAGS.steps, FLAGS.warmup, 1, kind,
                       FLAGS.scan_layers) for kind in FLAGS.trainers]
    text = json.dumps(results, indent=1)
    print(text)
    if FLAGS.json_out:
        Path(FLAGS.json_out).write_text(text + "\n")


if __name__ == "__main__":
    _define_flags()
    app.run(main, argv=sys.argv)
