"""Writes the run directories that `tests/training/checkpoints/test_format.py` restores.

Run from the repository root (it replaces ``tests/training/data/saved_runs/``):

    PYTHONPATH=$PWD python tests/training/data/make_checkpoints.py

For each trainer it trains the tiny reversible LM of `tests.training.tiny_models` on the
copy task for ``STEPS`` steps through `build_loop` (the path ``revtrain-train`` takes), on
4 CPU devices as the test suite runs, and keeps of the run directory what a resume reads:
``checkpoints/`` (orbax's step directories and ``retention.json``). Beside it,
``expected.npz`` holds the checkpoint's values after the run (``weights``, ``state``,
``slots`` flattened as the checkpoint is, plus ``step``) and ``expected_next.npz`` the
weights after one more step from the restored checkpoint (for the resume check).
"""
import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from revtrain import trainers  # noqa: E402
from revtrain.data import CopyTask  # noqa: E402
from revtrain.training import (  # noqa: E402
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    RunConfig,
    build_loop,
    flatten_tree,
)

if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
from tests.training.tiny_models import tiny_reversible_lm  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = os.path.join(HERE, "saved_runs")
STEPS = 2
TRAINERS = {"trainer": trainers.Trainer,
            "reversible_serial_trainer": trainers.ReversibleSerialTrainer}


def run_config(trainer_class) -> RunConfig:
    return RunConfig(model=tiny_reversible_lm,
                     inputs=CopyTask(vocab_size=16, length=4, batch_size=4, seed=1),
                     trainer_class=trainer_class, schedule=3e-3)


def build(trainer_class, output_dir):
    return build_loop(run_config(trainer_class), EvalConfig(steps=0),
                      CheckpointConfig(every=STEPS), LogConfig(progress=False), output_dir)


def host_values(loop) -> dict[str, np.ndarray]:
    """The checkpointed parts as flat host arrays (the checkpoint's own paths)."""
    tree = {part: loop.trainer.host_values(part) for part in ("weights", "state", "slots")}
    flat = {key: np.asarray(value) for key, value in flatten_tree(tree).items()}
    return {**flat, "step": np.asarray(loop.step, np.int64)}


def main() -> None:
    jax.config.update("jax_num_cpu_devices", 4)  # As tests/conftest.py.
    shutil.rmtree(RUNS, ignore_errors=True)
    for name, trainer_class in TRAINERS.items():
        out = os.path.join(RUNS, name)
        with build(trainer_class, out) as loop:
            loop.run(STEPS)
            np.savez(os.path.join(out, "expected.npz"), **host_values(loop))
        with build(trainer_class, out) as resumed:  # A resume's step after the restore.
            resumed.run(STEPS + 1)
            weights = {k: v for k, v in host_values(resumed).items()
                       if k.startswith("weights")}
            np.savez(os.path.join(out, "expected_next.npz"), **weights)
        for keep in os.listdir(out):  # Only what a resume reads, and the expectations.
            if keep not in ("checkpoints", "expected.npz", "expected_next.npz"):
                path = os.path.join(out, keep)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        shutil.rmtree(os.path.join(out, "checkpoints", str(STEPS + 1)))


if __name__ == "__main__":
    main()
