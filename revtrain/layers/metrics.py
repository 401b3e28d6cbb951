"""Losses and metrics as layers: ``(outputs, targets, weights) -> scalar``.

Every layer here takes three stack items, ``n_in=3``, and returns one float32 scalar,
``n_out=1``: a *weighted mean* over all target positions, ``sum(w * value) / sum(w)``
(see `weighted_mean`). Weights mask padding (weight 0) and must broadcast to the targets'
shape. When all weights are 0 the result is 0, not NaN, so an all-padding batch does not
poison a running average. A class-index target outside ``[0, n_classes)`` (e.g. a -1 pad
id) gives NaN at its position, so it shows in the loss unless its weight is 0.

References: Trax's ``trax.layers.metrics`` (``CrossEntropyLoss``,
``WeightedCategoryCrossEntropy``, ``Accuracy``, ``L2Loss``), whose names and input order
these follow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from revtrain.layers.chunked_loss import (
    check_n_chunks,
    chunk_count,
    chunked_weighted_sums,
    flatten_positions,
    mean_from_sums,
)
from revtrain.layers.layer import Layer
from revtrain.layers.stack import check_n_items


def weighted_mean(values: jax.Array, weights: jax.Array) -> jax.Array:
    """Returns ``sum(weights * values) / sum(weights)`` as a float32 scalar; 0 if the sum is 0.

    Positions of weight 0 are skipped, not multiplied, so a NaN or inf there (e.g. the
    log-probability of a padding token) does not leak into the result.

    Args:
      values: array of any shape.
      weights: array broadcastable to ``values.shape`` (e.g. a 0/1 padding mask).

    Raises:
      ValueError: if ``weights`` does not broadcast to ``values.shape``.
    """
    values = values.astype(jnp.float32)
    try:
        weights = jnp.broadcast_to(weights, values.shape).astype(jnp.float32)
    except ValueError as e:
        raise ValueError(f"weights of shape {jnp.shape(weights)} do not broadcast to shape "
                         f"{values.shape}; pass weights shaped like the targets") from e
    total = jnp.sum(weights)
    safe_total = jnp.where(total == 0, 1.0, total)
    weighted = jnp.where(weights == 0, 0.0, weights * values)
    return jnp.where(total == 0, 0.0, jnp.sum(weighted) / safe_total)


def check_label_smoothing(label_smoothing: float | None) -> float | None:
    """Returns ``label_smoothing`` if it is None or in ``[0, 1]``, else raises ValueError."""
    if label_smoothing is not None and not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    return label_smoothing


def check_targets(predictions: jax.Array, targets: jax.Array, name: str) -> None:
    """Checks class-index targets: an integer dtype and shape ``predictions.shape[:-1]``."""
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"{name} expects integer class-index targets but received "
                         f"{targets.dtype}; cast with targets.astype(jnp.int32)")
    if targets.shape != predictions.shape[:-1]:
        raise ValueError(f"{name} targets of shape {targets.shape} do not match predictions "
                         f"of shape {predictions.shape}; targets must have shape "
                         f"{predictions.shape[:-1]}")


def _nan_outside_classes(values: jax.Array, targets: jax.Array, n_classes: int) -> jax.Array:
    """``values`` with NaN where ``targets`` is not in ``[0, n_classes)``.

    Indexing would otherwise wrap a negative target to the last class silently.
    """
    valid = (targets >= 0) & (targets < n_classes)
    return jnp.where(valid, values, jnp.nan)


def _nll(log_probs: jax.Array, targets: jax.Array) -> jax.Array:
    """``-log_probs[..., targets]`` in float32, shape ``targets.shape``; NaN off range."""
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return _nan_outside_classes(-picked.astype(jnp.float32), targets, log_probs.shape[-1])


class _WeightedMetric(Layer):
    """A weightless ``(predictions, targets, weights) -> float32 scalar`` layer.

    With more than one chunk (`revtrain.layers.chunked_loss.chunk_count`) the positions
    are computed in chunks under ``jax.checkpoint``: same value and gradient (to float
    rounding), one chunk's temporaries at a time.
    """

    def __init__(self, n_chunks: int | None = 1):
        super().__init__(n_in=3, n_out=1)
        self._n_chunks = check_n_chunks(n_chunks)

    @property
    def n_chunks(self) -> int | None:
        """The chunk count asked for: None picks one by size, 1 never chunks."""
        return self._n_chunks

    def per_position(self, predictions: jax.Array, targets: jax.Array) -> jax.Array:
        """Returns the unweighted value at each target position."""
        raise NotImplementedError

    def forward_with_state(self, x, weights, state, rng):
        check_n_items(self, x)
        predictions, targets, mask = x
        n_chunks = 1
        if self._n_chunks != 1 and predictions.ndim == targets.ndim + 1:
            check_targets(predictions, targets, type(self).__name__)
            n_chunks = chunk_count(targets.size, predictions.shape[-1], self._n_chunks)
        if n_chunks == 1:
            return weighted_mean(self.per_position(predictions, targets), mask), state
        rows = flatten_positions(predictions, targets, mask)
        sums = chunked_weighted_sums(self.per_position, rows[:2], rows[2], n_chunks)
        return mean_from_sums(*sums), state


class CrossEntropyLoss(_WeightedMetric):
    """Weighted mean of ``-log p[target]`` from log-probabilities.

    Inputs: ``log_probs: float[..., vocab]`` (e.g. the output of `LogSoftmax`), ``targets:
    int[...]`` class indices, ``weights: [...]``. Output: float32 scalar, in nats.

    Args:
      n_chunks: compute in this many chunks of positions (`revtrain.layers.chunked_loss`);
        None picks enough chunks for at most 4M logits (16 MiB float32) per chunk. After
        ``Dense, LogSoftmax`` in a `Serial`, `revtrain.layers.fuse_loss_heads` fuses the
        three (no full logits, `revtrain.layers.fused_head`) unless this is 1.

    Raises (from ``pure_fn``):
      LayerError: for non-integer targets or targets not shaped ``log_probs.shape[:-1]``.
    """

    def __init__(self, n_chunks: int | None = None):
        super().__init__(n_chunks)

    def per_position(self, predictions, targets):
        check_targets(predictions, targets, "CrossEntropyLoss")
        return _nll(predictions, targets)


class WeightedCategoryCrossEntropy(_WeightedMetric):
    """Weighted mean cross-entropy from *logits* (applies ``log_softmax`` in float32).

    Inputs: ``logits: float[..., vocab]``, ``targets: int[...]``, ``weights: [...]``.
    Output: float32 scalar, in nats.

    Args:
      label_smoothing: if set, the target distribution is ``(1 - s) * one_hot + s / vocab``
        (Szegedy et al., 2016), as Trax's ``label_smoothing`` argument.
      n_chunks: compute the log-softmax and loss in this many chunks of positions, each
        rematerialised in the backward pass (`revtrain.layers.chunked_loss`), so no full
        ``[..., vocab]`` temporary outlives its chunk. None (default) picks enough chunks
        for at most 4M logits (16 MiB float32) per chunk: one chunk, i.e. the unchunked
        computation, for byte-level models (vocab 256 at 8 x 256 positions); 8 at vocab
        32,000, length 256, batch 8. 1 never chunks. After ``Dense, LogSoftmax`` in a
        `Serial`, `revtrain.layers.fuse_loss_heads` fuses the three (no full logits,
        `revtrain.layers.fused_head`) unless this is 1.

    Raises (from ``pure_fn``):
      LayerError: for non-integer targets or targets not shaped ``logits.shape[:-1]``.
    """

    def __init__(self, label_smoothing: float | None = None, n_chunks: int | None = None):
        super().__init__(n_chunks)
        self._label_smoothing = check_label_smoothing(label_smoothing)

    def per_position(self, predictions, targets):
        check_targets(predictions, targets, "WeightedCategoryCrossEntropy")
        return category_cross_entropy(predictions, targets, self._label_smoothing)


def category_cross_entropy(logits: jax.Array, targets: jax.Array,
                           label_smoothing: float | None = None) -> jax.Array:
    """float32 ``-sum(target_distribution * log_softmax(logits))`` at each position.

    Args:
      logits: ``float[..., vocab]``.
      targets: ``int[...]`` class indices (NaN where out of ``[0, vocab)``).
      label_smoothing: None, or ``s``: targets ``(1 - s) * one_hot + s / vocab``.

    Returns:
      float32 ``[...]``, in nats.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if not label_smoothing:
        return _nll(log_probs, targets)
    s, vocab = label_smoothing, logits.shape[-1]
    soft = jax.nn.one_hot(targets, vocab) * (1.0 - s) + s / vocab
    return _nan_outside_classes(-jnp.sum(soft * log_probs, axis=-1), targets, vocab)


class Accuracy(_WeightedMetric):
    """Weighted fraction of positions where ``argmax(predictions, -1) == targets``.

    Inputs: ``predictions: float[..., n_classes]`` (logits or log-probabilities), ``targets:
    int[...]``, ``weights: [...]``. Output: float32 scalar in ``[0, 1]``.

    Args:
      n_chunks: compute in this many chunks of positions; None as `CrossEntropyLoss`.
    """

    def __init__(self, n_chunks: int | None = None):
        super().__init__(n_chunks)

    def per_position(self, predictions, targets):
        check_targets(predictions, targets, "Accuracy")
        return (jnp.argmax(predictions, axis=-1) == targets).astype(jnp.float32)


class L2Loss(_WeightedMetric):
    """Weighted mean squared error ``sum(w * (p - t)^2) / sum(w)``.

    Inputs: ``predictions: float[...]``, ``targets: float[...]`` of the same shape,
    ``weights`` broadcastable to it (weights count per element, as in Trax's ``L2Loss``).

    Raises (from ``pure_fn``):
      LayerError: when predictions and targets differ in shape.
    """

    def __init__(self):
        super().__init__(n_chunks=1)  # No class axis: nothing vocabulary-sized to chunk.

    def per_position(self, predictions, targets):
        if predictions.shape != targets.shape:
            raise ValueError(f"L2Loss predictions of shape {predictions.shape} and targets of "
                             f"shape {targets.shape} differ; pass equal shapes")
        diff = predictions.astype(jnp.float32) - targets.astype(jnp.float32)
        return diff * diff
