"""Tests for revtrain.data.text: byte-level LM streams over local files."""

import itertools

import numpy as np
import pytest

from revtrain.data import TextFiles, text

SEQUENCE_LENGTH = 16


def _take(stream, n):
    return list(itertools.islice(stream, n))


def _assert_batches_equal(a, b):
    for batch_a, batch_b in zip(a, b, strict=True):
        for x, y in zip(batch_a, batch_b, strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.fixture
def corpus_path(tmp_path):
    """A 4000-byte file of random bytes: every 17-byte window occurs once."""
    data = np.random.default_rng(1).integers(0, 256, size=4000, dtype=np.uint8).tobytes()
    path = tmp_path / "corpus.txt"
    path.write_bytes(data)
    return path


def _dataset(paths, **kwargs):
    kwargs = {
        "sequence_length": SEQUENCE_LENGTH,
        "batch_size": 4,
        "eval_fraction": 0.1,
        "process_index": 0,
        "process_count": 1,
        **kwargs,
    }
    return text.TextFiles(paths, **kwargs)


def _offset(corpus, window):
    offset = corpus.find(window.astype(np.uint8).tobytes())
    assert offset >= 0, "window is not a slice of the corpus"
    return offset


def test_train_batches_are_shifted_windows_of_the_train_part(corpus_path):
    ds = _dataset([corpus_path])
    corpus = corpus_path.read_bytes()
    assert len(ds.train_bytes) == 3600 and len(ds.eval_bytes) == 400
    assert ds.vocab_size == 256
    for inputs, targets, weights in _take(ds.train_stream(), 3):
        assert inputs.shape == targets.shape == weights.shape == (4, SEQUENCE_LENGTH)
        assert (inputs.dtype, targets.dtype, weights.dtype) == (np.int32, np.int32, np.float32)
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
        assert np.all(weights == 1)
        for row in range(4):
            window = np.concatenate([inputs[row], targets[row, -1:]])
            offset = _offset(corpus, window)
            assert offset + SEQUENCE_LENGTH + 1 <= 3600  # Inside the train part.


def test_eval_tiles_the_eval_part_and_restarts(corpus_path):
    ds = _dataset([corpus_path])
    corpus = corpus_path.read_bytes()
    n_windows = (400 - 1) // SEQUENCE_LENGTH  # 24 windows = 6 batches of 4.
    batches = _take(ds.eval_stream(), n_windows // 4 + 1)
    targets = np.concatenate([b[1] for b in batches])
    inputs = np.concatenate([b[0] for b in batches])
    scored = targets[:n_windows].reshape(-1)
    expected = np.frombuffer(corpus[3601 : 3601 + scored.size], np.uint8)
    np.testing.assert_array_equal(scored, expected)
    assert inputs[0, 0] == corpus[3600]
    np.testing.assert_array_equal(targets[n_windows:], targets[: len(targets) - n_windows])
    _assert_batches_equal(batches, _take(ds.eval_stream(), len(batches)))


def test_train_and_eval_byte_ranges_are_disjoint(corpus_path):
    ds = _dataset([corpus_path], batch_size=8)
    corpus = corpus_path.read_bytes()
    for inputs, targets, _ in _take(ds.eval_stream(), 4):
        for row in range(len(inputs)):
            window = np.concatenate([inputs[row], targets[row, -1:]])
            assert _offset(corpus, window) >= 3600
    train_ends = [
        _offset(corpus, np.concatenate([i[r], t[r, -1:]])) + SEQUENCE_LENGTH + 1
        for i, t, _ in _take(ds.train_stream(), 20)
        for r in range(len(i))
    ]
    assert max(train_ends) <= 3600


def test_train_stream_is_deterministic_and_resumes_at_start_step(corpus_path):
    ds = _dataset([corpus_path])
    full = _take(ds.train_stream(), 8)
    _assert_batches_equal(full, _take(_dataset([corpus_path]).train_stream(), 8))
    _assert_batches_equal(full[5:], _take(ds.train_stream(start_step=5), 3))
    other_seed = _take(_dataset([corpus_path], seed=1).train_stream(), 1)
    assert not np.array_equal(full[0][0], other_seed[0][0])
    assert not np.array_equal(full[0][0], full[1][0])


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_concatenate_to_the_global_batch(corpus_path, process_count):
    single = _dataset([corpus_path], batch_size=8)
    shards = [
        _dataset([corpus_path], batch_size=8, process_index=i, process_count=process_count)
        for i in range(process_count)
    ]
    for stream_name, start in (("train_stream", 3), ("eval_stream", None)):
        args = () if start is None else (start,)
        expected = _take(getattr(single, stream_name)(*args), 2)
        parts = [_take(getattr(s, stream_name)(*args), 2) for s in shards]
        for step in range(2):
            for k in range(3):
                assert parts[0][step][k].shape[0] == 8 // process_count
                joined = np.concatenate([p[step][k] for p in parts])
                np.testing.assert_array_equal(joined, expected[step][k])


def test_default_corpus_is_used_without_paths():
    corpus = text.default_corpus()
    assert len(corpus) > 400_000
    for paths in (None, []):
        ds = text.TextFiles(paths, batch_size=2, process_index=0, process_count=1)
        assert len(ds.train_bytes) + len(ds.eval_bytes) == len(corpus)
        assert ds.eval_bytes.tobytes() == corpus[-len(ds.eval_bytes) :]
    inputs, _, _ = next(ds.train_stream())
    assert inputs.shape == (2, 128)


def test_files_are_concatenated_in_order_and_single_paths_accepted(tmp_path):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("hello " * 10)
    second.write_text("wörld " * 10)
    both = _dataset([first, second], sequence_length=4, eval_fraction=0.0)
    assert both.train_bytes.tobytes() == first.read_bytes() + second.read_bytes()
    single = _dataset(str(first), sequence_length=4)
    assert single.train_bytes.tobytes() + single.eval_bytes.tobytes() == first.read_bytes()


def test_without_eval_part_eval_stream_raises(corpus_path):
    ds = _dataset([corpus_path], eval_fraction=0.0)
    assert len(ds.train_bytes) == 4000
    with pytest.raises(ValueError, match="eval_fraction"):
        ds.eval_stream()


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        _dataset([missing])


@pytest.mark.parametrize(
    "size, eval_fraction, fragment",
    [(10, 0.0, "train part has 10 bytes"), (200, 0.05, "eval part")],
)
def test_corpus_shorter_than_a_window_is_an_error(tmp_path, size, eval_fraction, fragment):
    path = tmp_path / "short.txt"
    path.write_bytes(b"x" * size)
    with pytest.raises(ValueError, match=fragment) as info:
        _dataset([path], eval_fraction=eval_fraction)
    assert "17 bytes" in str(info.value) and "smaller sequence_length" in str(info.value)


def test_indivisible_batch_size_is_an_error(corpus_path):
    with pytest.raises(ValueError, match="batch_size 6 is not divisible by process_count=4"):
        _dataset([corpus_path], batch_size=6, process_index=0, process_count=4)


@pytest.mark.parametrize("kwargs", [{"sequence_length": 0}, {"eval_fraction": 1.0}])
def test_bad_arguments(corpus_path, kwargs):
    with pytest.raises(ValueError):
        _dataset([corpus_path], **kwargs)


def test_eval_pass_scores_each_window_once_and_masks_the_padding(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(200)) * 2)
    data = text.TextFiles(paths=[str(path)], sequence_length=4, batch_size=4,
                          eval_fraction=0.1)
    n_windows = (len(data.eval_bytes) - 1) // 4  # 40 eval bytes: 9 windows.
    batches = list(data.eval_pass())
    assert len(batches) == 3 and all(b[0].shape == (4, 4) for b in batches)
    weights = np.concatenate([b[2] for b in batches])
    assert weights.sum() == n_windows * 4  # Padding rows have weight 0.
    targets = np.concatenate([b[1] for b in batches])[weights[:, 0] > 0]
    np.testing.assert_array_equal(targets.ravel(), data.eval_bytes[1:1 + n_windows * 4])


# --------------------------------------------------------------------------------------
# Edge cases (bad input, odd sizes).

def test_directory_path_says_it_is_a_directory(tmp_path):
    with pytest.raises(IsADirectoryError, match=r"is a directory"):
        TextFiles(tmp_path, process_index=0, process_count=1)


def test_negative_seed_is_rejected(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"0123456789" * 4)
    with pytest.raises(ValueError, match=r"seed=-1 must be >= 0"):
        TextFiles(path, sequence_length=4, seed=-1, eval_fraction=0.0, process_index=0,
                  process_count=1)
    inputs, targets, _ = next(TextFiles(path, sequence_length=4, batch_size=2,
                                        eval_fraction=0.0, process_index=0,
                                        process_count=1).train_stream())
    assert inputs.shape == targets.shape == (2, 4)
    assert (targets[:, :-1] == inputs[:, 1:]).all()
