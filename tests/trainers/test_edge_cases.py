"""Edge cases the trainers get wrong today, each a strict xfail naming what is wrong.

These are reproductions for the trainers' owner: when a fix lands, the test passes, the
strict xfail fails, and the marker should be removed.
"""
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


@pytest.mark.xfail(strict=True, reason=(
    "devices.reshape_by_device accepts a batch of 0 rows (0 % n == 0): Trainer then takes a "
    "silent optimizer step on zero gradients (Adam momentum still moves the weights); the "
    "block trainers fail with a cryptic shard_map VJP type error"))
@pytest.mark.parametrize("kind", ["plain", "reversible"])
def test_empty_batch_is_a_clear_error_and_weights_are_unchanged(kind, batch):
    trainer = _trainer(kind, batch)
    trainer.one_step(batch, jax.random.key(0))
    before = trainer.weights
    empty = tuple(b[:0] for b in batch)
    with pytest.raises(ValueError, match=r"batch size 0"):
        trainer.one_step(empty, jax.random.key(1))
    assert_trees_close(trainer.weights, before, rtol=0, atol=0)


@pytest.mark.xfail(strict=True, reason=(
    "devices.check_same_structure compares only leaf paths, so subtrees without leaves "
    "(the () state of stateless layers) may differ; the setters then store the bad tree "
    "before anything fails: afterwards trainer.state raises IndexError (block trainers) "
    "or the next step fails (Trainer)"))
@pytest.mark.parametrize("kind", ["plain", "reversible"])
def test_setting_a_wrong_empty_state_is_rejected_and_leaves_the_trainer_usable(kind, batch):
    trainer = _trainer(kind, batch, n_devices=1)
    state = trainer.state
    with pytest.raises(ValueError, match=r"state structure mismatch"):
        trainer.state = ()
    assert_trees_close(trainer.state, state, rtol=0, atol=0)
    assert np.isfinite(float(trainer.one_step(batch, jax.random.key(0))[0]))


@pytest.mark.xfail(strict=True, reason=(
    "make_loss_fbo (fbo.py) back-propagates jnp.ones_like(loss) whatever the loss shape and "
    "ReversibleSerialTrainer._loss checks only n_in: a per-example loss vector trains on "
    "its sum and one_step returns a vector (Trainer raises JAX's TypeError instead)"))
@pytest.mark.parametrize("kind", ["reversible", "memory_efficient"])
def test_non_scalar_loss_is_rejected(kind, batch):
    blocks, _ = initialised_blocks("one", batch)
    per_example = tl.Serial(tl.Concatenate(), tl.Dense(1), tl.Mean(axis=(1, 2)),
                            tl.Select([0], n_in=3))
    tl.init_reversible_blocks(blocks, per_example, signature(batch), jax.random.key(0))
    trainer = _trainer(kind, batch, n_devices=1, blocks_and_loss=(blocks, per_example))
    with pytest.raises(ValueError, match=r"scalar"):
        trainer.one_step(batch, jax.random.key(0))


@pytest.mark.xfail(strict=True, reason=(
    "TrainerBase._rng_data wraps any non-key rng with jax.random.wrap_key_data, so an int "
    "seed gives JAX's 'invalid PRNG key data ... ndim=0' TypeError instead of a message "
    "naming rng and jax.random.key"))
@pytest.mark.parametrize("kind", KINDS)
def test_int_seed_as_rng_is_a_clear_error(kind, batch):
    trainer = _trainer(kind, batch, n_devices=1)
    with pytest.raises((TypeError, ValueError), match=r"rng=0.*jax\.random\.key"):
        trainer.one_step(batch, 0)


@pytest.mark.xfail(strict=True, reason=(
    "TrainerBase._learning_rate_arg calls np.isfinite on the raw value, so a string gives "
    "numpy's \"ufunc 'isfinite' not supported\" TypeError, not a message naming it"))
def test_string_learning_rate_is_a_clear_error(batch):
    trainer = _trainer("reversible", batch, n_devices=1)
    with pytest.raises((TypeError, ValueError), match=r"learning_rate='0\.1'"):
        trainer.one_step(batch, jax.random.key(0), learning_rate="0.1")


@pytest.mark.xfail(strict=True, reason=(
    "devices.reshape_by_device checks each leaf's batch on its own: weights of 2 rows with "
    "inputs of 8 rows on 2 devices become one row per device and broadcast over that "
    "device's 4 examples, silently (the loss is computed with the wrong mask)"))
@pytest.mark.parametrize("kind", ["plain", "reversible"])
def test_batch_items_of_different_batch_sizes_are_rejected(kind, batch):
    trainer = _trainer(kind, batch)
    inputs, targets, _ = batch
    mismatched = (inputs, targets, np.ones((2, inputs.shape[1]), np.float32))
    with pytest.raises(ValueError, match=r"batch size"):
        trainer.one_step(mismatched, jax.random.key(0))


@pytest.mark.xfail(strict=True, reason=(
    "the block trainers never check blocks_to_layers for a layer object listed twice: "
    "combinators reject a reused layer with weights, but a block list built by hand does "
    "not, so each use trains its own weight copy and the layer object shows only the last"))
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
