"""Tests for revtrain.data.batching: process slices, step generators, LM windows."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from revtrain.data import batching, lm_batch
from revtrain.data.batching import check_seed


def test_rows_are_contiguous_slices_of_the_global_batch():
    shards = [batching.ProcessSlice(12, i, 3) for i in range(3)]
    assert [s.local_batch_size for s in shards] == [4, 4, 4]
    assert [s.rows for s in shards] == [slice(0, 4), slice(4, 8), slice(8, 12)]


@settings(max_examples=40, deadline=None)
@given(
    process_count=st.integers(1, 8),
    per_process=st.integers(1, 5),
    width=st.integers(1, 4),
)
def test_concatenated_process_slices_equal_the_global_batch(process_count, per_process, width):
    batch_size = process_count * per_process
    global_batch = (
        np.arange(batch_size * width).reshape(batch_size, width),
        np.arange(batch_size) * 10,
    )
    parts = [
        batching.ProcessSlice(batch_size, i, process_count).take(global_batch)
        for i in range(process_count)
    ]
    for k, array in enumerate(global_batch):
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), array)
        assert all(p[k].shape[0] == per_process for p in parts)


def test_indivisible_batch_names_both_numbers_and_the_fix():
    with pytest.raises(ValueError) as info:
        batching.ProcessSlice(6, 0, 4)
    message = str(info.value)
    assert "batch_size 6" in message and "process_count=4" in message
    assert "multiple of 4" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((8, 4, 4), "process_index=4"),
        ((8, -1, 4), "process_index=-1"),
        ((0, 0, 1), "batch_size=0"),
        ((8, 0, 0), "process_count=0"),
    ],
)
def test_bad_process_arguments(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        batching.ProcessSlice(*args)


def test_create_defaults_to_the_jax_process():
    import jax

    shard = batching.ProcessSlice.create(4)
    assert (shard.process_index, shard.process_count) == (
        jax.process_index(),
        jax.process_count(),
    )
    explicit = batching.ProcessSlice.create(4, process_index=1, process_count=2)
    assert explicit == batching.ProcessSlice(4, 1, 2)


def test_step_rng_is_deterministic_and_separates_steps_and_streams():
    def draw(seed, stream, step):
        return batching.step_rng(seed, stream, step).integers(1 << 30, size=4)

    np.testing.assert_array_equal(draw(0, 0, 5), draw(0, 0, 5))
    assert not np.array_equal(draw(0, 0, 5), draw(0, 0, 6))
    assert not np.array_equal(draw(0, 0, 5), draw(0, 1, 5))
    assert not np.array_equal(draw(0, 0, 5), draw(1, 0, 5))


def test_indexed_stream_starts_at_start_step_and_passes_rows():
    calls = []

    def batch_fn(step, rows):
        calls.append((step, rows))
        return (np.array([step]),) * 3

    stream = batching.indexed_stream(batch_fn, slice(2, 4), start_step=7)
    steps = [int(b[0][0]) for b in itertools.islice(stream, 3)]
    assert steps == [7, 8, 9]
    assert calls[0] == (7, slice(2, 4))
    with pytest.raises(ValueError, match="start_step=-1"):
        next(batching.indexed_stream(batch_fn, slice(0, 1), start_step=-1))


def test_lm_batch_shifts_windows_and_masks_padded_targets():
    windows = np.array([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool)
    inputs, targets, weights = batching.lm_batch(windows, mask)
    np.testing.assert_array_equal(inputs, [[5, 6, 7], [9, 10, 0]])
    np.testing.assert_array_equal(targets, [[6, 7, 8], [10, 0, 0]])
    np.testing.assert_array_equal(weights, [[1, 1, 1], [1, 0, 0]])
    assert (inputs.dtype, targets.dtype, weights.dtype) == (np.int32, np.int32, np.float32)


def test_lm_batch_without_mask_weights_everything():
    _, targets, weights = batching.lm_batch(np.arange(6).reshape(2, 3))
    assert weights.shape == targets.shape == (2, 2)
    assert weights.dtype == np.float32 and np.all(weights == 1)



# --------------------------------------------------------------------------------------
# Edge cases (bad input, odd sizes).

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
