"""Global batches, per-process slices and language-model windows, shared by all streams.

Every stream builds the *global* batch of a step (identical in every process, whatever the
process count) and yields only this process's contiguous rows
`[process_index * b / p : (process_index + 1) * b / p]`, where `b` is the global batch size
and `p` the process count. Concatenating the batches of processes `0 .. p - 1` therefore
gives exactly the batch a single process would see.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator

import numpy as np

from revtrain.batch_checks import check_divisible
from revtrain.data.inputs import Batch


@dataclasses.dataclass(frozen=True)
class ProcessSlice:
    """Which rows of each global batch belong to this process.

    Attributes:
      batch_size: The global batch size `b` (rows summed over all processes).
      process_index: This process's index `i`, in `[0, process_count)`.
      process_count: The number of processes `p`; `b % p == 0`.
    """

    batch_size: int
    process_index: int
    process_count: int

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be positive")
        if self.process_count < 1:
            raise ValueError(f"process_count={self.process_count} must be positive")
        if not 0 <= self.process_index < self.process_count:
            raise ValueError(
                f"process_index={self.process_index} is outside [0, {self.process_count}); "
                f"pass an index below process_count={self.process_count}"
            )
        check_divisible(self.batch_size, self.process_count, "batch_size",
                        by="process_count", fix=f"use a global batch size that is a "
                                                f"multiple of {self.process_count}")

    @classmethod
    def create(
        cls,
        batch_size: int,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> ProcessSlice:
        """Builds a slice, defaulting to `jax.process_index()` / `jax.process_count()`.

        JAX is imported only when a default is needed, so streams with explicit process
        arguments work without initialising a JAX backend.

        Raises:
          ValueError: `batch_size` is not a multiple of the process count, or the index is
            out of range.
        """
        if process_index is None or process_count is None:
            import jax  # Lazily: creating a backend is slow and not always wanted.

            if process_index is None:
                process_index = jax.process_index()
            if process_count is None:
                process_count = jax.process_count()
        return cls(int(batch_size), int(process_index), int(process_count))

    @property
    def local_batch_size(self) -> int:
        """Rows per process, `batch_size // process_count`."""
        return self.batch_size // self.process_count

    @property
    def rows(self) -> slice:
        """This process's rows of a global batch."""
        start = self.process_index * self.local_batch_size
        return slice(start, start + self.local_batch_size)

    def take(self, global_batch: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        """Returns this process's rows of each array in a global batch.

        Args:
          global_batch: Arrays with a leading `[batch_size, ...]` axis.

        Returns:
          The same arrays restricted to `[local_batch_size, ...]`.
        """
        return tuple(x[self.rows] for x in global_batch)


def check_seed(seed: int) -> int:
    """Returns `seed` as an int, or raises ValueError if it is negative.

    NumPy's `default_rng` rejects negative seeds only when the first batch is drawn; this
    names the argument when the stream is built.
    """
    seed = int(seed)
    if seed < 0:
        raise ValueError(f"seed={seed} must be >= 0")
    return seed


def step_rng(seed: int, stream: int, step: int) -> np.random.Generator:
    """The generator of one step of one random stream: `default_rng((seed, stream, step))`.

    Each step has its own generator, so batch `k` is computed directly (random access: a
    resumed run needs no replay) and does not depend on the process count.

    Args:
      seed: The dataset seed (non-negative).
      stream: Distinguishes independent streams of one dataset, e.g. 0 train, 1 eval.
      step: The global step (non-negative).
    """
    return np.random.default_rng((seed, stream, step))


def indexed_stream(
    batch_fn: Callable[[int, slice], Batch], rows: slice, start_step: int = 0
) -> Iterator[Batch]:
    """Yields `batch_fn(step, rows)` for `step = start_step, start_step + 1, ...` forever.

    Args:
      batch_fn: `(step, rows) -> Batch`: the given rows of the global batch of `step`,
        computed from the step alone.
      rows: The rows to keep, usually `ProcessSlice.rows`.
      start_step: The first global step.

    Raises:
      ValueError: `start_step` is negative.
    """
    if start_step < 0:
        raise ValueError(f"start_step={start_step} must be >= 0")
    for step in itertools.count(start_step):
        yield batch_fn(step, rows)


def lm_batch(windows: np.ndarray, mask: np.ndarray | None = None) -> Batch:
    """Turns token windows into a shifted language-model batch.

    Args:
      windows: int `[batch, length + 1]` token windows.
      mask: `[batch, length + 1]`, nonzero on real tokens and 0 on padding; None means no
        padding.

    Returns:
      `inputs = windows[:, :-1]` and `targets = windows[:, 1:]`, int32 `[batch, length]`,
      and float32 `weights` `[batch, length]`: the mask of the targets.

    Raises:
      ValueError: `windows` is not an integer `[batch, length + 1]` array with
        `length >= 1`, or `mask` is not shaped like it.
    """
    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"token windows must be [batch, length + 1] with length >= 1; got "
                         f"shape {windows.shape}")
    if not np.issubdtype(windows.dtype, np.integer):
        raise ValueError(f"token windows must hold integer ids; got {windows.dtype}")
    if mask is not None and np.shape(mask) != windows.shape:
        raise ValueError(f"mask of shape {np.shape(mask)} does not match windows of shape "
                         f"{windows.shape}; pass one mask value per token")
    windows = windows.astype(np.int32)
    if mask is None:
        weights = np.ones(windows[:, 1:].shape, np.float32)
    else:
        weights = np.asarray(mask[:, 1:], np.float32)
    return windows[:, :-1], windows[:, 1:], weights
