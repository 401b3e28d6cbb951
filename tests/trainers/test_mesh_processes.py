"""Hybrid sharding over processes: (data = 2 processes) x (fsdp = 2 devices each) on CPU.

Two local processes (jax.distributed, gloo collectives; the harness of
``tests/training/test_multihost.py``) run `tests.trainers.mesh_processes`. Checked here:
each of the three trainers trains what one device trains on the same global batch; in
every compiled program each weight all-gather and gradient reduce-scatter runs within one
process (its replica groups, read from the HLO), while the gradient all-reduce crosses
them; and the checkpoint the two processes saved restores on one device.
"""
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from revtrain.trainers.common.protocols import TrainState
from revtrain.training import Checkpointer
from revtrain.training.checkpoints.trees import restore_targets
from tests import mesh_models
from tests.trainers import mesh_processes
from tests.training.test_multihost import _run_groups
from tests.tree_utils import assert_trees_close

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``(output directory, result.json)`` of the two processes."""
    out = str(tmp_path_factory.mktemp("mesh_processes"))
    # The suite's compilation cache (tests/conftest.py): a program the observer compiled
    # to read its HLO is not compiled again when the trainer runs it.
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
               JAX_NUM_CPU_DEVICES="2", PYTHONPATH=ROOT,
               JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")

    def start(port):
        return [subprocess.Popen([sys.executable, "-m", "tests.trainers.mesh_processes",
                                  f"localhost:{port}", str(i), out], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i in range(2)]

    done = _run_groups({"2x2": start})["2x2"]
    for code, _, stderr in done:
        assert code == 0, stderr[-3000:]
    with open(os.path.join(out, "result.json")) as f:
        return out, json.load(f)


@pytest.fixture(scope="module")
def one_device():
    trainer = mesh_models.build("Trainer", n_devices=1)
    return mesh_models.two_steps(trainer, mesh_models.global_batch())


@pytest.mark.parametrize("trainer_name", mesh_processes.TRAINERS)
def test_two_processes_train_what_one_device_trains(run, one_device, trainer_name):
    result = run[1][trainer_name]
    np.testing.assert_allclose(result["losses"], one_device[0], rtol=1e-5)
    np.testing.assert_allclose(result["norms"], one_device[1], rtol=1e-5)
    for got, want in zip(result["weights"], jax.tree.leaves(one_device[2]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_two_processes_train_what_one_device_trains_in_scan_windows(run):
    result = run[1][mesh_processes.WINDOWS]
    assert any(name.startswith("backward/") and re.search(r"x\d+x\d+#", name)
               for name in result["programs"])
    want = mesh_models.two_steps(mesh_models.build("Trainer", mesh_models.transformer,
                                                   n_devices=1), mesh_models.global_batch())
    np.testing.assert_allclose(result["losses"], want[0], rtol=1e-5)
    np.testing.assert_allclose(result["norms"], want[1], rtol=1e-5)
    for got, expected in zip(result["weights"], jax.tree.leaves(want[2]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("trainer_name", mesh_processes.TRAINERS)
def test_weight_collectives_stay_inside_a_process(run, trainer_name):
    collectives = run[1][trainer_name]["collectives"]
    for op in ("all-gather", "reduce-scatter"):
        assert collectives[op], f"no {op} in {trainer_name}'s programs"
        for groups in collectives[op]:
            assert all(len(processes) == 1 for processes in groups), (op, groups)
    # The gradient shards are summed over data, i.e. across the processes.
    assert any(len(processes) == 2 for groups in collectives["all-reduce"]
               for processes in groups)


def test_the_two_process_checkpoint_restores_on_one_device(run, one_device):
    target = mesh_models.build("ReversibleSerialTrainer", n_devices=1)
    parts = TrainState._fields
    template = {part: restore_targets(target.saved_values(part), target.value_shardings(part))
                for part in parts}
    checkpointer = Checkpointer(os.path.join(run[0], "checkpoint"))
    tree = checkpointer.restore(template)
    checkpointer.close()
    target.restore(TrainState(*(tree[part] for part in parts)))
    assert_trees_close(target.weights, one_device[2], rtol=1e-5, atol=1e-5)
