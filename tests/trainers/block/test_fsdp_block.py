"""FSDP in the block trainers: sharded weights and slots change no result, only memory.

The model is the shared small LM (dropout everywhere) at ``d_model=64``, so its matrices
are sharded over 2 or 4 devices while biases and norms stay replicated (both paths of the
gather / reduce-scatter run in every test).
"""
import jax
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain.parallel import placement, transfers
from revtrain.trainers import (
    MemoryEfficientTrainer,
    ReversibleSerialTrainer,
    Trainer,
    TrainState,
)
from revtrain.training import optimizer_fn
from tests.trainers.conftest import LR_OVERRIDE, adam, flat_weights, initialised_blocks
from tests.tree_utils import assert_trees_close, float_stats

D_MODEL = 64
BLOCK_TRAINERS = {"ReversibleSerialTrainer": ReversibleSerialTrainer,
                  "MemoryEfficientTrainer": MemoryEfficientTrainer}


def _blocks(batch, weights=None):
    return initialised_blocks("one", batch, weights=weights, d_model=D_MODEL)


def _pair(cls, batch, n_devices, optimizer=adam, **kwargs):
    """``(fsdp=False, fsdp=True)`` trainers of ``cls`` from the same initial weights."""
    blocks, loss = _blocks(batch)
    w0 = flat_weights(blocks, loss)
    plain = cls(blocks, loss, optimizer, n_devices=n_devices, **kwargs)
    sharded = cls(*_blocks(batch, w0), optimizer, n_devices=n_devices, fsdp=True, **kwargs)
    return plain, sharded


def _steps(trainer, batch, steps=3, first=0):
    """Losses and stats of ``steps`` steps (learning-rate override as `run_steps`), and
    whether anything was traced again after the first of them."""
    losses, stats, counts = [], [], None
    for step in range(first, first + steps):
        loss, step_stats = trainer.one_step(batch, jax.random.key(100 + step), step=step,
                                            learning_rate=LR_OVERRIDE.get(step))
        losses.append(float(loss))
        stats.append(float_stats(step_stats))
        counts = trainer.trace_counts() if counts is None else counts
    return losses, stats, trainer.trace_counts() != counts


def _sharded_leaves(trainer):
    return [s for s in jax.tree.leaves(trainer.value_shardings("weights"))
            if not s.is_fully_replicated]


class ShardWatch:
    """Counts the weight and slot leaves the layers' functions receive sharded."""

    def __init__(self):
        self.sharded = self.replicated = 0

    def on_dispatch(self, label, fn, args):
        for leaf in jax.tree.leaves(args[1]):
            if leaf.sharding.is_fully_replicated:
                self.replicated += 1
            else:
                self.sharded += 1


@pytest.mark.parametrize("n_devices", [1, 2, 4])
@pytest.mark.parametrize("name", list(BLOCK_TRAINERS))
def test_fsdp_gives_the_same_steps_and_compiles_once(name, n_devices, batch):
    plain, sharded = _pair(BLOCK_TRAINERS[name], batch, n_devices)
    watch = ShardWatch()
    sharded.observers.append(watch)
    losses, stats, retraced = _steps(sharded, batch)
    assert (watch.sharded > 0) == (n_devices > 1) and watch.replicated > 0
    expected, expected_stats, _ = _steps(plain, batch)
    assert not retraced
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for got, want in zip(stats, expected_stats, strict=True):
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-5)
    assert_trees_close(sharded.weights, plain.weights, rtol=1e-5, atol=1e-5)
    assert_trees_close(sharded.slots, plain.slots, rtol=1e-5, atol=1e-5)
    assert sharded.learning_rate == pytest.approx(plain.learning_rate)


def test_fsdp_block_trainers_match_trainer(batch):
    blocks, loss = _blocks(batch)
    w0 = flat_weights(blocks, loss)
    plain = Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), adam, n_devices=4)
    expected, _, _ = _steps(plain, batch)
    for cls in BLOCK_TRAINERS.values():
        trainer = cls(*_blocks(batch, w0), adam, n_devices=4, fsdp=True)
        np.testing.assert_allclose(_steps(trainer, batch)[0], expected, rtol=1e-5)
        assert_trees_close(trainer.weights, plain.weights, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(BLOCK_TRAINERS))
def test_fsdp_divides_the_weight_and_slot_bytes_per_device(name, batch):
    plain, sharded = _pair(BLOCK_TRAINERS[name], batch, 4)
    peaks = {}
    for trainer in (plain, sharded):
        seen = []

        class Watch:
            def on_dispatch(self, label, fn, args, trainer=trainer, seen=seen):
                seen.append(trainer.device_footprint().total_bytes)

        trainer.observers.append(Watch())
        trainer.one_step(batch, jax.random.key(0))
        peaks[trainer.fsdp] = max(seen + [trainer.device_footprint().total_bytes])
    assert 0 < peaks[True] <= 0.3 * peaks[False]
    if name == "ReversibleSerialTrainer":
        values = sharded.train_state
        whole = sum(a.nbytes for a in jax.tree.leaves((values.weights, values.slots)))
        assert peaks[False] == whole


def _per_layer_clipped_sgd():
    return optimizer_fn("sgd", learning_rate=0.5, clip_gradient_norm=0.05)


@pytest.mark.parametrize("name", list(BLOCK_TRAINERS))
def test_global_norm_clipping_sees_the_whole_gradient(name, batch):
    """Per-layer clipping inside the optimizer (``optax.clip_by_global_norm`` of each
    layer) and exact whole-model clipping (``clip_global_norm``) both need norms over
    sharded gradients: replicated leaves counted once, every shard counted."""
    cls = BLOCK_TRAINERS[name]
    for optimizer, kwargs in ((_per_layer_clipped_sgd, {}),
                              (lambda: optax.sgd(0.5), {"clip_global_norm": 0.05})):
        plain, sharded = _pair(cls, batch, 4, optimizer, **kwargs)
        losses, stats, _ = _steps(sharded, batch, steps=2, first=2)
        expected, expected_stats, _ = _steps(plain, batch, steps=2, first=2)
        norms = [v for k, v in expected_stats[0].items() if "gradients_l2" in k]
        assert max(norms) > 0.05 * 2  # clipping changes the step
        np.testing.assert_allclose(losses, expected, rtol=1e-5)
        for got, want in zip(stats, expected_stats, strict=True):
            np.testing.assert_allclose([got[k] for k in want], list(want.values()),
                                       rtol=1e-5)
        assert_trees_close(sharded.weights, plain.weights, rtol=1e-5, atol=1e-5)


def test_saved_values_are_the_stored_shards(batch):
    rev = ReversibleSerialTrainer(*_blocks(batch), adam, n_devices=4, fsdp=True)
    rev.one_step(batch, jax.random.key(0))
    for part in ("weights", "slots"):
        saved, shardings = rev.saved_values(part), rev.value_shardings(part)
        host = rev.host_values(part)
        assert jax.tree.structure(saved) == jax.tree.structure(host)
        for a, sharding, h in zip(jax.tree.leaves(saved), jax.tree.leaves(shardings),
                                  jax.tree.leaves(host), strict=True):
            assert a.shape == h.shape and a.sharding == sharding
            assert sharding.spec == placement.fsdp_spec(h.shape, 4)
            np.testing.assert_array_equal(np.asarray(a), h)
    assert len(_sharded_leaves(rev)) > 0
    state = rev.saved_values("state")
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(state))
    assert all(s is None for s in jax.tree.leaves(rev.value_shardings("state"),
                                                  is_leaf=lambda x: x is None))
    met = MemoryEfficientTrainer(*_blocks(batch), adam, n_devices=4, fsdp=True)
    met.one_step(batch, jax.random.key(0))
    for part in ("weights", "slots"):
        assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(met.saved_values(part)))
        assert_trees_close(met.saved_values(part), met.host_values(part), rtol=0, atol=0)
        shardings = jax.tree.leaves(met.value_shardings(part), is_leaf=lambda x: x is None)
        assert shardings and all(s is None for s in shardings)


def _sharded_arrays(values, mesh, fsdp):
    """``values`` (host) as jax.Arrays in the fsdp layout (weights, slots) of ``mesh``."""
    layout = placement.Placement(mesh, fsdp)
    put = lambda tree: transfers.put_sharded(tree, layout.weight_shardings(tree))
    return TrainState(put(values.weights), values.state, put(values.slots))


@pytest.mark.parametrize("name", list(BLOCK_TRAINERS))
def test_restore_reshards_values(name, batch):
    """Host (replicated) values into an fsdp trainer, and sharded jax.Arrays into a
    replicated one, give the same next steps as the trainer they came from."""
    plain, sharded = _pair(BLOCK_TRAINERS[name], batch, 4)
    _steps(plain, batch, steps=1)
    after_one = plain.train_state
    sharded.restore(after_one)
    expected, _, _ = _steps(plain, batch, steps=1, first=1)
    np.testing.assert_allclose(_steps(sharded, batch, steps=1, first=1)[0], expected,
                               rtol=1e-6)
    assert_trees_close(sharded.weights, plain.weights, rtol=1e-6, atol=1e-6)
    # And back: a replicated trainer restored from sharded arrays (4 devices, fsdp layout).
    mesh = placement.make_mesh(4)
    plain.restore(_sharded_arrays(after_one, mesh, fsdp=True))
    np.testing.assert_allclose(_steps(plain, batch, steps=1, first=1)[0], expected,
                               rtol=1e-6)
    # A sharded trainer from another trainer's sharded saved values.
    other = BLOCK_TRAINERS[name](*_blocks(batch), adam, n_devices=4, fsdp=True)
    other.restore(TrainState(*(sharded.saved_values(p) for p in TrainState._fields)))
    assert_trees_close(other.train_state, sharded.train_state, rtol=0, atol=0)


def test_a_user_mesh_with_its_own_axis_name_is_the_same_as_n_devices(batch):
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    blocks, loss = _blocks(batch)
    w0 = flat_weights(blocks, loss)
    by_mesh = ReversibleSerialTrainer(blocks, loss, adam, mesh=mesh, fsdp=True)
    by_count = ReversibleSerialTrainer(*_blocks(batch, w0), adam, n_devices=2, fsdp=True)
    assert by_mesh.n_devices == 2
    assert _steps(by_mesh, batch, steps=2)[0] == _steps(by_count, batch, steps=2)[0]
    assert_trees_close(by_mesh.weights, by_count.weights, rtol=0, atol=0)
