import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from revtrain.trainers import devices


def test_reshape_by_device_splits_the_leading_axis():
    x = {"a": np.arange(24).reshape(8, 3), "b": np.arange(8)}
    y = devices.reshape_by_device(x, 4)
    assert y["a"].shape == (4, 2, 3) and y["b"].shape == (4, 2)
    np.testing.assert_array_equal(y["a"][1], x["a"][2:4])


def test_reshape_by_device_names_both_numbers():
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by n_devices=4"):
        devices.reshape_by_device(np.zeros((6, 2)), 4)


def test_weight_totals_by_device_sums_each_devices_mask_rows():
    mask = np.ones((8, 3), np.float32)
    mask[0] = 0
    mask[7, 1:] = 0
    batch = (np.zeros((8, 3), np.int32), np.zeros((8, 3), np.int32), mask)
    np.testing.assert_array_equal(devices.weight_totals_by_device(batch, 4), [3, 6, 6, 4])
    np.testing.assert_array_equal(devices.weight_totals_by_device(batch, 1), [19])
    assert devices.weight_totals_by_device(batch, 4).dtype == np.float32


def test_weight_totals_by_device_without_weights_counts_rows():
    batch = (np.zeros((8, 3)), np.zeros((8,)))
    np.testing.assert_array_equal(devices.weight_totals_by_device(batch, 2), [4, 4])
    with pytest.raises(ValueError, match="not divisible by n_devices=3"):
        devices.weight_totals_by_device(batch, 3)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_for_n_devices_uses_n(n):
    y = devices.for_n_devices({"w": np.ones((2, 3))}, n)
    assert y["w"].shape == (n, 2, 3)


def test_per_device_rngs_one_device_is_a_plain_split():
    rng = jax.random.key(3)
    keys = devices.per_device_rngs(rng, 1, 5)
    np.testing.assert_array_equal(keys[0], jax.random.key_data(jax.random.split(rng, 5)))


def test_per_device_rngs_split_by_device_then_layer():
    rng = jax.random.key(3)
    keys = devices.per_device_rngs(rng, 4, 3)
    assert keys.shape[:2] == (4, 3)
    by_device = jax.random.split(rng, 4)
    for d in range(4):
        np.testing.assert_array_equal(
            keys[d], jax.random.key_data(jax.random.split(by_device[d], 3)))


def test_per_device_rngs_of_one_process_are_its_rows_of_the_global_split():
    rng = jax.random.key(5)
    global_keys = devices.per_device_rngs(rng, 4, 3)
    for process_index in range(2):
        local = devices.per_device_rngs(rng, 2, 3, process_index=process_index,
                                        process_count=2)
        np.testing.assert_array_equal(local, global_keys[2 * process_index:
                                                         2 * process_index + 2])


def test_local_rows_round_trips_per_device_values():
    mesh = devices.make_mesh(4)
    x = np.arange(8.0).reshape(4, 2)
    np.testing.assert_array_equal(devices.local_rows(devices.shard_per_device(x, mesh)), x)


def test_replicate_copies_and_unreplicate_round_trips():
    mesh = devices.make_mesh(4)
    x = jax.numpy.arange(6.0)
    r = devices.replicate({"x": x}, mesh)
    assert len(r["x"].addressable_shards) == 4
    r["x"].delete()
    assert not x.is_deleted()
    np.testing.assert_array_equal(devices.unreplicate(devices.replicate(x, mesh)), np.arange(6.0))


def test_on_accelerator_rejects_a_missing_device():
    with pytest.raises(ValueError, match=r"device index 9 does not exist"):
        devices.on_accelerator(np.ones(2), 9)
    y = devices.on_accelerator(np.ones(2), 1)
    assert y.devices() == {jax.local_devices()[1]}


def test_on_cpu_gives_numpy():
    assert isinstance(devices.on_cpu({"a": jax.numpy.ones(2)})["a"], np.ndarray)


def test_make_mesh_rejects_too_many_devices():
    with pytest.raises(ValueError, match=r"n_devices=9 but this process has 4 devices"):
        devices.make_mesh(9)


def test_check_same_structure_names_the_first_mismatching_path():
    with pytest.raises(ValueError, match=r"\['b'\]"):
        devices.check_same_structure({"a": 1.0, "c": 2.0}, {"a": 1.0, "b": 2.0}, "slots")
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        devices.check_same_structure({"a": np.ones(3)}, {"a": np.ones(2)}, "weights")


# --- FSDP layout and user meshes --------------------------------------------------------


@pytest.mark.parametrize("shape,n,expected", [
    ((64, 128), 4, P(None, devices.BATCH_AXIS)),   # largest divisible dim
    ((128, 64), 4, P(devices.BATCH_AXIS)),
    ((128, 128), 4, P(devices.BATCH_AXIS)),        # tie: first dim
    ((130, 64), 4, P(None, devices.BATCH_AXIS)),   # 130 not divisible, 64 is
    ((33, 35), 4, P()),                            # nothing divisible
    ((16,), 4, P()),                               # too small
    ((), 4, P()),                                  # scalar
    ((64, 128), 1, P()),                           # one shard
])
def test_fsdp_spec_splits_the_largest_divisible_dimension(shape, n, expected):
    assert devices.fsdp_spec(shape, n) == expected


def test_value_shardings_and_put_sharded_hold_one_slice_per_device():
    mesh = devices.make_mesh(4)
    tree = {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
            "b": np.ones(8, np.float32)}
    shardings = devices.value_shardings(tree, mesh, fsdp=True)
    put = devices.put_sharded(tree, shardings)
    assert [s.data.shape for s in put["w"].addressable_shards] == [(16, 32)] * 4
    assert [s.data.shape for s in put["b"].addressable_shards] == [(8,)] * 4
    np.testing.assert_array_equal(np.asarray(put["w"]), tree["w"])
    replicated = devices.value_shardings(tree, mesh, fsdp=False)
    assert all(s.spec == P() for s in jax.tree.leaves(replicated))


def test_resolve_mesh_accepts_a_one_axis_user_mesh():
    user = Mesh(np.array(jax.devices()[:2]), ("data",))
    mesh, n = devices.resolve_mesh(None, user)
    assert n == 2 and mesh.axis_names == (devices.BATCH_AXIS,)
    assert list(mesh.devices.flat) == list(user.devices.flat)
    assert devices.resolve_mesh(2, user)[1] == 2


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
        devices.resolve_mesh(n, arg)


def test_structure_mismatch_names_both_paths_and_the_trainer_kind_for_slots():
    with pytest.raises(ValueError, match=r"at slots\[0\]\['x'\]: expected that path, got "
                                         r"slots\['x'\]; values from another kind of trainer"):
        devices.check_same_structure({"x": np.zeros(2)}, ({"x": np.zeros(2)},), "slots")


def test_put_sharded_gives_strongly_typed_copies():
    """optax leaves the hyperparameters of a layer without weights weak-typed; the stores'
    copies must not be, or the first steps would retrace what was compiled ahead."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("batch",))
    weak = jax.numpy.asarray(0.9)
    assert weak.weak_type
    put = devices.put_sharded({"b1": weak}, devices.value_shardings({"b1": weak}, mesh, False))
    assert not put["b1"].weak_type
    assert float(put["b1"]) == pytest.approx(0.9)
    assert (put["b1"].addressable_shards[0].data.unsafe_buffer_pointer()
            != weak.unsafe_buffer_pointer())
