"""Mesh invariance: the same global batch trains the same model on every named mesh.

For one global batch, model, rng and optimizer (plain SGD, dropout off, uneven batch
weights: one padded row, two all-padding rows), every trainer gives the losses, global
gradient norms and updated weights of one device on the meshes ``(data, fsdp, seq)``
of 4 CPU devices. `ReversibleSerialTrainer` runs on all six meshes; `Trainer` and
`MemoryEfficientTrainer` on the ones that exercise something else in them (their
per-device code is the same programs). The model is position-wise (its layers mix no
positions), so a ``seq`` split needs no ring attention; the Transformer case runs once
ring attention has replaced the stand-in `revtrain.layers.sequence_parallel`.
"""
import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from revtrain import layers as tl
from revtrain.layers import sequence_parallel
from revtrain.models import ReversibleTransformerLM
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
from revtrain.trainers.mesh import MESH_AXES
from tests.tree_utils import assert_trees_close

VOCAB, D, BATCH, LENGTH = 16, 32, 8, 8
MESHES = [(1, 1, 1), (4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (1, 2, 2)]
CASES = ([("ReversibleSerialTrainer", m) for m in MESHES]
         + [("Trainer", (2, 2, 1)), ("Trainer", (1, 2, 2)),
            ("MemoryEfficientTrainer", (1, 4, 1)), ("MemoryEfficientTrainer", (1, 2, 2))])
TRAINERS = {"Trainer": Trainer, "ReversibleSerialTrainer": ReversibleSerialTrainer,
            "MemoryEfficientTrainer": MemoryEfficientTrainer}


def _batch():
    rs = np.random.RandomState(0)
    tokens = rs.randint(0, VOCAB, (BATCH, LENGTH + 1)).astype(np.int32)
    weights = np.ones((BATCH, LENGTH), np.float32)
    weights[0, 3:] = 0
    weights[6:] = 0
    return tokens[:, :-1], tokens[:, 1:], weights


def _position_wise():
    """Embedding, one reversible half-residual, a dense head: no layer mixes positions.
    Its 32 x 32 and 64 x 16 kernels are sharded by fsdp=2 and 4, the 16 x 32 embedding
    is not (few leaves: each leaf shape compiles a copy program per mesh)."""
    blocks = [(tl.Serial(tl.Embedding(VOCAB, D), tl.Dup()),
               [tl.ReversibleHalfResidual(tl.Dense(D, use_bias=False), tl.Relu())])]
    return blocks, tl.Serial(tl.Concatenate(), tl.Dense(VOCAB, use_bias=False),
                             tl.LogSoftmax(), tl.CrossEntropyLoss())


def _transformer():
    model = ReversibleTransformerLM(
        vocab_size=VOCAB, d_model=D, d_ff=2 * D, n_layers=1, n_heads=2, max_len=LENGTH,
        dropout=0.0, attention_type=functools.partial(tl.CausalAttention,
                                                      implementation="blockwise",
                                                      block_size=2))
    return tl.extract_reversible_blocks([model, tl.CrossEntropyLoss()])


def _sgd():
    return optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)


def _two_steps(trainer_name, mesh_shape, make_model=_position_wise):
    blocks, loss = make_model()
    signature = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in _batch())
    tl.init_reversible_blocks(blocks, loss, signature, jax.random.key(0))
    if mesh_shape is None:
        placement = {"n_devices": 1}
    else:
        devices = np.array(jax.devices()[:int(np.prod(mesh_shape))])
        placement = {"mesh": Mesh(devices.reshape(mesh_shape), MESH_AXES)}
    if trainer_name == "Trainer":
        trainer = Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), _sgd, **placement)
    else:
        trainer = TRAINERS[trainer_name](blocks, loss, _sgd, **placement)
    losses, norms = [], []
    for step in range(2):
        loss_value, stats = trainer.one_step(_batch(), jax.random.key(step))
        losses.append(float(loss_value))
        norms.append(float(stats["gradients_l2"]))
    return losses, norms, trainer.weights


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


@pytest.mark.skipif(getattr(sequence_parallel, "STAND_IN", False),
                    reason="needs ring attention (revtrain.layers.sequence_parallel is the "
                           "stand-in)")
@pytest.mark.parametrize("mesh_shape", [(1, 1, 4), (1, 2, 2)])
def test_a_sequence_split_transformer_trains_what_one_device_trains(mesh_shape):
    reference = _two_steps("ReversibleSerialTrainer", None, _transformer)
    _assert_same(_two_steps("ReversibleSerialTrainer", mesh_shape, _transformer), reference)
