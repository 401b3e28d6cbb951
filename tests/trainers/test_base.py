"""Tests for revtrain.trainers.base: input checks shared by every trainer."""
import jax
import numpy as np
import pytest

from revtrain import layers as tl
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
from tests.trainers.conftest import adam, initialised_blocks, signature
from tests.tree_utils import assert_trees_close

KINDS = ["plain", "reversible", "memory_efficient"]


def _trainer(kind, batch, n_devices=2, blocks_and_loss=None):
    blocks, loss = blocks_and_loss or initialised_blocks("one", batch)
    if kind == "plain":
        return Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), adam, n_devices=n_devices)
    make = ReversibleSerialTrainer if kind == "reversible" else MemoryEfficientTrainer
    return make(blocks, loss, adam, n_devices=n_devices)


@pytest.mark.parametrize("kind", ["plain", "reversible"])
def test_empty_batch_is_a_clear_error_and_weights_are_unchanged(kind, batch):
    trainer = _trainer(kind, batch)
    trainer.one_step(batch, jax.random.key(0))
    before = trainer.weights
    empty = tuple(b[:0] for b in batch)
    with pytest.raises(ValueError, match=r"batch size 0"):
        trainer.one_step(empty, jax.random.key(1))
    assert_trees_close(trainer.weights, before, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["plain", "reversible"])
def test_setting_a_wrong_empty_state_is_rejected_and_leaves_the_trainer_usable(kind, batch):
    trainer = _trainer(kind, batch, n_devices=1)
    values = trainer.train_state
    with pytest.raises(ValueError, match=r"state structure mismatch"):
        trainer.restore(values._replace(state=()))
    assert_trees_close(trainer.train_state, values, rtol=0, atol=0)
    assert np.isfinite(float(trainer.one_step(batch, jax.random.key(0))[0]))


@pytest.mark.parametrize("kind", ["reversible", "memory_efficient"])
def test_non_scalar_loss_is_rejected(kind, batch):
    blocks, _ = initialised_blocks("one", batch)
    per_example = tl.Serial(tl.Concatenate(), tl.Dense(1), tl.Mean(axis=(1, 2)),
                            tl.Select([0], n_in=3))
    tl.init_reversible_blocks(blocks, per_example, signature(batch), jax.random.key(0))
    trainer = _trainer(kind, batch, n_devices=1, blocks_and_loss=(blocks, per_example))
    with pytest.raises(ValueError, match=r"scalar"):
        trainer.one_step(batch, jax.random.key(0))


@pytest.mark.parametrize("kind", KINDS)
def test_int_seed_as_rng_is_a_clear_error(kind, batch):
    trainer = _trainer(kind, batch, n_devices=1)
    with pytest.raises((TypeError, ValueError), match=r"rng=0.*jax\.random\.key"):
        trainer.one_step(batch, 0)


def test_string_learning_rate_is_a_clear_error(batch):
    trainer = _trainer("reversible", batch, n_devices=1)
    with pytest.raises((TypeError, ValueError), match=r"learning_rate='0\.1'"):
        trainer.one_step(batch, jax.random.key(0), learning_rate="0.1")


@pytest.mark.parametrize("kind", ["plain", "reversible"])
def test_batch_items_of_different_batch_sizes_are_rejected(kind, batch):
    trainer = _trainer(kind, batch)
    inputs, targets, _ = batch
    mismatched = (inputs, targets, np.ones((2, inputs.shape[1]), np.float32))
    with pytest.raises(ValueError, match=r"batch size"):
        trainer.one_step(mismatched, jax.random.key(0))


def test_block_list_using_one_layer_with_weights_twice_is_rejected(batch):
    d = 8
    embed = tl.Serial(tl.Embedding(16, d), tl.Dup())
    shared = tl.ReversibleHalfResidual(tl.Dense(d))
    loss = tl.Serial(tl.Concatenate(), tl.Dense(16), tl.LogSoftmax(), tl.CrossEntropyLoss())
    x = jax.ShapeDtypeStruct(batch[0].shape + (d,), np.float32)
    embed.init(signature(batch)[0])
    shared.init((x, x))
    loss.init((x, x) + signature(batch)[1:])
    with pytest.raises(ValueError, match=r"used more than once"):
        ReversibleSerialTrainer([(embed, [shared, tl.ReversibleSwap(), shared])], loss, adam,
                                n_devices=1)


def test_reversible_trainer_frees_activations_but_not_the_callers_batch(batch):
    import gc
    blocks, loss = initialised_blocks("one", batch)
    trainer = ReversibleSerialTrainer(blocks, loss, adam, n_devices=2,
                                      free_accelerators_on_step=True)
    user_batch = tuple(jax.numpy.asarray(b) for b in batch)
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}
    trainer.one_step(user_batch, jax.random.key(0))
    gc.collect()
    assert not any(b.is_deleted() for b in user_batch)
    activation_shape = (2, batch[0].shape[0] // 2) + batch[0].shape[1:] + (8,)
    new = [a for a in jax.live_arrays() if id(a) not in before]
    assert not [a for a in new if a.shape == activation_shape]
