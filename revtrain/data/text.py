"""Language-model stream over local text files: bytes (vocabulary 256) or subword tokens.

Without files it reads the default corpus (`revtrain.data.corpus.default_corpus`), which
ships with Python itself, so the default run needs no download.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from revtrain.data import batching

# Re-exported: they lived here before `revtrain.data.corpus`.
from revtrain.data.corpus import PathLike as PathLike
from revtrain.data.corpus import default_corpus as default_corpus
from revtrain.data.corpus import read_corpus
from revtrain.data.inputs import Batch, Inputs
from revtrain.data.tokenizers import Tokenizer, check_tokenizer

BYTE_VOCAB_SIZE = 256

_TRAIN, _EVAL = 0, 1


class TextFiles(Inputs):
    """Language modelling on local text files (or the default corpus).

    Tokens are the ids of `tokenizer`: by default the UTF-8 bytes of the text as int32 in
    [0, 256) (`ByteTokenizer`); a `SentencePieceTokenizer` gives subword ids. The last
    `eval_fraction` of the bytes is the eval part and the rest the train part (with a
    subword tokenizer the cut moves forward to the next character boundary); each part is
    encoded on its own, so no window of one part contains tokens of the other. Below,
    "token" is a byte for the default tokenizer.

    * Train: the global batch of step `k` holds `batch_size` windows of
      `sequence_length + 1` tokens at uniformly random offsets of the train part, drawn from
      `np.random.default_rng((seed, 0, k))`. Batch `k` depends only on `(seed, k)`, so
      `train_stream(start_step=k)` resumes exactly, for any process count.
    * Eval: windows tile the eval part from its start, advancing by `sequence_length`, so
      every eval token after the first is a target exactly once per pass (consecutive
      windows share one byte of context, their target ranges do not overlap). The stream
      cycles over these windows forever; every call starts again at the first window.

    Batches follow `revtrain.data.inputs`: the data does the shift (`inputs = w[:-1]`,
    `targets = w[1:]`), `inputs`/`targets` int32 `[batch, sequence_length]`, weights float32
    ones `[batch, sequence_length]`, where `batch = batch_size // process_count` rows of the
    global batch (see `revtrain.data.batching`).

    Attributes:
      tokenizer: the `Tokenizer`.
      vocab_size: the tokenizer's, 256 for bytes.
      byte_level: True for `ByteTokenizer`.
      train_bytes: uint8 `[n_train]`, the text of the train part.
      eval_bytes: uint8 `[n_eval]`, the text of the eval part.
      train_tokens: int `[n_train_tokens]`, the train part's ids (`train_bytes` for bytes).
      eval_tokens: int `[n_eval_tokens]`, the eval part's ids.
    """

    def __init__(
        self,
        paths: PathLike | Sequence[PathLike] | None = None,
        sequence_length: int = 128,
        batch_size: int = 8,
        seed: int = 0,
        eval_fraction: float = 0.05,
        process_index: int | None = None,
        process_count: int | None = None,
        tokenizer: Tokenizer | None = None,
    ):
        """Reads the corpus, splits it and encodes both parts.

        Args:
          paths: Text files, concatenated in order; None or empty uses `default_corpus()`.
            UTF-8 with a subword tokenizer; any bytes with `ByteTokenizer`.
          sequence_length: Tokens per example, `length` (windows hold `length + 1` bytes).
          batch_size: The global batch size; must divide by the process count.
          seed: Seed of the train offsets.
          eval_fraction: Fraction of the bytes, taken from the end, used for eval; 0 means
            no eval data (then `eval_stream` raises).
          process_index: This process's index; default `jax.process_index()`.
          process_count: Number of processes; default `jax.process_count()`.
          tokenizer: text to ids; None for `ByteTokenizer` (vocabulary 256).

        Raises:
          FileNotFoundError: A path does not exist (IsADirectoryError: names a directory).
          TypeError: `tokenizer` is not a `Tokenizer`.
          ValueError: A bad argument (e.g. a negative seed), a part of the corpus shorter
            than one window, or, with a subword tokenizer (which decodes the text), a file
            that is not UTF-8 (`revtrain.data.corpus.check_utf8`).
        """
        if sequence_length < 1:
            raise ValueError(f"sequence_length={sequence_length} must be >= 1")
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={eval_fraction} must be in [0, 1)")
        self.tokenizer = check_tokenizer(tokenizer, "TextFiles.tokenizer")
        self.vocab_size = self.tokenizer.vocab_size
        self.byte_level = self.tokenizer.byte_level
        self.sequence_length = int(sequence_length)
        self.seed = batching.check_seed(seed)
        self.shard = batching.ProcessSlice.create(batch_size, process_index, process_count)
        data = np.frombuffer(read_corpus(paths, utf8=not self.byte_level), dtype=np.uint8)
        n_train = len(data) - int(round(len(data) * eval_fraction))
        if not self.byte_level:  # Both parts whole characters: no U+FFFD at the cut.
            while n_train < len(data) and data[n_train] & 0xC0 == 0x80:
                n_train += 1
        self.train_bytes, self.eval_bytes = data[:n_train], data[n_train:]
        self.train_tokens, self.eval_tokens = (
            (self.train_bytes, self.eval_bytes) if self.byte_level else
            (self.tokenizer.encode(self.train_bytes.tobytes()),
             self.tokenizer.encode(self.eval_bytes.tobytes())))
        window = self.sequence_length + 1
        self._check_part("corpus train part", len(self.train_tokens), window)
        if len(self.eval_bytes):
            self._check_part("eval part (eval_fraction)", len(self.eval_tokens), window)

    def _check_part(self, what: str, n_tokens: int, window: int) -> None:
        unit = "bytes" if self.byte_level else "tokens"
        if n_tokens < window:
            raise ValueError(
                f"{what} has {n_tokens} {unit}, fewer than one window of sequence_length + 1 "
                f"= {window} {unit}; use more text, a larger eval_fraction for the eval part, "
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
        if not len(self.eval_tokens):
            raise ValueError("TextFiles has no eval data; use eval_fraction > 0")
        return batching.indexed_stream(self._eval_batch, self.shard.rows)

    def eval_pass(self) -> Iterator[Batch]:
        """Yields the eval windows once each; the last batch is padded with weight 0.

        The windows are those of `eval_stream` (``(n_eval - 1) // sequence_length`` of
        them, `n_eval` tokens), in order, without cycling: padding rows repeat window 0 with
        weights 0, so every eval token after the first is scored exactly once per pass.

        Raises:
          ValueError: The dataset has no eval part (`eval_fraction=0`).
        """
        if not len(self.eval_tokens):
            raise ValueError("TextFiles has no eval data; use eval_fraction > 0")
        n_windows = (len(self.eval_tokens) - 1) // self.sequence_length
        n_batches = -(-n_windows // self.shard.batch_size)
        for step in range(n_batches):
            inputs, targets, weights = self._eval_batch(step, self.shard.rows)
            ids = np.arange(step * self.shard.batch_size,
                            (step + 1) * self.shard.batch_size)[self.shard.rows]
            yield inputs, targets, weights * (ids < n_windows)[:, None].astype(weights.dtype)

    def _train_batch(self, step: int, rows: slice) -> Batch:
        rng = batching.step_rng(self.seed, _TRAIN, step)
        high = len(self.train_tokens) - self.sequence_length  # Offsets in [0, high).
        offsets = rng.integers(0, high, size=self.shard.batch_size)[rows]
        windows = np.lib.stride_tricks.sliding_window_view(
            self.train_tokens, self.sequence_length + 1
        )
        return batching.lm_batch(windows[offsets])

    def _eval_batch(self, step: int, rows: slice) -> Batch:
        n_windows = (len(self.eval_tokens) - 1) // self.sequence_length
        ids = np.arange(step * self.shard.batch_size, (step + 1) * self.shard.batch_size)
        starts = (ids[rows] % n_windows) * self.sequence_length
        positions = starts[:, None] + np.arange(self.sequence_length + 1)
        return batching.lm_batch(self.eval_tokens[positions])

