"""FSDP (``fsdp=True``): weights and slots sharded over the devices change nothing but memory.

The model's big leaves (embedding, dense kernels: >= 1024 elements, divisible by 2 and 4)
are sharded, its biases and norms stay replicated, so the per-device bytes fall to about a
quarter on 4 devices.
"""
import collections
import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from revtrain import layers as tl
from revtrain import memory
from revtrain.parallel.collectives import DEV, gathering_shard_map
from revtrain.parallel.placement import Placement
from revtrain.trainers import Trainer
from revtrain.trainers.common.protocols import TrainState
from revtrain.training import optimizer_fn
from tests.fsdp_models import TRAINERS, blocks_and_loss, build
from tests.trainers.conftest import LR_OVERRIDE, adam, make_batch
from tests.tree_utils import assert_trees_close


def steps_and_traces(trainer, batch, steps: int = 3):
    """Losses of ``steps`` steps (learning-rate override on step 1), and whether anything
    was traced again after the first step."""
    losses, traces = [], None
    for step in range(steps):
        loss, _ = trainer.one_step(batch, jax.random.key(100 + step), step=step,
                                   learning_rate=LR_OVERRIDE.get(step))
        losses.append(float(loss))
        traces = traces or dict(trainer.trace_counts())
    return losses, trainer.trace_counts() != traces


@pytest.mark.parametrize("n_devices", [1, 2, 4])
@pytest.mark.parametrize("trainer_name", list(TRAINERS))
def test_fsdp_gives_the_same_losses_weights_and_slots(trainer_name, n_devices):
    batch = make_batch()
    plain, sharded = (build(trainer_name, fsdp, n_devices) for fsdp in (False, True))
    plain_losses, _ = steps_and_traces(plain, batch)
    losses, retraced = steps_and_traces(sharded, batch)
    assert not retraced, "the FSDP step was compiled again after step 1"
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    assert_trees_close(sharded.weights, plain.weights, rtol=1e-5, atol=1e-6)
    assert_trees_close(sharded.slots, plain.slots, rtol=1e-5, atol=1e-6)
    assert sharded.learning_rate == pytest.approx(LR_OVERRIDE[1])


def test_global_norm_clipping_is_exact_under_fsdp():
    """Not element-wise: the norm is of the whole global gradient, however it is sharded."""
    batch = make_batch()
    clipped = lambda: optimizer_fn("adam", learning_rate=1e-2, clip_gradient_norm=0.05)  # noqa: E731
    plain = build("Trainer", False, 1, clipped, dropout=0.0)
    sharded = build("Trainer", True, 4, clipped, dropout=0.0)
    norms = []
    for trainer in (plain, sharded):
        _, stats = trainer.one_step(batch, jax.random.key(0))
        norms.append(float(stats["gradients_l2"]))
    assert norms[0] > 0.05  # The clipping is active.
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    assert_trees_close(sharded.weights, plain.weights, rtol=1e-5, atol=1e-6)


# MemoryEfficientTrainer keeps its values in host memory between steps; its per-dispatch
# device bytes are checked in test_fsdp_block.py.
@pytest.mark.parametrize("trainer_name", ["Trainer", "ReversibleSerialTrainer"])
def test_fsdp_stores_a_quarter_of_the_bytes_per_device_on_4_devices(trainer_name):
    batch = make_batch()
    device = jax.local_devices()[0]
    footprints, ledger = {}, {}
    for fsdp in (False, True):
        model = blocks_and_loss(0.0)  # Its layers' own weights are not the trainer's.
        gc.collect()
        before = memory.live_device_bytes(device)
        trainer = build(trainer_name, fsdp, 4, model=model)
        trainer.one_step(batch, jax.random.key(0))
        footprints[fsdp] = trainer.device_footprint().total_bytes
        ledger[fsdp] = memory.live_device_bytes(device) - before
        del trainer
    assert footprints[True] <= 0.3 * footprints[False], footprints
    assert ledger[True] <= 0.3 * ledger[False], ledger


def test_saved_values_are_sharded_and_host_values_whole():
    trainer = build("Trainer", True, 4, dropout=0.0)
    plain = build("Trainer", False, 4, dropout=0.0)
    saved, shardings = trainer.saved_values("weights"), trainer.value_shardings("weights")
    specs = {leaf.sharding.spec for leaf in jax.tree.leaves(saved)}
    assert P("batch") in specs and P() in specs  # Kernels split, biases/norms whole.
    for leaf, sharding in zip(jax.tree.leaves(saved), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding == sharding
    assert_trees_close(trainer.weights, plain.weights, rtol=0, atol=0)
    assert all(v is None for v in jax.tree.leaves(trainer.value_shardings("state"),
                                                  is_leaf=lambda x: x is None))


@pytest.mark.parametrize("source_fsdp", [True, False])
def test_restore_takes_device_arrays_in_any_sharding(source_fsdp):
    """A 4-device (sharded or replicated) trainer's arrays restore into a 2-device trainer
    of the other setting, which then steps exactly as one restored from host copies."""
    batch = make_batch()
    source = build("Trainer", source_fsdp, 4, dropout=0.0)
    source.one_step(batch, jax.random.key(0))
    arrays = TrainState(*(source.saved_values(part) for part in TrainState._fields))
    host = source.train_state
    targets = [build("Trainer", not source_fsdp, 2, dropout=0.0) for _ in range(2)]
    targets[0].restore(arrays)
    targets[1].restore(host)
    assert_trees_close(targets[0].train_state, host, rtol=0, atol=0)
    losses = [float(t.one_step(batch, jax.random.key(1))[0]) for t in targets]
    assert losses[0] == losses[1]
    source.one_step(batch, jax.random.key(1))  # The source's buffers were not aliased.


def test_a_user_mesh_with_its_own_axis_name_shards_the_same_way():
    batch = make_batch()
    mesh = Mesh(np.array(jax.local_devices()[:4]), ("data",))
    by_mesh = build("Trainer", True, mesh=mesh)
    by_count = build("Trainer", True, 4)
    assert by_mesh.n_devices == 4
    losses = [float(t.one_step(batch, jax.random.key(0))[0]) for t in (by_mesh, by_count)]
    assert losses[0] == losses[1]
    assert by_mesh.device_footprint() == by_count.device_footprint()


def test_fsdp_must_be_a_bool():
    with pytest.raises(TypeError, match=r"fsdp=1"):
        Trainer(tl.Serial(tl.blocks_to_layers(*blocks_and_loss())), adam, fsdp=1)


def test_an_optimizer_state_without_arrays_to_shard_still_works():
    """SGD without momentum has no slots of the weights' shapes; only counters."""
    batch = make_batch()
    sgd = lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)  # noqa: E731
    plain, sharded = (build("Trainer", f, 4, sgd, dropout=0.0) for f in (False, True))
    for trainer in (plain, sharded):
        trainer.one_step(batch, jax.random.key(0))
    assert_trees_close(sharded.weights, plain.weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fsdp", [False, True])
def test_the_layer_objects_weights_are_copied_not_donated(fsdp):
    blocks, loss = model = blocks_and_loss(0.0)
    before = jax.tree.map(np.array, tl.Serial(tl.blocks_to_layers(blocks, loss)).weights)
    trainer = build("Trainer", fsdp, 4, model=model)
    trainer.one_step(make_batch(), jax.random.key(0))
    after = tl.Serial(tl.blocks_to_layers(blocks, loss)).weights
    assert_trees_close(jax.tree.map(np.asarray, after), before, rtol=0, atol=0)


def test_gathering_shard_map_reads_the_sequence_length_from_the_stack_it_is_given():
    """The length-bearing argument is named by the caller (``stack``), not the first field:
    here it is the second one, and its per-device block is what the body runs inside."""
    Args = collections.namedtuple("Args", "scale stack")
    seen = []

    def stack(args):
        seen.append(jax.tree.map(np.shape, args.stack))
        return args.stack

    run, _ = gathering_shard_map(lambda a, w, i: a.stack * a.scale * w, Placement.resolve(1),
                                 DEV, with_grads=False, stack=stack)
    out = run(Args(jnp.ones((1, 1)), jnp.ones((1, 2, 3, 4))), jnp.float32(2.0),
              jnp.int32(0))
    assert seen == [(1, 2, 3, 4)] and float(out.sum()) == 48.0
