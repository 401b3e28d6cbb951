"""Tests for revtrain.parallel.batches."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from revtrain.parallel import batches


def weight_totals_by_device(batch, n_devices: int) -> np.ndarray:
    """The host oracle of `revtrain.parallel.batches.device_weight_total`: the total of
    each device's batch weights, float32 ``[n_devices]``.

    A batch ``(inputs, targets, weights, ...)`` carries per-position loss weights (a 0/1
    padding mask, Trax's convention) as its third item; device ``d`` gets rows
    ``[d * batch // n_devices, (d + 1) * batch // n_devices)`` and its total is the sum of
    those rows' weights. A batch of fewer than three items has no weights: each device's
    total is its row count. The trainers weight each device's loss by its total over the
    global sum (`revtrain.trainers.common.global_loss.loss_share`), so the loss is the
    weighted mean over the global batch however it is split: ``sum(w * loss) / sum(w)``,
    the same number as on one device. A weights item broadcast to the targets' shape counts
    each weight the same number of times on every device, so its ratio of totals is
    unchanged.

    Args:
      batch: a tuple of arrays with a leading batch axis divisible by ``n_devices``.
      n_devices: number of devices (this process's, under ``jax.distributed``).

    Raises:
      ValueError: as `reshape_by_device`, for a batch that does not split.
    """
    items = tuple(batch)
    if len(items) < 3:
        rows = np.shape(jax.tree.leaves(batches.reshape_by_device(items, n_devices))[0])[1]
        return np.full((n_devices,), rows, np.float32)
    weights = batches.reshape_by_device(np.asarray(items[2]), n_devices)
    return weights.reshape(n_devices, -1).sum(axis=1, dtype=np.float64).astype(np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
def test_device_weight_total_is_each_devices_share_of_the_mask(dtype):
    mask = (np.arange(24).reshape(8, 3) % 5 != 0).astype(dtype)
    batch = (np.zeros((8, 3), np.int32), np.zeros((8, 3), np.int32), mask)
    mesh = Mesh(np.array(jax.devices()[:4]), ("batch",))
    totals = jax.jit(jax.shard_map(
        lambda w: batches.device_weight_total(w[0], "batch")[None], mesh=mesh,
        in_specs=P("batch"), out_specs=P("batch")))(batches.reshape_by_device(mask, 4))
    np.testing.assert_array_equal(np.asarray(totals), weight_totals_by_device(batch, 4))


def test_reshape_by_device_splits_the_leading_axis():
    x = {"a": np.arange(24).reshape(8, 3), "b": np.arange(8)}
    y = batches.reshape_by_device(x, 4)
    assert y["a"].shape == (4, 2, 3) and y["b"].shape == (4, 2)
    np.testing.assert_array_equal(y["a"][1], x["a"][2:4])


def test_reshape_by_device_names_both_numbers():
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by n_devices=4"):
        batches.reshape_by_device(np.zeros((6, 2)), 4)


def test_weight_totals_by_device_sums_each_devices_mask_rows():
    mask = np.ones((8, 3), np.float32)
    mask[0] = 0
    mask[7, 1:] = 0
    batch = (np.zeros((8, 3), np.int32), np.zeros((8, 3), np.int32), mask)
    np.testing.assert_array_equal(weight_totals_by_device(batch, 4), [3, 6, 6, 4])
    np.testing.assert_array_equal(weight_totals_by_device(batch, 1), [19])
    assert weight_totals_by_device(batch, 4).dtype == np.float32


def test_weight_totals_by_device_without_weights_counts_rows():
    batch = (np.zeros((8, 3)), np.zeros((8,)))
    np.testing.assert_array_equal(weight_totals_by_device(batch, 2), [4, 4])
    with pytest.raises(ValueError, match="not divisible by n_devices=3"):
        weight_totals_by_device(batch, 3)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_for_n_devices_uses_n(n):
    y = batches.for_n_devices({"w": np.ones((2, 3))}, n)
    assert y["w"].shape == (n, 2, 3)
