"""Tests for revtrain.parallel.transfers."""

import jax
import numpy as np
import pytest

from revtrain.parallel import transfers
from revtrain.parallel.placement import Placement


def test_on_accelerator_rejects_a_missing_device():
    with pytest.raises(ValueError, match=r"device index 9 does not exist"):
        transfers.on_accelerator(np.ones(2), 9)
    y = transfers.on_accelerator(np.ones(2), 1)
    assert y.devices() == {jax.local_devices()[1]}


def test_on_cpu_gives_numpy():
    assert isinstance(transfers.on_cpu({"a": jax.numpy.ones(2)})["a"], np.ndarray)


def test_put_batched_gives_each_leaf_its_sharding_and_value():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    tree = {"w": np.arange(32, dtype=np.float32).reshape(8, 4), "b": np.ones(3, np.float32),
            "count": np.int32(7)}
    shardings = {"w": NamedSharding(mesh, P("fsdp")), "b": NamedSharding(mesh, P()),
                 "count": NamedSharding(mesh, P())}
    put = transfers.put_batched(tree, shardings)
    assert jax.tree.structure(put) == jax.tree.structure(tree)
    for name, array in put.items():
        assert array.sharding == shardings[name]
        np.testing.assert_array_equal(np.asarray(array), tree[name])
    assert {s.data.shape for s in put["w"].addressable_shards} == {(2, 4)}


def test_shard_per_device_puts_a_tree_row_by_row():
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    tree = (np.arange(8.0).reshape(4, 2), {"s": np.arange(4)})
    put = transfers.shard_per_device(tree, Placement(mesh))
    for got, want in zip(jax.tree.leaves(put), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert [s.data.shape[0] for s in got.addressable_shards] == [1, 1, 1, 1]


def test_local_rows_reads_a_mixed_tree_in_row_order():
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    host = {"a": np.arange(8.0).reshape(4, 2), "b": np.arange(4, dtype=np.int32)}
    tree = (transfers.shard_per_device(host, Placement(mesh)), np.ones(3), ())
    rows = transfers.local_rows(tree)
    assert jax.tree.structure(rows) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(rows), jax.tree.leaves((host, np.ones(3))),
                         strict=True):
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, want)
