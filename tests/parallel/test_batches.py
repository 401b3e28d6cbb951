"""Tests for revtrain.parallel.batches."""

import numpy as np
import pytest

from revtrain.parallel import batches


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
    np.testing.assert_array_equal(batches.weight_totals_by_device(batch, 4), [3, 6, 6, 4])
    np.testing.assert_array_equal(batches.weight_totals_by_device(batch, 1), [19])
    assert batches.weight_totals_by_device(batch, 4).dtype == np.float32


def test_weight_totals_by_device_without_weights_counts_rows():
    batch = (np.zeros((8, 3)), np.zeros((8,)))
    np.testing.assert_array_equal(batches.weight_totals_by_device(batch, 2), [4, 4])
    with pytest.raises(ValueError, match="not divisible by n_devices=3"):
        batches.weight_totals_by_device(batch, 3)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_for_n_devices_uses_n(n):
    y = batches.for_n_devices({"w": np.ones((2, 3))}, n)
    assert y["w"].shape == (n, 2, 3)
