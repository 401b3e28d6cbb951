"""Mesh soak: every mesh of the invariance suite, beside processes that saturate the CPU.

Usage (from the repository root)::

    python benchmarks/mesh_soak.py              # 20 steps per mesh and trainer, minutes
    python benchmarks/mesh_soak.py --steps 2 --d_model 16 --seq_len 16 --vocab_size 32

On 4 forced CPU devices it trains the 2-layer `revtrain.models.ReversibleTransformerLM`
(default attention: ring attention on a ``seq`` mesh; FSDP-sharded weights on an ``fsdp``
mesh; SGD) with `Trainer` and `ReversibleSerialTrainer` (``--trainers``) for ``--steps``
steps on each mesh ``(data, fsdp, seq)`` of ``tests/trainers/test_mesh_invariance.py``:
(1, 1, 1), (4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1) and (1, 2, 2). Meanwhile
``--neighbours`` busy processes (default: one per core) keep every core loaded; they stop
when the soak ends, or after ``--max_seconds`` at the latest.

This is issue 40's reproduction, made a check: before `revtrain.parallel.cpu_collectives`
the (1, 2, 2) run deadlocked in its first step on a loaded 2-core machine and XLA
aborted the process. It asserts no time: it passes when every run finishes, every loss
is finite and the final losses of all meshes and trainers agree (``--rtol``: the same
global batch trains the same model on every mesh), and exits 1 with one line otherwise.
Prints one line per run and, with ``--out``, writes them as JSON.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # Run as a script: make the repository importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

MESHES = [(1, 1, 1), (4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (1, 2, 2)]
TRAINERS = ("Trainer", "ReversibleSerialTrainer", "MemoryEfficientTrainer")

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defines the script's flags; called when it runs, so that importing the module beside
    the other benchmarks (whose harness defines ``--steps``, ``--d_model``...) defines
    none."""
    flags.DEFINE_integer("steps", 20, "steps per mesh and trainer")
    flags.DEFINE_integer("d_model", 64, "model width")
    flags.DEFINE_integer("seq_len", 256, "sequence length (a multiple of 4)")
    flags.DEFINE_integer("batch_size", 8, "global batch (a multiple of 4)")
    flags.DEFINE_integer("vocab_size", 256, "vocabulary size")
    flags.DEFINE_list("meshes", ["x".join(map(str, m)) for m in MESHES],
                      "meshes as data x fsdp x seq, e.g. 1x2x2")
    flags.DEFINE_list("trainers", ["Trainer", "ReversibleSerialTrainer"],
                      f"trainers to run, of {', '.join(TRAINERS)}")
    flags.DEFINE_integer("neighbours", os.cpu_count() or 1, "busy processes beside the run")
    flags.DEFINE_float("max_seconds", 1800, "the neighbours stop after this long at the latest")
    flags.DEFINE_float("rtol", 1e-3, "tolerance of the final losses' agreement")
    flags.DEFINE_string("out", None, "write the runs to this JSON file")
    flags.DEFINE_string("worker", None, "internal: run one soak in this process (JSON config)")


def _model(config: dict):
    import jax

    from revtrain import layers as tl
    from revtrain.models import ReversibleTransformerLM

    model = ReversibleTransformerLM(
        vocab_size=config["vocab_size"], d_model=config["d_model"],
        d_ff=2 * config["d_model"], n_layers=2, n_heads=2, max_len=config["seq_len"],
        dropout=0.0)
    blocks, loss = tl.extract_reversible_blocks([model, tl.CrossEntropyLoss()])
    batch = _batch(config)
    signature = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in batch)
    tl.init_reversible_blocks(blocks, loss, signature, jax.random.key(0))
    return blocks, loss, batch


def _batch(config: dict):
    import numpy as np

    rs = np.random.RandomState(0)
    tokens = rs.randint(0, config["vocab_size"],
                        (config["batch_size"], config["seq_len"] + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:], np.ones(tokens[:, 1:].shape, np.float32)


def _trainer(name: str, blocks, loss, mesh):
    import optax

    from revtrain import layers as tl
    from revtrain import trainers

    def sgd():
        return optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)

    if name == "Trainer":
        return trainers.Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), sgd, mesh=mesh)
    return getattr(trainers, name)(blocks, loss, sgd, mesh=mesh)


def worker(config: dict) -> None:
    """Runs every mesh and trainer of ``config`` in this process (4 CPU devices), printing
    one JSON line per run."""
    import jax

    import revtrain  # noqa: F401  (before the first mesh: it sizes XLA's CPU client)

    for shape in config["meshes"]:
        mesh = jax.make_mesh(tuple(shape), ("data", "fsdp", "seq"),
                             devices=jax.devices()[:math.prod(shape)])
        for name in config["trainers"]:
            blocks, loss, batch = _model(config)
            trainer = _trainer(name, blocks, loss, mesh)
            start, losses = time.perf_counter(), []
            for step in range(config["steps"]):
                losses.append(float(trainer.one_step(batch, jax.random.key(step))[0]))
            print(json.dumps({"mesh": shape, "trainer": name, "losses": losses,
                              "seconds": round(time.perf_counter() - start, 1)}), flush=True)


def _neighbours(n: int, seconds: float) -> list[subprocess.Popen]:
    busy = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass"
    return [subprocess.Popen([sys.executable, "-c", busy]) for _ in range(n)]


def _check(runs: list[dict], expected: int, rtol: float) -> str | None:
    if len(runs) < expected:
        return f"{len(runs)} of {expected} runs finished"
    bad = [r for r in runs if not all(math.isfinite(x) for x in r["losses"])]
    if bad:
        return f"a non-finite loss on mesh {bad[0]['mesh']} with {bad[0]['trainer']}"
    finals = [r["losses"][-1] for r in runs]
    spread = max(finals) - min(finals)
    if spread > rtol * abs(finals[0]):
        return (f"the final losses differ by {spread:.3g} across meshes and trainers "
                f"(more than rtol={rtol} of {finals[0]:.6g})")
    return None


def _last_error(stderr: str) -> str:
    """The line of a failed worker's stderr that says why (not a stack frame)."""
    lines = [line.strip() for line in stderr.splitlines()
             if line.strip() and not line.lstrip().startswith(("@", "File ", "^"))]
    said = [line for line in lines if "Termination timeout" in line or "Error" in line]
    return ((said or lines or ["(no output)"])[-1])[:300]


def main(argv: list[str]) -> int:
    del argv
    if FLAGS.worker:
        worker(json.loads(FLAGS.worker))
        return 0
    unknown = set(FLAGS.trainers) - set(TRAINERS)
    if unknown:
        raise app.UsageError(f"--trainers: {sorted(unknown)} not among {TRAINERS}")
    config = {"steps": FLAGS.steps, "d_model": FLAGS.d_model, "seq_len": FLAGS.seq_len,
              "batch_size": FLAGS.batch_size, "vocab_size": FLAGS.vocab_size,
              "trainers": FLAGS.trainers,
              "meshes": [[int(n) for n in m.split("x")] for m in FLAGS.meshes]}
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                          + " --xla_force_host_platform_device_count=4").strip())
    neighbours = _neighbours(FLAGS.neighbours, FLAGS.max_seconds)
    start = time.perf_counter()
    try:
        run = subprocess.run([sys.executable, __file__, "--worker", json.dumps(config)],
                             env=env, capture_output=True, text=True)
    finally:
        for process in neighbours:
            process.kill()
            process.wait()
    runs = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    for r in runs:
        print(f"mesh {'x'.join(map(str, r['mesh']))} {r['trainer']:<24} "
              f"{len(r['losses'])} steps, loss {r['losses'][0]:.6f} -> "
              f"{r['losses'][-1]:.6f} ({r['seconds']} s)")
    print(f"{len(runs)} runs beside {FLAGS.neighbours} busy processes in "
          f"{time.perf_counter() - start:.0f} s")
    if FLAGS.out:
        Path(FLAGS.out).write_text(json.dumps(runs, indent=1) + "\n")
    problem = (_check(runs, len(config["meshes"]) * len(config["trainers"]), FLAGS.rtol)
               if run.returncode == 0 else
               f"the soak process ended with status {run.returncode}: {_last_error(run.stderr)}")
    if problem:
        print(f"mesh_soak: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(lambda argv: sys.exit(main(argv)))
