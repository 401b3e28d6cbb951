"""Tests for revtrain.data.synthetic: the copy task and random sequences."""

import itertools

import numpy as np
import pytest

from revtrain.data import CopyTask, SyntheticSequences, synthetic


def _take(stream, n):
    return list(itertools.islice(stream, n))


def _copy_task(**kwargs):
    kwargs = {
        "vocab_size": 7,
        "length": 5,
        "batch_size": 8,
        "process_index": 0,
        "process_count": 1,
        **kwargs,
    }
    return synthetic.CopyTask(**kwargs)


def _assert_batches_equal(a, b):
    for batch_a, batch_b in zip(a, b, strict=True):
        for x, y in zip(batch_a, batch_b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_copy_task_layout():
    n = 5
    for inputs, targets, weights in _take(_copy_task().train_stream(), 3):
        assert inputs.shape == targets.shape == weights.shape == (8, 2 * n)
        assert (inputs.dtype, targets.dtype, weights.dtype) == (np.int32, np.int32, np.float32)
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])  # The data shifts.
        assert np.all((inputs[:, :n] >= 1) & (inputs[:, :n] < 7))
        assert np.all(inputs[:, n] == 0) and np.all(targets[:, n - 1] == 0)
        np.testing.assert_array_equal(weights[:, :n], 0)
        np.testing.assert_array_equal(weights[:, n:], 1)
        # Where weights are 1 the target is the first copy, token for token.
        np.testing.assert_array_equal(targets[:, n:], inputs[:, :n])


def test_copy_task_uses_the_whole_vocabulary_except_the_separator():
    inputs = np.concatenate([b[0] for b in _take(_copy_task().train_stream(), 10)])
    assert set(np.unique(inputs[:, :5]).tolist()) == set(range(1, 7))


@pytest.mark.parametrize("cls", [synthetic.CopyTask, synthetic.SyntheticSequences])
def test_deterministic_resumable_and_eval_separate(cls):
    def make(**kwargs):
        return cls(
            vocab_size=11, length=6, batch_size=4, process_index=0, process_count=1, **kwargs
        )

    full = _take(make().train_stream(), 6)
    _assert_batches_equal(full, _take(make().train_stream(), 6))
    _assert_batches_equal(full[4:], _take(make().train_stream(start_step=4), 2))
    assert not np.array_equal(full[0][0], full[1][0])
    assert not np.array_equal(full[0][0], _take(make(seed=3).train_stream(), 1)[0][0])
    evals = _take(make().eval_stream(), 3)
    _assert_batches_equal(evals, _take(make().eval_stream(), 3))
    assert not np.array_equal(evals[0][0], full[0][0])


@pytest.mark.parametrize("cls", [synthetic.CopyTask, synthetic.SyntheticSequences])
@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_concatenate_to_the_global_batch(cls, process_count):
    def make(index, count):
        return cls(vocab_size=9, length=3, batch_size=8, process_index=index, process_count=count)

    expected = _take(make(0, 1).train_stream(start_step=2), 2)
    parts = [
        _take(make(i, process_count).train_stream(start_step=2), 2) for i in range(process_count)
    ]
    for step in range(2):
        for k in range(3):
            joined = np.concatenate([p[step][k] for p in parts])
            np.testing.assert_array_equal(joined, expected[step][k])
            assert parts[-1][step][k].shape[0] == 8 // process_count


def test_synthetic_sequences_shapes_and_range():
    ds = synthetic.SyntheticSequences(
        vocab_size=3, length=20, batch_size=16, process_index=0, process_count=1
    )
    inputs, targets, weights = next(ds.train_stream())
    assert inputs.shape == targets.shape == weights.shape == (16, 20)
    assert (inputs.dtype, targets.dtype, weights.dtype) == (np.int32, np.int32, np.float32)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    assert set(np.unique(inputs).tolist()) == {0, 1, 2}
    assert np.all(weights == 1)
    assert ds.vocab_size == 3 and ds.n_classes is None


def test_defaults_use_the_jax_process():
    inputs, _, _ = next(synthetic.CopyTask().train_stream())
    assert inputs.shape == (8, 32)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"vocab_size": 1}, "vocab_size=1"),
        ({"length": 0}, "length=0"),
        ({"batch_size": 6, "process_count": 4}, "batch_size 6 is not divisible by process_count=4"),
    ],
)
def test_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        _copy_task(**kwargs)



# --------------------------------------------------------------------------------------
# Edge cases (bad input, odd sizes).

@pytest.mark.parametrize("make", [CopyTask, SyntheticSequences])
def test_negative_seed_is_rejected_at_construction_not_at_the_first_batch(make):
    with pytest.raises(ValueError, match=r"seed=-1 must be >= 0"):
        make(seed=-1, process_index=0, process_count=1)


def test_vocab_beyond_int32_ids_is_rejected():
    with pytest.raises(ValueError, match=r"vocab_size=4294967296 does not fit int32"):
        SyntheticSequences(vocab_size=2**32, process_index=0, process_count=1)
    stream = SyntheticSequences(vocab_size=2**31, length=3, batch_size=2, process_index=0,
                                process_count=1).train_stream()
    inputs, _, _ = next(stream)
    assert inputs.min() >= 0
