"""Tests for revtrain.trainers.reversible: ReversibleSerialTrainer equals Trainer (the core
invariant), owns its values (TrainState, sync_to) and compiles once."""
import jax
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain import trainers
from revtrain.trainers import ReversibleSerialTrainer, Trainer, TrainState
from tests.trainers.conftest import (
    adam,
    flat_weights,
    initialised_blocks,
    make_batch,
    run_steps,
)
from tests.tree_utils import assert_trees_close


def _pair(kind, n_devices, batch):
    blocks, loss = initialised_blocks(kind, batch)
    w0 = flat_weights(blocks, loss)
    rev = ReversibleSerialTrainer(blocks, loss, adam, n_devices=n_devices)
    blocks2, loss2 = initialised_blocks(kind, batch, weights=w0, seed=1)
    plain = Trainer(tl.Serial(tl.blocks_to_layers(blocks2, loss2)), adam, n_devices=n_devices)
    return rev, plain, (blocks, loss), (blocks2, loss2)


@pytest.mark.parametrize("kind,n_devices", [
    ("one", 1), ("one", 2), ("one", 4), ("two", 1), ("two", 4), ("empty", 1), ("empty", 2)])
def test_reversible_trainer_matches_trainer(kind, n_devices, batch):
    rev, plain, (blocks, loss), (blocks2, loss2) = _pair(kind, n_devices, batch)
    rev_losses = run_steps(rev, batch)
    plain_losses = run_steps(plain, batch)
    np.testing.assert_allclose(rev_losses, plain_losses, rtol=1e-5)
    assert rev_losses[-1] < rev_losses[0]
    assert_trees_close(rev.weights, plain.weights, rtol=1e-5, atol=1e-5)
    # After sync_to the layer objects show the new weights too.
    rev.sync_to()
    plain.sync_to()
    assert_trees_close(flat_weights(blocks, loss), flat_weights(blocks2, loss2),
                       rtol=1e-5, atol=1e-5)
    assert rev.learning_rate == pytest.approx(3e-3) == plain.learning_rate


@pytest.mark.parametrize("trainer_name", ["Trainer", "ReversibleSerialTrainer",
                                          "MemoryEfficientTrainer"])
def test_layer_objects_change_only_on_sync_to(trainer_name, batch):
    blocks, loss = initialised_blocks("one", batch)
    w0 = flat_weights(blocks, loss)
    if trainer_name == "Trainer":
        trainer = Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), adam, n_devices=2)
    else:
        trainer = getattr(trainers, trainer_name)(blocks, loss, adam, n_devices=2)
    trainer.one_step(batch, jax.random.key(0))
    embedding = blocks[0][0].sublayers[0]
    np.testing.assert_array_equal(np.asarray(embedding.weights), w0[0][0])
    assert not np.allclose(trainer.train_state.weights[0][0], w0[0][0])
    trainer.sync_to()
    np.testing.assert_array_equal(np.asarray(embedding.weights),
                                  trainer.train_state.weights[0][0])
    assert_trees_close(flat_weights(blocks, loss), trainer.weights, rtol=0, atol=0)


def test_sync_to_rejects_layers_that_do_not_match(batch):
    blocks, loss = initialised_blocks("one", batch)
    trainer = ReversibleSerialTrainer(blocks, loss, adam, n_devices=1)
    with pytest.raises(ValueError, match=r"sync_to got 1 layers for \d+ entries"):
        trainer.sync_to([loss])
    other, other_loss = initialised_blocks("two", batch)
    with pytest.raises(ValueError, match=r"structure mismatch"):
        trainer.sync_to(tl.blocks_to_layers(other, other_loss)[:len(trainer.layers)])


def test_stats_keys(batch):
    blocks, loss = initialised_blocks("two", batch)
    trainer = ReversibleSerialTrainer(blocks, loss, adam, n_devices=1)
    _, stats = trainer.one_step(batch, jax.random.key(0))
    n = len(trainer.layers)
    assert set(stats) == {"loss", "learning_rate", "gradients_l2", "weights_l2",
                          "layers/gradients_l2", "layers/weights_l2"}
    for name in ("gradients_l2", "weights_l2"):  # Entry i: flat layer i; the whole model's
        per_layer = np.asarray(stats[f"layers/{name}"])  # norm is their norm.
        assert per_layer.shape == (n,) and per_layer.dtype == np.float32
        assert float(stats[name]) == pytest.approx(float(np.linalg.norm(per_layer)), rel=1e-5)
    assert float(stats["layers/gradients_l2"][n - 1]) > 0
    _, plain_stats = Trainer(tl.Serial(trainer.layers), adam, 1).one_step(
        batch, jax.random.key(0))
    assert {"loss", "gradients_l2", "weights_l2", "learning_rate"} <= set(plain_stats)


def test_no_recompilation_after_the_first_step(batch):
    blocks, loss = initialised_blocks("two", batch)
    rev = ReversibleSerialTrainer(blocks, loss, adam, n_devices=2)
    plain = Trainer(tl.Serial(tl.blocks_to_layers(*initialised_blocks("two", batch))), adam, 2)
    run_steps(rev, batch, steps=1)
    run_steps(plain, batch, steps=1)
    counts = rev.trace_counts()
    # Identical layers share compiled functions: fewer functions than layers, each traced
    # once.
    assert len(counts) < len(rev.layers) and set(counts.values()) == {1}
    assert plain.trace_counts() == {"train_step": 1}
    traces = []
    listener = lambda event, duration, **kwargs: traces.append(event) if event in (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/backend_compile_duration") else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        run_steps(rev, make_batch(seed=1), steps=3)
        run_steps(plain, make_batch(seed=1), steps=3)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert rev.trace_counts() == counts
    assert plain.trace_counts() == {"train_step": 1}
    assert traces == []


def _differs(a, b) -> bool:
    return any(not np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_train_state_round_trip_is_exact(batch):
    """Values restored into a trainer of other initial values come back bit for bit (a
    ``restore`` that did nothing would leave the other values)."""
    blocks, loss = initialised_blocks("one", batch)
    trainer = ReversibleSerialTrainer(blocks, loss, adam, n_devices=2)
    trainer.one_step(batch, jax.random.key(0))
    values = jax.device_get(trainer.train_state)
    assert isinstance(values, TrainState)
    other = ReversibleSerialTrainer(*initialised_blocks("one", batch, seed=5), adam, 2)
    assert _differs(other.train_state, values)
    other.restore(values)
    assert_trees_close(other.train_state, values, rtol=0, atol=0)
    plain = Trainer(tl.Serial(tl.blocks_to_layers(*initialised_blocks("one", batch))), adam, 2)
    plain.one_step(batch, jax.random.key(0))
    plain_values = jax.device_get(plain.train_state)
    fresh = Trainer(tl.Serial(tl.blocks_to_layers(*initialised_blocks("one", batch, seed=5))),
                    adam, 2)
    assert _differs(fresh.train_state, plain_values)
    fresh.restore(plain_values)
    assert_trees_close(fresh.train_state, plain_values, rtol=0, atol=0)


def test_restore_then_step_equals_an_uninterruptedrun_steps(batch):
    blocks, loss = initialised_blocks("one", batch)
    straight = ReversibleSerialTrainer(blocks, loss, adam, n_devices=2)
    straight.one_step(batch, jax.random.key(0))
    saved = straight.train_state
    straight.one_step(batch, jax.random.key(1))
    resumed = ReversibleSerialTrainer(*initialised_blocks("one", batch, seed=5), adam, 2)
    resumed.restore(saved)
    resumed.one_step(batch, jax.random.key(1))
    assert_trees_close(resumed.train_state, straight.train_state, rtol=0, atol=0)


def test_restoring_the_wrong_structure_names_the_path_and_changes_nothing(batch):
    blocks, loss = initialised_blocks("one", batch)
    trainer = ReversibleSerialTrainer(blocks, loss, adam, n_devices=1)
    before = trainer.train_state
    slots = list(before.slots)
    slots[1] = slots[0]
    with pytest.raises(ValueError, match=r"slots structure mismatch at slots\[1\]"):
        trainer.restore(before._replace(slots=tuple(slots)))
    assert_trees_close(trainer.train_state, before, rtol=0, atol=0)


def test_trainer_built_from_synced_layers_continues_from_them(batch):
    blocks, loss = initialised_blocks("one", batch)
    first = ReversibleSerialTrainer(blocks, loss, adam, n_devices=1)
    first.one_step(batch, jax.random.key(0))
    first.sync_to()
    second = ReversibleSerialTrainer(blocks, loss, adam, n_devices=1)
    assert_trees_close(second.weights, first.weights, rtol=0, atol=0)


@pytest.mark.parametrize("trainer_kind", ["plain", "reversible"])
def test_bad_input_is_a_clear_error_and_weights_are_unchanged(trainer_kind, batch):
    blocks, loss = initialised_blocks("one", batch)
    if trainer_kind == "plain":
        trainer = Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), adam, n_devices=4)
    else:
        trainer = ReversibleSerialTrainer(blocks, loss, adam, n_devices=4)
    before = trainer.weights
    odd = tuple(b[:6] for b in batch)
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by n_devices=4"):
        trainer.one_step(odd, jax.random.key(0))
    assert_trees_close(trainer.weights, before, rtol=0, atol=0)
    loss_value, _ = trainer.one_step(batch, jax.random.key(0))
    assert np.isfinite(float(loss_value))


@pytest.mark.parametrize("trainer_kind", ["plain", "reversible"])
def test_learning_rate_needs_an_injectable_optimizer(trainer_kind, batch):
    blocks, loss = initialised_blocks("one", batch)
    plain_adam = lambda: optax.adam(1e-2)
    if trainer_kind == "plain":
        trainer = Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), plain_adam, 1)
    else:
        trainer = ReversibleSerialTrainer(blocks, loss, plain_adam, n_devices=1)
    before = trainer.weights
    with pytest.raises(ValueError, match=r"learning_rate=0.1 .*inject_hyperparams"):
        trainer.one_step(batch, jax.random.key(0), learning_rate=0.1)
    assert_trees_close(trainer.weights, before, rtol=0, atol=0)
    _, stats = trainer.one_step(batch, jax.random.key(0))
    assert "learning_rate" not in stats


def test_uninitialised_layers_are_rejected():
    from tests.trainers.conftest import make_blocks
    blocks, loss = make_blocks("one")
    with pytest.raises(ValueError, match=r"is not initialised"):
        ReversibleSerialTrainer(blocks, loss, adam)
    with pytest.raises(ValueError, match=r"is not initialised"):
        Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), adam)


def test_non_reversible_block_member_is_a_type_error(batch):
    blocks, loss = initialised_blocks("one", batch)
    std, revs = blocks[0]
    with pytest.raises(TypeError, match=r"Dense.*is not a ReversibleLayer"):
        ReversibleSerialTrainer([(std, revs + [tl.Dense(3)])], loss, adam)
