"""The input-stream contract: `Batch` and `Inputs`.

Every stream in `revtrain.data` yields numpy batches `(inputs, targets, weights)`:

* Language modelling: `inputs` and `targets` are int32 `[batch, length]`, `weights` float32
  `[batch, length]`. The *data* does the shift: a window `w` of `length + 1` tokens gives
  `inputs = w[:-1]` and `targets = w[1:]`, so a model predicts `targets[:, i]` from
  `inputs[:, :i + 1]` and needs no `ShiftRight` layer (Trax models shift inside the model;
  revtrain models must not).
* Image classification: `inputs` float32 `[batch, height, width, channels]` in [0, 1],
  `targets` int32 `[batch]`, `weights` float32 `[batch]`.

`weights` is the loss mask: 0 on padding and on positions that are not scored, 1 elsewhere.

A stream's `batch` axis is the *per-process* batch: `batch_size // process_count` rows, the
slice of the global batch that belongs to this process (see `revtrain.data.batching`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator

import numpy as np

from revtrain.data.tokenizers import Tokenizer

Batch = tuple[np.ndarray, np.ndarray, np.ndarray]
"""`(inputs, targets, weights)`; shapes and dtypes as in the module docstring."""


class Inputs(abc.ABC):
    """Train and eval streams of one dataset (the Trax `Inputs` idea, made resumable).

    Contract for subclasses:

    * `train_stream(start_step)` is infinite and deterministic given the dataset's seed. It
      starts at global step `start_step`: its first batch is the batch an uninterrupted run
      sees at that step. The training loop restores the data position from the step alone.
    * `eval_stream()` is deterministic, starts from the beginning on every call and never
      ends; a caller takes as many batches as it wants to evaluate.
    * `eval_pass()` (optional) yields one exact pass over finite eval data: every example
      once, the last partial batch padded to the full batch with weight 0 (as Paxml's
      eval over a finite split). Over all processes together every example is scored
      once, and every process yields the same number of batches (padding with batches
      of weight 0 where needed). Data without an end does not override it.
    * `vocab_size` is the number of token ids (`None` for images); `n_classes` is the number
      of labels for classification data (`None` for sequences); `byte_level` says that
      tokens are bytes of text, so a loss in nats per token is one per byte (the loop
      then reports bits per byte).
    * `tokenizer` is the `revtrain.data.Tokenizer` that made the tokens of text data (None
      otherwise): the run directory records it, evaluation counts the bytes of the text
      it scores with it (bits per byte for any tokenizer), decoding encodes prompts and
      decodes continuations with it.

    Attributes:
      vocab_size: Size of the token vocabulary, or None when inputs are not tokens.
      n_classes: Number of classes for classification targets, or None.
      byte_level: True when each token is one byte of text (UTF-8).
      tokenizer: The tokenizer of text data, or None.
    """

    vocab_size: int | None = None
    n_classes: int | None = None
    byte_level: bool = False
    tokenizer: Tokenizer | None = None

    @abc.abstractmethod
    def train_stream(self, start_step: int = 0) -> Iterator[Batch]:
        """Yields training batches for global steps `start_step, start_step + 1, ...`."""

    @abc.abstractmethod
    def eval_stream(self) -> Iterator[Batch]:
        """Yields evaluation batches from the beginning of the eval data, forever."""

    def eval_pass(self) -> Iterator[Batch]:
        """Yields one pass over the eval data, the last batch padded with weight 0.

        Raises:
          ValueError: the eval data has no end (the default); set `EvalConfig.steps`.
        """
        raise ValueError(f"{type(self).__name__}'s eval data has no end, so there is no "
                         f"exact pass over it; set EvalConfig.steps to a number of batches")


class StreamInputs(Inputs):
    """`Inputs` built from stream functions, for data that needs no class of its own.

    Examples:
      >>> import itertools
      >>> def batches(start_step=0):
      ...     for step in itertools.count(start_step):
      ...         x = np.full((2, 3), step, np.int32)
      ...         yield x, x, np.ones((2, 3), np.float32)
      >>> inputs = StreamInputs(batches, vocab_size=10)
      >>> int(next(inputs.train_stream(start_step=4))[0][0, 0])
      4
    """

    def __init__(
        self,
        train_stream: Callable[[int], Iterator[Batch]],
        eval_stream: Callable[[], Iterator[Batch]] | None = None,
        vocab_size: int | None = None,
        n_classes: int | None = None,
        eval_pass: Callable[[], Iterator[Batch]] | None = None,
        byte_level: bool = False,
    ):
        """Wraps stream functions.

        Args:
          train_stream: `start_step -> Iterator[Batch]`, honouring the contract of
            `Inputs.train_stream`.
          eval_stream: `() -> Iterator[Batch]`; when None, evaluation uses
            `train_stream(0)`, as Trax does when no eval stream is given.
          vocab_size: Token vocabulary size, or None.
          n_classes: Number of classes, or None.
          eval_pass: `() -> Iterator[Batch]`, one finite pass over the eval data (see
            `Inputs.eval_pass`); None when the eval data has no end.
          byte_level: Tokens are bytes of text.
        """
        self._train_stream = train_stream
        self._eval_stream = eval_stream
        self._eval_pass = eval_pass
        self.byte_level = byte_level
        self.vocab_size = vocab_size
        self.n_classes = n_classes

    def train_stream(self, start_step: int = 0) -> Iterator[Batch]:
        """Calls the wrapped train stream function with `start_step`."""
        return self._train_stream(start_step)

    def eval_stream(self) -> Iterator[Batch]:
        """Calls the wrapped eval stream function (or `train_stream(0)` without one)."""
        if self._eval_stream is None:
            return self._train_stream(0)
        return self._eval_stream()

    def eval_pass(self) -> Iterator[Batch]:
        """Calls the wrapped eval pass function (see `Inputs.eval_pass`)."""
        if self._eval_pass is None:
            return super().eval_pass()
        return self._eval_pass()
