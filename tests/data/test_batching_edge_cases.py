"""Edge cases of revtrain.data.batching: malformed windows and masks, negative seeds."""
import numpy as np
import pytest

from revtrain.data import lm_batch
from revtrain.data.batching import check_seed


@pytest.mark.parametrize("windows,mask,message", [
    (np.zeros(5, np.int64), None, r"must be \[batch, length \+ 1\] with length >= 1; got "
                                  r"shape \(5,\)"),
    (np.zeros((2, 1), np.int64), None, r"got shape \(2, 1\)"),
    (np.full((2, 3), 2.7), None, r"must hold integer ids; got float64"),
    (np.zeros((2, 3), np.int64), np.ones((2, 2)), r"mask of shape \(2, 2\) does not match "
                                                  r"windows of shape \(2, 3\)"),
])
def test_malformed_windows_or_mask_are_rejected(windows, mask, message):
    with pytest.raises(ValueError, match=message):
        lm_batch(windows, mask)


def test_uint8_windows_and_bool_mask_still_work():
    inputs, targets, weights = lm_batch(np.array([[1, 2, 3]], np.uint8),
                                        np.array([[True, True, False]]))
    np.testing.assert_array_equal(inputs, [[1, 2]])
    np.testing.assert_array_equal(targets, [[2, 3]])
    np.testing.assert_array_equal(weights, [[1.0, 0.0]])
    assert inputs.dtype == np.int32 and weights.dtype == np.float32


def test_negative_seed_is_rejected_when_built():
    assert check_seed(np.int64(3)) == 3
    with pytest.raises(ValueError, match=r"seed=-1 must be >= 0"):
        check_seed(-1)
