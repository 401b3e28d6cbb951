"""Byte-level language-model stream over local text files (vocabulary 256).

Without files it reads a default corpus that ships with Python itself: the documentation
topics in the standard library module `pydoc_data.topics` (about 465 KB of English
prose and code), so the default run needs no download.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np

from revtrain.data import batching
from revtrain.data.inputs import Batch, Inputs

PathLike = str | os.PathLike
BYTE_VOCAB_SIZE = 256

_TRAIN, _EVAL = 0, 1


def default_corpus() -> bytes:
    """The default corpus: `pydoc_data.topics.topics` values in sorted-key order, UTF-8.

    Raises:
      ImportError: This Python build lacks `pydoc_data` (some distributions split it into
        a separate package); pass text files instead.
    """
    try:
        from pydoc_data import topics
    except ImportError as err:
        raise ImportError(
            "the default corpus needs the standard library module pydoc_data, which this "
            "Python lacks; pass TextFiles(paths=[...]) with your own text files"
        ) from err
    return "".join(topics.topics[key] for key in sorted(topics.topics)).encode("utf-8")


def read_corpus(paths: PathLike | Sequence[PathLike] | None) -> bytes:
    """Reads and concatenates files in the given order, or the default corpus.

    Args:
      paths: A path, a sequence of paths, or None / empty for `default_corpus()`.

    Raises:
      FileNotFoundError: A path does not name an existing file (the message names it).
      IsADirectoryError: A path names a directory.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        return default_corpus()
    chunks = []
    for path in paths:
        if os.path.isdir(path):
            raise IsADirectoryError(f"text file {os.fspath(path)!r} is a directory; pass the "
                                    f"files in it")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"text file {os.fspath(path)!r} does not exist")
        with open(path, "rb") as f:
            chunks.append(f.read())
    return b"".join(chunks)


class TextFiles(Inputs):
    """Byte-level language modelling on local text files (or the default corpus).

    Tokens are the UTF-8 bytes of the text as int32 in [0, 256). The last `eval_fraction`
    of the bytes is the eval part and the rest the train part; both are contiguous, so no
    window of one part contains bytes of the other.

    * Train: the global batch of step `k` holds `batch_size` windows of
      `sequence_length + 1` bytes at uniformly random offsets of the train part, drawn from
      `np.random.default_rng((seed, 0, k))`. Batch `k` depends only on `(seed, k)`, so
      `train_stream(start_step=k)` resumes exactly, for any process count.
    * Eval: windows tile the eval part from its start, advancing by `sequence_length`, so
      every eval byte after the first is a target exactly once per pass (consecutive
      windows share one byte of context, their target ranges do not overlap). The stream
      cycles over these windows forever; every call starts again at the first window.

    Batches follow `revtrain.data.inputs`: the data does the shift (`inputs = w[:-1]`,
    `targets = w[1:]`), `inputs`/`targets` int32 `[batch, sequence_length]`, weights float32
    ones `[batch, sequence_length]`, where `batch = batch_size // process_count` rows of the
    global batch (see `revtrain.data.batching`).

    Attributes:
      vocab_size: 256.
      byte_level: True.
      train_bytes: uint8 `[n_train]`, the train part.
      eval_bytes: uint8 `[n_eval]`, the eval part.
    """

    vocab_size = BYTE_VOCAB_SIZE
    byte_level = True

    def __init__(
        self,
        paths: PathLike | Sequence[PathLike] | None = None,
        sequence_length: int = 128,
        batch_size: int = 8,
        seed: int = 0,
        eval_fraction: float = 0.05,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        """Reads the corpus and splits it.

        Args:
          paths: Text files, concatenated in order; None or empty uses `default_corpus()`.
          sequence_length: Tokens per example, `length` (windows hold `length + 1` bytes).
          batch_size: The global batch size; must divide by the process count.
          seed: Seed of the train offsets.
          eval_fraction: Fraction of the bytes, taken from the end, used for eval; 0 means
            no eval data (then `eval_stream` raises).
          process_index: This process's index; default `jax.process_index()`.
          process_count: Number of processes; default `jax.process_count()`.

        Raises:
          FileNotFoundError: A path does not exist (IsADirectoryError: names a directory).
          ValueError: A bad argument (e.g. a negative seed), or a part of the corpus
            shorter than one window.
        """
        if sequence_length < 1:
            raise ValueError(f"sequence_length={sequence_length} must be >= 1")
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={eval_fraction} must be in [0, 1)")
        self.sequence_length = int(sequence_length)
        self.seed = batching.check_seed(seed)
        self.shard = batching.ProcessSlice.create(batch_size, process_index, process_count)
        data = np.frombuffer(read_corpus(paths), dtype=np.uint8)
        n_eval = int(round(len(data) * eval_fraction))
        self.train_bytes = data[: len(data) - n_eval]
        self.eval_bytes = data[len(data) - n_eval :]
        window = self.sequence_length + 1
        self._check_part("corpus train part", len(self.train_bytes), window)
        if n_eval:
            self._check_part("eval part (eval_fraction)", n_eval, window)

    @staticmethod
    def _check_part(what: str, n_bytes: int, window: int) -> None:
        if n_bytes < window:
            raise ValueError(
                f"{what} has {n_bytes} bytes, fewer than one window of sequence_length + 1 "
                f"= {window} bytes; use more text, a larger eval_fraction for the eval part, "
                f"or a smaller sequence_length"
            )

    def train_stream(self, start_step: int = 0) -> Iterator[Batch]:
        """Yields train batches for global steps `start_step, start_step + 1, ...`.

        Raises:
          ValueError: `start_step` is negative.
        """
        return batching.indexed_stream(self._train_batch, self.shard.rows, start_step)

    def eval_stream(self) -> Iterator[Batch]:
        """Yields eval batches from the first eval window on, cycling forever.

        Raises:
          ValueError: The dataset has no eval part (`eval_fraction=0`).
        """
        if not len(self.eval_bytes):
            raise ValueError("TextFiles has no eval data; use eval_fraction > 0")
        return batching.indexed_stream(self._eval_batch, self.shard.rows)

    def eval_pass(self) -> Iterator[Batch]:
        """Yields the eval windows once each; the last batch is padded with weight 0.

        The windows are those of `eval_stream` (``(n_eval - 1) // sequence_length`` of
        them), in order, without cycling: padding rows repeat window 0 with weights 0, so
        every eval byte after the first is scored exactly once per pass.

        Raises:
          ValueError: The dataset has no eval part (`eval_fraction=0`).
        """
        if not len(self.eval_bytes):
            raise ValueError("TextFiles has no eval data; use eval_fraction > 0")
        n_windows = (len(self.eval_bytes) - 1) // self.sequence_length
        n_batches = -(-n_windows // self.shard.batch_size)
        for step in range(n_batches):
            inputs, targets, weights = self._eval_batch(step, self.shard.rows)
            ids = np.arange(step * self.shard.batch_size,
                            (step + 1) * self.shard.batch_size)[self.shard.rows]
            yield inputs, targets, weights * (ids < n_windows)[:, None].astype(weights.dtype)

    def _train_batch(self, step: int, rows: slice) -> Batch:
        rng = batching.step_rng(self.seed, _TRAIN, step)
        high = len(self.train_bytes) - self.sequence_length  # Offsets in [0, high).
        offsets = rng.integers(0, high, size=self.shard.batch_size)[rows]
        windows = np.lib.stride_tricks.sliding_window_view(
            self.train_bytes, self.sequence_length + 1
        )
        return batching.lm_batch(windows[offsets])

    def _eval_batch(self, step: int, rows: slice) -> Batch:
        n_windows = (len(self.eval_bytes) - 1) // self.sequence_length
        ids = np.arange(step * self.shard.batch_size, (step + 1) * self.shard.batch_size)
        starts = (ids[rows] % n_windows) * self.sequence_length
        positions = starts[:, None] + np.arange(self.sequence_length + 1)
        return batching.lm_batch(self.eval_bytes[positions])
