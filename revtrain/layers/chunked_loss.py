"""Losses computed in chunks of positions, so no full-vocabulary buffer lives at once.

A language model's loss over ``[batch, length, vocab]`` logits keeps, unchunked, several
full buffers of that size through forward and backward (the log-softmax output kept for
the backward pass, the softmax and the gradient). `chunked_weighted_sums` instead runs a
``jax.lax.scan`` over ``n_chunks`` chunks of the ``batch * length`` positions, each chunk
under ``jax.checkpoint``: the forward pass keeps only per-chunk sums, and the backward pass
recomputes one chunk's log-softmax at a time. The chunks are consecutive slices of the
positions flattened in row-major order, so cutting them is a free reshape (no transpose).

Two ways to use it:

* the metric layers (`revtrain.layers.metrics`) with ``n_chunks``: over given logits or
  log-probabilities, the loss step then holds the input, its gradient and one chunk's
  temporaries (about 2 logits buffers; 1 when the caller donates the input);
* `ProjectedCrossEntropy`, which fuses the final ``Dense(vocab_size)`` into the loss:
  each chunk computes its own logits from ``[batch, length, d_model]`` features, so the full
  logits never exist, and the step's peak shrinks with the chunk count.

References: the chunked / "fused linear cross-entropy" of large-vocabulary training (e.g.
Wijmans et al., 2024, "Cut Your Losses in Large-Vocabulary Language Models"); Trax's
``WeightedCategoryCrossEntropy`` (the value computed).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

# Auto chunking aims at chunks of at most this many float32 logits (16 MiB): a byte-level
# model (vocab 256, 8 x 256 positions: 2 MiB of logits) stays one chunk, i.e. unchunked.
AUTO_CHUNK_ELEMENTS = 4 * 2 ** 20


def chunk_count(n_positions: int, vocab: int, n_chunks: int | None) -> int:
    """The number of chunks used for ``n_positions`` rows of ``vocab`` classes.

    ``n_chunks=None`` picks ``ceil(n_positions * vocab / AUTO_CHUNK_ELEMENTS)``. The count
    is then lowered to the largest divisor of ``n_positions`` not above it, so every chunk
    has the same size (no padding copy).

    Raises:
      ValueError: if ``n_chunks`` is given and is not a positive int.
    """
    if n_chunks is None:
        n_chunks = -(-n_positions * vocab // AUTO_CHUNK_ELEMENTS)
    elif isinstance(n_chunks, bool) or not isinstance(n_chunks, int) or n_chunks < 1:
        raise ValueError(f"n_chunks={n_chunks!r} must be a positive int or None (automatic)")
    n_chunks = max(1, min(n_chunks, n_positions))
    while n_positions % n_chunks:
        n_chunks -= 1
    return n_chunks


def check_n_chunks(n_chunks: int | None) -> int | None:
    """Returns ``n_chunks`` if it is None or a positive int, else raises a ValueError."""
    chunk_count(1, 1, n_chunks)
    return n_chunks


def weighted_sums(values: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sum(w * v), sum(w))`` in float32, skipping positions of weight 0 (NaN-safe)."""
    values = values.astype(jnp.float32)
    weights = weights.astype(jnp.float32)
    return jnp.sum(jnp.where(weights == 0, 0.0, weights * values)), jnp.sum(weights)


def chunked_weighted_sums(per_position: Callable[..., jax.Array], rows: tuple,
                          weights: jax.Array, n_chunks: int,
                          ) -> tuple[jax.Array, jax.Array]:
    """``weighted_sums(per_position(*rows), weights)`` in ``n_chunks`` rematerialised chunks.

    Args:
      per_position: maps chunks of ``rows`` (leading axis ``positions / n_chunks``) to
        float values of shape ``[positions / n_chunks]``; it may close over weights, whose
        gradients the scan accumulates.
      rows: arrays with a leading ``[positions]`` axis (e.g. logits ``[positions, vocab]``
        and targets ``[positions]``).
      weights: ``[positions]`` weights.
      n_chunks: a divisor of ``positions`` (see `chunk_count`).

    Returns:
      float32 scalars ``(sum(w * value), sum(w))``.
    """
    if n_chunks == 1:
        return weighted_sums(per_position(*rows), weights)

    def split(a):
        return a.reshape((n_chunks, a.shape[0] // n_chunks) + a.shape[1:])

    # Per-chunk sums come out as the scan's outputs, summed after it: no carry, whose
    # type under shard_map would have to vary over the mesh axes the sums vary over.
    @jax.checkpoint
    def body(carry, chunk):
        *chunk_rows, chunk_weights = chunk
        return carry, weighted_sums(per_position(*chunk_rows), chunk_weights)

    _, (totals, norms) = jax.lax.scan(body, (), tuple(split(a) for a in (*rows, weights)))
    total, norm = jnp.sum(totals), jnp.sum(norms)
    return total, norm


def flatten_positions(predictions: jax.Array, targets: jax.Array,
                      weights: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``[..., vocab]``, ``[...]``, weights broadcast to ``[...]`` -> rows of positions.

    Raises:
      ValueError: if ``weights`` does not broadcast to ``targets.shape``.
    """
    try:
        weights = jnp.broadcast_to(weights, targets.shape)
    except ValueError as e:
        raise ValueError(f"weights of shape {jnp.shape(weights)} do not broadcast to shape "
                         f"{targets.shape}; pass weights shaped like the targets") from e
    n = math.prod(targets.shape)
    return (predictions.reshape((n,) + predictions.shape[targets.ndim:]),
            targets.reshape(n), weights.reshape(n))


def mean_from_sums(total: jax.Array, norm: jax.Array) -> jax.Array:
    """``total / norm``, or 0 where ``norm`` is 0 (an all-padding batch)."""
    safe = jnp.where(norm == 0, 1.0, norm)
    return jnp.where(norm == 0, 0.0, total / safe)
