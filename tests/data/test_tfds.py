"""Tests for revtrain.data.tfds on TFDS mock data (no network, no downloads)."""

import itertools
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # Before TensorFlow is first imported.

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from revtrain.data import tfds as tfds_lib  # noqa: E402

LENGTH = 8
N_EXAMPLES = 8


@pytest.fixture(scope="module")
def tfds():
    module = pytest.importorskip("tensorflow_datasets")
    with module.testing.mock_data(num_examples=N_EXAMPLES):
        yield module


def _take(stream, n):
    return list(itertools.islice(stream, n))


def _assert_batches_equal(a, b):
    for batch_a, batch_b in zip(a, b, strict=True):
        for x, y in zip(batch_a, batch_b, strict=True):
            np.testing.assert_array_equal(x, y)


def _text(**kwargs):
    kwargs = {
        "sequence_length": LENGTH,
        "batch_size": 4,
        "shuffle_buffer": 16,
        "process_index": 0,
        "process_count": 1,
        **kwargs,
    }
    return tfds_lib.TFDS("lm1b", **kwargs)


def _images(name="mnist", **kwargs):
    kwargs = {
        "batch_size": 4,
        "shuffle_buffer": 16,
        "process_index": 0,
        "process_count": 1,
        **kwargs,
    }
    return tfds_lib.TFDS(name, **kwargs)


def _expected_windows(texts, length):
    """Windows of `length + 1` bytes advancing by `length`, zero-padded, with masks."""
    windows, masks = [], []
    for data in texts:
        for start in range(0, max(len(data) - 1, 0), length):
            chunk = list(data[start : start + length + 1])
            pad = length + 1 - len(chunk)
            windows.append(chunk + [0] * pad)
            masks.append([1] * len(chunk) + [0] * pad)
    return np.array(windows), np.array(masks)


def test_text_eval_stream_is_the_split_cut_into_padded_windows(tfds):
    ds = _text()
    assert (ds.keys, ds.vocab_size, ds.n_classes, ds.eval_split) == (("text",), 256, None, "test")
    texts = [ex["text"] for ex in tfds.as_numpy(tfds.load("lm1b", split="test"))]
    windows, masks = _expected_windows(texts, LENGTH)
    assert masks.min() == 0, "mock texts should need padding"
    n_batches = len(windows) // 4 + 2  # Runs past the end of the split into its start.
    batches = _take(ds.eval_stream(), n_batches)
    inputs, targets, weights = (np.concatenate(parts) for parts in zip(*batches, strict=True))
    cycled = np.resize(np.arange(len(windows)), len(inputs))  # Window ids, repeating.
    np.testing.assert_array_equal(inputs, windows[cycled, :-1])
    np.testing.assert_array_equal(targets, windows[cycled, 1:])
    np.testing.assert_array_equal(weights, masks[cycled, 1:])
    assert (inputs.dtype, targets.dtype, weights.dtype) == (np.int32, np.int32, np.float32)
    _assert_batches_equal(batches, _take(ds.eval_stream(), n_batches))  # Restarts.


def test_text_train_batches(tfds):
    for inputs, targets, weights in _take(_text().train_stream(), 5):
        assert inputs.shape == targets.shape == weights.shape == (4, LENGTH)
        assert inputs.dtype == targets.dtype == np.int32 and weights.dtype == np.float32
        assert 0 <= inputs.min() and targets.max() < 256
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
        assert set(np.unique(weights).tolist()) <= {0.0, 1.0}
        assert np.all(np.diff(weights, axis=1) <= 0), "padding only at the end of a window"
        assert np.all(weights[:, 0] == 1), "every window scores at least one real byte"
        np.testing.assert_array_equal(targets[weights == 0], 0)


def test_train_stream_is_deterministic_and_resumes_at_start_step(tfds):
    full = _take(_text().train_stream(), 6)
    _assert_batches_equal(full, _take(_text().train_stream(), 6))
    _assert_batches_equal(full[3:], _take(_text().train_stream(start_step=3), 3))
    images = _take(_images().train_stream(), 4)
    _assert_batches_equal(images[2:], _take(_images().train_stream(start_step=2), 2))


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_concatenate_to_the_global_batch(tfds, process_count):
    for make in (_text, _images):
        expected = _take(make(batch_size=8).train_stream(start_step=1), 2)
        parts = [
            _take(
                make(batch_size=8, process_index=i, process_count=process_count).train_stream(
                    start_step=1
                ),
                2,
            )
            for i in range(process_count)
        ]
        for step in range(2):
            for k in range(3):
                assert parts[0][step][k].shape[0] == 8 // process_count
                joined = np.concatenate([p[step][k] for p in parts])
                np.testing.assert_array_equal(joined, expected[step][k])


def test_image_batches(tfds):
    ds = _images()
    assert (ds.keys, ds.vocab_size, ds.n_classes) == (("image", "label"), None, 10)
    raw = next(iter(tfds.as_numpy(tfds.load("mnist", split="test"))))
    for inputs, targets, weights in [next(ds.train_stream()), next(ds.eval_stream())]:
        assert inputs.shape == (4, 28, 28, 1) and inputs.dtype == np.float32
        assert 0.0 <= inputs.min() and inputs.max() <= 1.0 and inputs.max() > 0.5
        assert targets.shape == (4,) and targets.dtype == np.int32
        assert np.all((0 <= targets) & (targets < 10))
        assert weights.shape == (4,) and weights.dtype == np.float32 and np.all(weights == 1)
    inputs, targets, _ = next(ds.eval_stream())  # Unshuffled: the split's first example.
    np.testing.assert_allclose(inputs[0], raw["image"] / 255.0, rtol=1e-6)
    assert targets[0] == raw["label"]


def test_keys_are_detected(tfds):
    assert _images("cifar10").keys == ("image", "label")  # Also has a Text 'id' feature.
    assert _text().keys == ("text",)
    pg19 = tfds_lib.TFDS("pg19", sequence_length=LENGTH, process_index=0, process_count=1)
    assert pg19.keys == ("book_text",)
    explicit = _text(keys=("text",), eval_split="train[:2]")
    assert explicit.eval_split == "train[:2]"
    assert next(explicit.eval_stream())[0].shape == (4, LENGTH)


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: _text(sequence_length=None), "sequence_length=None"),
        (lambda: _images(sequence_length=8), "sequence_length=8"),
        (lambda: _text(keys=("a", "b", "c")), "keys="),
        (lambda: _text(batch_size=6, process_count=4), "batch_size 6 is not divisible"),
    ],
)
def test_bad_arguments(tfds, make, fragment):
    with pytest.raises(ValueError, match=fragment):
        make()


def test_negative_start_step(tfds):
    with pytest.raises(ValueError, match="start_step=-2"):
        _text().train_stream(start_step=-2)


def test_default_eval_split_prefers_validation():
    assert tfds_lib._default_eval_split(["train", "validation", "test"]) == "validation"
    assert tfds_lib._default_eval_split(["train", "test"]) == "test"


def test_missing_tensorflow_datasets_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # Import now fails.
    with pytest.raises(ImportError, match=r"pip install revtrain\[tfds\]"):
        tfds_lib.TFDS("mnist", process_index=0, process_count=1)


def test_text_with_a_sentencepiece_tokenizer_is_cut_into_windows_of_its_ids(tfds):
    from revtrain.data import trained_sentencepiece

    tokenizer = trained_sentencepiece(vocab_size=400)
    ds = _text(tokenizer=tokenizer)
    assert (ds.vocab_size, ds.byte_level, ds.tokenizer) == (400, False, tokenizer)
    texts = [ex["text"] for ex in tfds.as_numpy(tfds.load("lm1b", split="test"))]
    windows, masks = _expected_windows([tokenizer.encode(t) for t in texts], LENGTH)
    batches = _take(ds.eval_stream(), len(windows) // 4)
    inputs, targets, weights = (np.concatenate(parts) for parts in zip(*batches, strict=True))
    np.testing.assert_array_equal(inputs, windows[:len(inputs), :-1])
    np.testing.assert_array_equal(weights, masks[:len(inputs), 1:])
    assert inputs.max() < 400
    with pytest.raises(ValueError, match=r"TFDS.tokenizer=.* applies to text only"):
        _images(tokenizer=tokenizer)
