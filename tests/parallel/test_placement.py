"""Tests for revtrain.parallel.placement."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from revtrain.parallel import placement, transfers


def test_local_rows_round_trips_per_device_values():
    mesh = placement.make_mesh(4)
    x = np.arange(8.0).reshape(4, 2)
    np.testing.assert_array_equal(transfers.local_rows(
        transfers.shard_per_device(x, placement.Placement(mesh))), x)


def test_replicate_copies_and_unreplicate_round_trips():
    mesh = placement.make_mesh(4)
    x = jax.numpy.arange(6.0)
    r = transfers.replicate({"x": x}, mesh)
    assert len(r["x"].addressable_shards) == 4
    r["x"].delete()
    assert not x.is_deleted()
    np.testing.assert_array_equal(transfers.unreplicate(transfers.replicate(x, mesh)),
                                  np.arange(6.0))


def test_make_mesh_rejects_too_many_devices():
    with pytest.raises(ValueError, match=r"n_devices=9 but this process has 4 devices"):
        placement.make_mesh(9)


@pytest.mark.parametrize("shape,n,expected", [
    ((64, 128), 4, P(None, placement.BATCH_AXIS)),   # largest divisible dim
    ((128, 64), 4, P(placement.BATCH_AXIS)),
    ((128, 128), 4, P(placement.BATCH_AXIS)),        # tie: first dim
    ((130, 64), 4, P(None, placement.BATCH_AXIS)),   # 130 not divisible, 64 is
    ((33, 35), 4, P()),                            # nothing divisible
    ((16,), 4, P()),                               # too small
    ((), 4, P()),                                  # scalar
    ((64, 128), 1, P()),                           # one shard
])
def test_fsdp_spec_splits_the_largest_divisible_dimension(shape, n, expected):
    assert placement.fsdp_spec(shape, n) == expected


def test_weight_shardings_and_put_sharded_hold_one_slice_per_device():
    mesh = placement.make_mesh(4)
    tree = {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
            "b": np.ones(8, np.float32)}
    shardings = placement.Placement(mesh, fsdp=True).weight_shardings(tree)
    put = transfers.put_sharded(tree, shardings)
    assert [s.data.shape for s in put["w"].addressable_shards] == [(16, 32)] * 4
    assert [s.data.shape for s in put["b"].addressable_shards] == [(8,)] * 4
    np.testing.assert_array_equal(np.asarray(put["w"]), tree["w"])
    replicated = placement.Placement(mesh).weight_shardings(tree)
    assert all(s.spec == P() for s in jax.tree.leaves(replicated))


def test_resolve_mesh_accepts_a_one_axis_user_mesh():
    user = Mesh(np.array(jax.devices()[:2]), ("data",))
    mesh, n = placement.resolve_mesh(None, user)
    assert n == 2 and mesh.axis_names == (placement.BATCH_AXIS,)
    assert list(mesh.devices.flat) == list(user.devices.flat)
    assert placement.resolve_mesh(2, user)[1] == 2


@pytest.mark.parametrize("bad,match", [
    ("mesh", "not a jax.sharding.Mesh"),
    ("2d", "one-axis mesh"),
    ("n", "pass only one"),
])
def test_resolve_mesh_rejects_bad_meshes(bad, match):
    if bad == "mesh":
        arg, n = "data", None
    elif bad == "2d":
        arg, n = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b")), None
    else:
        arg, n = Mesh(np.array(jax.devices()[:2]), ("data",)), 4
    with pytest.raises((ValueError, TypeError), match=match):
        placement.resolve_mesh(n, arg)


def test_put_sharded_gives_strongly_typed_copies():
    """optax leaves the hyperparameters of a layer without weights weak-typed; the stores'
    copies must not be, or the first steps would retrace what was compiled ahead."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("batch",))
    weak = jax.numpy.asarray(0.9)
    assert weak.weak_type
    shardings = placement.Placement(mesh).weight_shardings({"b1": weak})
    put = transfers.put_sharded({"b1": weak}, shardings)
    assert not put["b1"].weak_type
    assert float(put["b1"]) == pytest.approx(0.9)
    assert (put["b1"].addressable_shards[0].data.unsafe_buffer_pointer()
            != weak.unsafe_buffer_pointer())


def test_placement_resolve_names_the_axes_and_refuses_a_non_bool_fsdp():
    p = placement.Placement.resolve(n_devices=2, fsdp=True)
    assert p.n_devices == 2 and p.n_global_devices == 2
    assert p.batch_axes == (placement.BATCH_AXIS,) == p.weight_axes
    assert placement.Placement.resolve(n_devices=2).weight_axes == ()
    assert p.weight_spec((64, 128)) == P(None, placement.BATCH_AXIS)
    assert placement.Placement.resolve(n_devices=2).weight_spec((64, 128)) == P()
    with pytest.raises(TypeError, match=r"fsdp=1 must be True or False"):
        placement.Placement.resolve(fsdp=1)


def test_a_trainer_takes_a_placement_or_the_triple_but_not_both():
    import optax

    from revtrain import layers as tl
    from revtrain.trainers import Trainer
    from tests.trainers.conftest import make_batch, signature
    model = tl.Serial(tl.Embedding(16, 8), tl.Dense(16), tl.LogSoftmax(),
                      tl.CrossEntropyLoss())
    model.init(signature(make_batch()))
    p = placement.Placement.resolve(n_devices=2)
    trainer = Trainer(model, lambda: optax.sgd(0.1), placement=p)
    assert trainer.placement is p and trainer.n_devices == 2 and trainer.mesh is p.mesh
    with pytest.raises(ValueError, match=r"placement= was given with n_devices="):
        Trainer(model, lambda: optax.sgd(0.1), n_devices=2, placement=p)


def test_a_placement_is_built_from_its_mesh_alone():
    """``Placement(mesh)`` derives the device count and the weight layout from the mesh;
    the trainers' ``n_devices``/``mesh``/``fsdp`` route (`Placement.resolve`) gives the
    same placement."""
    named = jax.make_mesh((2, 2, 1), ("data", "fsdp", "seq"))
    built = placement.Placement(named)
    assert built.n_devices == 4 and built.fsdp and built.mesh.axis_names == (
        "data", "fsdp", "seq")
    resolved = placement.Placement.resolve(mesh=named)
    assert (resolved.n_devices, resolved.fsdp, resolved.mesh.shape) == (
        built.n_devices, built.fsdp, built.mesh.shape)
    one_axis = placement.Placement(Mesh(np.array(jax.devices()[:2]), ("data",)))
    assert (one_axis.n_devices, one_axis.fsdp, one_axis.mesh.axis_names) == (
        2, False, ("batch",))
    assert placement.Placement.resolve(n_devices=2, fsdp=True).fsdp
    with pytest.raises(TypeError, match="fsdp='yes' must be True, False or None"):
        placement.Placement(named, fsdp="yes")


def test_the_rows_mesh_counts_a_seq_group_once():
    seq = placement.Placement(jax.make_mesh((1, 1, 4), ("data", "fsdp", "seq")))
    assert seq.rows_mesh.axis_names == ("batch",) and seq.rows_mesh.devices.size == 1
    assert placement.Placement.resolve(n_devices=4).rows_mesh.devices.size == 4
