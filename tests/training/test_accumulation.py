"""Tests of revtrain/training/accumulation.py: k micro-steps through ``optax.MultiSteps``
update every trainer as one step on the whole batch does."""
import jax
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain import trainers
from revtrain.training import accumulated_step, accumulating_optimizer, micro_batches
from revtrain.training.accumulation import micro_keys
from tests.trainers.conftest import adam, deep_blocks, make_batch
from tests.tree_utils import assert_trees_close

TRAINERS = ("Trainer", "ReversibleSerialTrainer", "MemoryEfficientTrainer")
# Rows are summed in another order (per micro-batch, then averaged), so the results
# differ from the whole batch's by float32 rounding only: measured <= 2e-7 absolute on
# weights of size ~0.6 (Adam's first steps move each weight by about the rate).
RTOL, ATOL = 1e-5, 1e-6


def _build(name, optimizer_fn, batch, fsdp=False):
    """``name`` on 4 devices over a deterministic model (no dropout): reversible
    half-residual ``Dense`` layers, numpy initial weights equal for every call."""
    blocks, loss = deep_blocks(4, 8, batch)
    if name == "Trainer":
        return trainers.Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), optimizer_fn,
                                n_devices=4, fsdp=fsdp)
    return getattr(trainers, name)(blocks, loss, optimizer_fn, n_devices=4, fsdp=fsdp)


def _multi(x):
    return isinstance(x, optax.MultiStepsState)


def _equal_weight_batch(rows):
    inputs, targets, _ = make_batch(rows)
    return inputs, targets, np.ones(targets.shape, np.float32)


@pytest.mark.parametrize("name,k,fsdp", [(name, 2, False) for name in TRAINERS]
                         + [("Trainer", 4, False), ("ReversibleSerialTrainer", 4, True)])
def test_k_micro_steps_equal_one_step_on_the_whole_batch(name, k, fsdp):
    """Two updates, the second with a learning-rate override (which must reach the
    ``inject_hyperparams`` state inside MultiSteps' state): weights, slots' inner state,
    losses and the rate agree with the plain optimizer on the whole batch."""
    batch = _equal_weight_batch(4 * k)  # One row per device per micro-batch.
    whole = _build(name, adam, batch, fsdp)
    accumulating = _build(name, accumulating_optimizer(adam, k), batch, fsdp)
    for step, lr in enumerate([None, 3e-3]):
        rng = jax.random.key(step)
        loss, _ = whole.one_step(batch, rng, step=step, learning_rate=lr)
        micro_loss, stats = accumulated_step(accumulating, batch, rng, step, lr, k)
        assert float(micro_loss) == pytest.approx(float(loss), rel=RTOL)
        assert float(stats["loss"]) == float(micro_loss)
        assert_trees_close(accumulating.weights, whole.weights, rtol=RTOL, atol=ATOL)
    assert accumulating.learning_rate == pytest.approx(3e-3) == whole.learning_rate
    # The inner optimizer's state (moments, count, the injected rate) is the plain one's.
    inner = jax.tree.map(lambda s: s.inner_opt_state if _multi(s) else s,
                         accumulating.slots, is_leaf=_multi)
    assert_trees_close(inner, whole.slots, rtol=RTOL, atol=ATOL)
    # Between updates the accumulator is empty: a checkpoint holds no partial step.
    states = [x for x in jax.tree.leaves(accumulating.slots, is_leaf=_multi) if _multi(x)]
    assert len(states) == (1 if name == "Trainer" else len(accumulating.layers))
    for state in states:
        assert int(state.mini_step) == 0 and int(state.gradient_step) == 2
        assert all(not np.any(g) for g in jax.tree.leaves(state.acc_grads))


def test_weights_change_only_on_the_last_micro_step():
    batch = _equal_weight_batch(8)
    trainer = _build("ReversibleSerialTrainer", accumulating_optimizer(adam, 2), batch)
    before = trainer.weights
    trainer.one_step(micro_batches(batch, 2)[0], jax.random.key(0))
    assert_trees_close(trainer.weights, before, rtol=0, atol=0)
    trainer.one_step(micro_batches(batch, 2)[1], jax.random.key(1))
    assert not np.allclose(trainer.weights[0][0], before[0][0])


def test_one_accumulate_step_is_the_optimizer_itself():
    assert accumulating_optimizer(adam, 1) is adam
    state = accumulating_optimizer(adam, 3)().init({"w": np.zeros(2, np.float32)})
    assert isinstance(state, optax.MultiStepsState)


@pytest.mark.parametrize("k", [0, -1, 1.5, True, "2"])
def test_a_bad_accumulate_steps_is_one_line(k):
    with pytest.raises(ValueError, match=r"^accumulate_steps=.* must be an int >= 1; set "
                                         r"RunConfig\.accumulate_steps"):
        accumulating_optimizer(adam, k)


def test_micro_batches_are_consecutive_rows_and_refuse_a_remainder():
    batch = make_batch(6)
    parts = micro_batches(batch, 3)
    assert len(parts) == 3
    for i, part in enumerate(parts):
        for leaf, whole in zip(part, batch, strict=True):
            np.testing.assert_array_equal(leaf, whole[2 * i:2 * i + 2])
    with pytest.raises(ValueError, match=r"^a batch of \[6\] rows does not split into "
                                         r"accumulate_steps=4 equal micro-batches; use a "
                                         r"batch size that is a multiple of 4$"):
        micro_batches(batch, 4)


def test_micro_keys_fold_the_index_into_the_step_key():
    rng = jax.random.key(7)
    keys = micro_keys(rng, 3)
    for i, key in enumerate(keys):
        np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(
            jax.random.fold_in(rng, i)))
    assert len({tuple(np.asarray(jax.random.key_data(k))) for k in keys}) == 3


def test_one_accumulate_step_is_one_call_of_one_step_on_the_whole_batch():
    """k = 1 is the old step: the batch, key, step and rate go through untouched and the
    trainer's result comes back as it is."""
    batch, rng, result, calls = make_batch(4), jax.random.key(3), object(), []

    class Recorder:
        def one_step(self, *args, **kwargs):
            calls.append((args, kwargs))
            return result

    assert accumulated_step(Recorder(), batch, rng, 5, 0.1, 1) is result
    (args, kwargs), = calls
    assert args[0] is batch and args[1] is rng and kwargs == {"step": 5, "learning_rate": 0.1}
