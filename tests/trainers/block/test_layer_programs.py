"""Tests for revtrain.trainers.block.layer_programs (sharing compiled programs) and
revtrain.trainers.common.global_loss (the loss share)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain.layers import Layer
from revtrain.trainers import ReversibleSerialTrainer, Trainer
from tests.trainers.conftest import VOCAB, signature
from tests.tree_utils import assert_trees_close

D = 8


def Scale(s):  # noqa: N802 -- a layer factory, named like the layer it builds.
    """A layer class defined in a function, capturing ``s``: its identity is unprovable."""

    class _Scale(Layer):
        def forward_with_state(self, x, weights, state, rng):
            return x * s, state

    return _Scale()


def _model(middle):
    """Embedding, two reversible layers built by ``middle(i)``, a loss."""
    blocks = [(tl.Serial(tl.Embedding(VOCAB, D), tl.Dup()),
               [tl.ReversibleHalfResidual(tl.Dense(D), middle(0)), tl.ReversibleSwap(),
                tl.ReversibleHalfResidual(tl.Dense(D), middle(1)), tl.ReversibleSwap()])]
    loss = tl.Serial(tl.Concatenate(), tl.Dense(VOCAB), tl.LogSoftmax(),
                     tl.CrossEntropyLoss())
    return blocks, loss


def _sgd():
    return optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)


@pytest.mark.parametrize("middle", [
    lambda i: Scale([2.0, 3.0][i]),
    lambda i: tl.Fn("scale", [lambda x: x * 2.0, lambda x: x * 3.0][i]),
], ids=["class_in_a_function", "fn_of_lambdas"])
def test_layers_whose_identity_is_unprovable_do_not_share_a_program(middle, batch):
    blocks, loss = _model(middle)
    tl.init_reversible_blocks(blocks, loss, signature(batch), jax.random.key(0))
    flat = tl.blocks_to_layers(blocks, loss)
    w0 = jax.tree.map(np.array, tl.Serial(flat).weights)
    assert flat[1].structure_key is None and flat[3].structure_key is None
    rev = ReversibleSerialTrainer(blocks, loss, _sgd, n_devices=1)
    plain_blocks, plain_loss = _model(middle)
    plain_flat = tl.blocks_to_layers(plain_blocks, plain_loss)
    plain_model = tl.Serial(plain_flat)
    plain_model.init(signature(batch))
    plain_model.weights = w0
    plain = Trainer(plain_model, _sgd, n_devices=1)
    for step in range(2):
        rev_loss, _ = rev.one_step(batch, jax.random.key(step))
        plain_loss_value, _ = plain.one_step(batch, jax.random.key(step))
        assert float(rev_loss) == pytest.approx(float(plain_loss_value), rel=1e-5)
    assert_trees_close(rev.weights, plain.weights, rtol=1e-5, atol=1e-5)


def test_identical_layers_share_one_program_per_kind(batch):
    blocks, loss = _model(lambda i: tl.Relu())
    tl.init_reversible_blocks(blocks, loss, signature(batch), jax.random.key(0))
    rev = ReversibleSerialTrainer(blocks, loss, _sgd, n_devices=1, scan_layers=False)
    rev.one_step(batch, jax.random.key(0))
    counts = rev.trace_counts()
    # embedding: forward + fbo; the two half-residuals share forward + reverse; the swaps
    # share reverse (their forward only reorders the stack, on the host); the loss: loss_fbo;
    # and the whole model's gradient norm.
    assert len(counts) == 7 and set(counts.values()) == {1}, counts
    assert "step_summary" in counts
    assert not any(name.startswith("forward/ReversibleSwap") for name in counts), counts


def test_loss_share_is_each_devices_fraction_of_the_total_weight():
    from revtrain.parallel import transfers
    from revtrain.parallel.collectives import DEV
    from revtrain.parallel.placement import Placement, make_mesh
    from revtrain.trainers.common.global_loss import loss_share
    mesh = make_mesh(4)
    shares = jax.jit(jax.shard_map(lambda w: loss_share(w[0])[None], mesh=mesh,
                                   in_specs=DEV, out_specs=DEV))
    totals = transfers.shard_per_device(np.array([3.0, 1.0, 0.0, 4.0], np.float32),
                                        Placement(mesh))
    np.testing.assert_allclose(shares(totals), [3 / 8, 1 / 8, 0, 4 / 8])
    zeros = transfers.shard_per_device(np.zeros(4, np.float32), Placement(mesh))
    np.testing.assert_array_equal(shares(zeros), np.zeros(4))
    assert jnp.asarray(shares(totals)).dtype == jnp.float32
