"""Mesh invariance: the same global batch trains the same model on every named mesh.

For one global batch, model, rng and optimizer (plain SGD, dropout off, uneven batch
weights: one padded row, two all-padding rows), every trainer gives the losses, global
gradient norms and updated weights of one device on the meshes ``(data, fsdp, seq)``
of 4 CPU devices: all three trainers on all six meshes. The model is position-wise (its
layers mix no positions), so a ``seq`` split needs no ring attention; the Transformer case adds ring
attention and scanned layers on ``(1, 2, 2)``.
"""
import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from revtrain.layers import sequence_parallel
from revtrain.parallel.mesh import MESH_AXES
from tests.mesh_models import LENGTH, build, global_batch, position_wise, transformer, two_steps
from tests.tree_utils import assert_trees_close

pytestmark = pytest.mark.slow

MESHES = [(1, 1, 1), (4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (1, 2, 2)]
CASES = [(t, m) for t in ("Trainer", "ReversibleSerialTrainer", "MemoryEfficientTrainer")
         for m in MESHES]


def _two_steps(trainer_name, mesh_shape, make_model=position_wise, **options):
    if mesh_shape is None:
        placement = {"n_devices": 1}
    else:
        devices = np.array(jax.devices()[:int(np.prod(mesh_shape))])
        placement = {"mesh": Mesh(devices.reshape(mesh_shape), MESH_AXES)}
    return two_steps(build(trainer_name, make_model, **placement, **options), global_batch())


@pytest.fixture(scope="module")
def one_device():
    """`Trainer` on one device without a named mesh: today's reference."""
    return _two_steps("Trainer", None)


def _assert_same(result, reference):
    np.testing.assert_allclose(result[0], reference[0], rtol=1e-5)
    np.testing.assert_allclose(result[1], reference[1], rtol=1e-5)
    assert_trees_close(result[2], reference[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trainer_name,mesh_shape", CASES,
                         ids=[f"{t}-{'x'.join(map(str, m))}" for t, m in CASES])
def test_every_mesh_trains_what_one_device_trains(one_device, trainer_name, mesh_shape,
                                                   monkeypatch):
    entered, sharded = [], sequence_parallel.sequence_sharded

    def recording(*args):
        entered.append(args)
        return sharded(*args)

    monkeypatch.setattr(sequence_parallel, "sequence_sharded", recording)
    assert one_device[0][1] < one_device[0][0]
    _assert_same(_two_steps(trainer_name, mesh_shape), one_device)
    # Layers are traced inside the sequence context exactly when the length is split.
    assert set(entered) == ({("seq", mesh_shape[2], LENGTH)} if mesh_shape[2] > 1 else set())


def test_a_sequence_split_transformer_trains_what_one_device_trains():
    """Ring attention over seq = 2, the weights sharded over fsdp = 2, the two equal
    layers scanned (one forward and one reverse program for both; for
    `MemoryEfficientTrainer` one window of both, put on the devices from host memory)."""
    reference = _two_steps("Trainer", None, transformer)
    _assert_same(_two_steps("ReversibleSerialTrainer", (1, 2, 2), transformer,
                            scan_layers=True), reference)
    _assert_same(_two_steps("MemoryEfficientTrainer", (1, 2, 2), transformer,
                            scan_window=2), reference)


def test_position_chunks_under_a_sequence_split_train_what_one_device_trains():
    """The half-residuals' reverse over chunks of 3 local positions (not dividing them)
    around ring attention, with FSDP: the one-device Trainer's steps (which differentiates
    the whole model, no reverse)."""
    model = functools.partial(transformer, ff_chunk_size=3)
    reference = _two_steps("Trainer", None, model)
    _assert_same(_two_steps("ReversibleSerialTrainer", (1, 2, 2), model, scan_layers=True),
                 reference)
