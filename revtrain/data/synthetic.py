"""Synthetic sequence tasks: the copy task and uniform random tokens.

Both are random-access: the global batch of step `k` is drawn from its own generator
`np.random.default_rng((seed, stream, k))` (stream 0 train, 1 eval), so streams resume
exactly at any step and are identical for any process count. Eval batches come from a
different generator stream than train batches, and `eval_stream()` restarts at eval batch 0
on every call.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

import numpy as np

from revtrain.data import batching
from revtrain.data.inputs import Batch, Inputs

_TRAIN, _EVAL = 0, 1


class _RandomAccess(Inputs):
    """Shared plumbing: arguments, process slice and the two streams."""

    def __init__(
        self,
        vocab_size: int,
        length: int,
        batch_size: int,
        seed: int,
        process_index: int | None,
        process_count: int | None,
        min_vocab_size: int,
    ):
        if vocab_size < min_vocab_size:
            raise ValueError(
                f"vocab_size={vocab_size} is too small for {type(self).__name__}; "
                f"use at least {min_vocab_size}"
            )
        if vocab_size > np.iinfo(np.int32).max + 1:
            raise ValueError(f"vocab_size={vocab_size} does not fit int32 token ids; use at "
                             f"most {np.iinfo(np.int32).max + 1}")
        if length < 1:
            raise ValueError(f"length={length} must be >= 1")
        self.vocab_size = int(vocab_size)
        self.length = int(length)
        self.seed = batching.check_seed(seed)
        self.shard = batching.ProcessSlice.create(batch_size, process_index, process_count)

    def train_stream(self, start_step: int = 0) -> Iterator[Batch]:
        """Yields train batches for global steps `start_step, start_step + 1, ...`.

        Raises:
          ValueError: `start_step` is negative.
        """
        return batching.indexed_stream(
            lambda step, rows: self._batch(_TRAIN, step, rows), self.shard.rows, start_step
        )

    def eval_stream(self) -> Iterator[Batch]:
        """Yields eval batches 0, 1, ... (a generator stream separate from train)."""
        return batching.indexed_stream(
            lambda step, rows: self._batch(_EVAL, step, rows), self.shard.rows
        )

    def _tokens(self, stream: int, step: int, rows: slice, low: int, n: int) -> np.ndarray:
        """Rows of the global `[batch_size, n]` uniform tokens in `[low, vocab_size)`."""
        rng = batching.step_rng(self.seed, stream, step)
        return rng.integers(low, self.vocab_size, size=(self.shard.batch_size, n))[rows]

    @abc.abstractmethod
    def _batch(self, stream: int, step: int, rows: slice) -> Batch:
        """Rows `rows` of the global batch of `step` in generator stream `stream`."""


class CopyTask(_RandomAccess):
    """The copy task (as in Trax's copy inputs): repeat a random sequence after a separator.

    Each example is the sequence `s = [x_1 .. x_n, 0, x_1 .. x_n]` with `n = length` and
    `x_i` uniform in `[1, vocab_size)`; 0 is the separator. The data does the shift:
    `inputs = s[:-1]`, `targets = s[1:]`, both int32 `[batch, 2 * length]`. `weights` (float32,
    same shape) is 1 exactly where the target lies in the second copy, i.e. positions
    `length .. 2 * length - 1`, so `targets[:, length:] == inputs[:, :length]` is what a
    model must learn; the first copy is unpredictable and not scored.

    Attributes:
      vocab_size: Token ids are in `[0, vocab_size)`.
      length: `n`, tokens per copy.
    """

    def __init__(
        self,
        vocab_size: int = 32,
        length: int = 16,
        batch_size: int = 8,
        seed: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        """Configures the task.

        Args:
          vocab_size: Number of token ids including the separator 0; at least 2.
          length: Tokens per copy, `n >= 1`.
          batch_size: The global batch size; must divide by the process count.
          seed: Seed of the token draws.
          process_index: This process's index; default `jax.process_index()`.
          process_count: Number of processes; default `jax.process_count()`.

        Raises:
          ValueError: A bad argument, or `batch_size` not divisible by the process count.
        """
        super().__init__(vocab_size, length, batch_size, seed, process_index, process_count, 2)

    def _batch(self, stream: int, step: int, rows: slice) -> Batch:
        x = self._tokens(stream, step, rows, 1, self.length)
        separator = np.zeros((x.shape[0], 1), x.dtype)
        sequences = np.concatenate([x, separator, x], axis=1)
        mask = np.zeros(sequences.shape, np.float32)
        mask[:, self.length + 1 :] = 1.0  # Targets s[length + 1:] are the second copy.
        return batching.lm_batch(sequences, mask)


class SyntheticSequences(_RandomAccess):
    """Uniform random tokens, for benchmarks and smoke tests (nothing to learn).

    Windows of `length + 1` tokens uniform in `[0, vocab_size)`, shifted by the data:
    `inputs = w[:-1]`, `targets = w[1:]`, int32 `[batch, length]`; weights float32 ones.

    Attributes:
      vocab_size: Token ids are in `[0, vocab_size)`.
      length: Tokens per example.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        length: int = 128,
        batch_size: int = 8,
        seed: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        """Configures the stream.

        Args:
          vocab_size: Number of token ids, at least 1.
          length: Tokens per example, at least 1.
          batch_size: The global batch size; must divide by the process count.
          seed: Seed of the token draws.
          process_index: This process's index; default `jax.process_index()`.
          process_count: Number of processes; default `jax.process_count()`.

        Raises:
          ValueError: A bad argument, or `batch_size` not divisible by the process count.
        """
        super().__init__(vocab_size, length, batch_size, seed, process_index, process_count, 1)

    def _batch(self, stream: int, step: int, rows: slice) -> Batch:
        return batching.lm_batch(self._tokens(stream, step, rows, 0, self.length + 1))
