"""`ProjectedCrossEntropy`: the output projection fused into a chunked cross-entropy loss.

A language model's head ``Dense(vocab_size), LogSoftmax`` followed by a cross-entropy loss
materialises ``[batch, length, vocab_size]`` logits, plus the log-softmax and gradient
buffers of the same size. `ProjectedCrossEntropy` takes the features before the projection
and computes logits, log-softmax and loss one chunk of positions at a time (a
``jax.lax.scan`` with each chunk under ``jax.checkpoint``, `revtrain.layers.chunked_loss`),
so the full logits never exist: the loss step (forward and backward) holds the features,
the projection, its gradient and one chunk's logits-sized temporaries, and its peak
shrinks with the chunk count.

References: the fused linear cross-entropy of large-vocabulary training (e.g. Wijmans et
al., 2024, "Cut Your Losses in Large-Vocabulary Language Models"); Trax's ``Dense`` and
``WeightedCategoryCrossEntropy`` (weights, initialisers and value this layer combines).
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
from revtrain.layers.core import GLOROT_UNIFORM, TINY_NORMAL
from revtrain.layers.layer import Layer
from revtrain.layers.metrics import category_cross_entropy, check_label_smoothing
from revtrain.layers.signatures import float_dtype
from revtrain.layers.stack import check_n_items


class ProjectedCrossEntropy(Layer):
    """``Dense(vocab_size)`` then `WeightedCategoryCrossEntropy`, without full logits.

    Inputs: ``features: float[..., d_model]`` (e.g. ``[batch, length, d_model]``, the final
    LayerNorm's output), ``targets: int[...]``, ``weights: [...]``. Output: the float32
    weighted-mean cross entropy in nats, equal (to float rounding) to ``Serial(Dense(
    vocab_size), WeightedCategoryCrossEntropy(label_smoothing))`` with the same weights.

    Weights are those of that `Dense`: ``(w: float32[d_model, vocab_size], b:
    float32[vocab_size])``, Glorot-uniform and normal(1e-6) as Trax's ``Dense``, so a
    trained ``Dense`` head's weights load unchanged.

    Args:
      vocab_size: number of classes.
      label_smoothing: as `WeightedCategoryCrossEntropy`.
      n_chunks: chunks of positions; None picks enough for at most 4M logits (16 MiB
        float32) per chunk (`revtrain.layers.chunked_loss.chunk_count`), 1 never chunks.

    Raises:
      ValueError: for ``vocab_size < 1``, a ``label_smoothing`` outside ``[0, 1]`` or an
        ``n_chunks`` that is not a positive int or None.
      LayerError: (from ``pure_fn``) for non-integer targets, or features whose leading
        shape is not the targets' shape.
    """

    def __init__(self, vocab_size: int, label_smoothing: float | None = None,
                 n_chunks: int | None = None):
        super().__init__(n_in=3, n_out=1)
        if vocab_size < 1:
            raise ValueError(f"ProjectedCrossEntropy vocab_size={vocab_size} must be >= 1")
        self._vocab_size = vocab_size
        self._label_smoothing = check_label_smoothing(label_smoothing)
        self._n_chunks = check_n_chunks(n_chunks)

    def forward_with_state(self, x, weights, state, rng):
        check_n_items(self, x)
        features, targets, mask = x
        if not jnp.issubdtype(targets.dtype, jnp.integer):
            raise ValueError(f"ProjectedCrossEntropy expects integer class-index targets but "
                             f"received {targets.dtype}; cast with targets.astype(jnp.int32)")
        if features.shape[:-1] != targets.shape:
            raise ValueError(f"ProjectedCrossEntropy features of shape {features.shape} do "
                             f"not match targets of shape {targets.shape}; features must "
                             f"have shape {targets.shape + features.shape[-1:]}")
        w, b = weights
        dtype = float_dtype(features, w.dtype)

        def per_position(chunk_features, chunk_targets):
            logits = jnp.dot(chunk_features.astype(dtype), w.astype(dtype)) + b.astype(dtype)
            return category_cross_entropy(logits, chunk_targets, self._label_smoothing)

        rows = flatten_positions(features, targets, mask)
        n_chunks = chunk_count(targets.size, self._vocab_size, self._n_chunks)
        return mean_from_sums(*chunked_weighted_sums(per_position, rows[:2], rows[2],
                                                     n_chunks)), state

    def init_weights_and_state(self, input_signature, rng):
        d_model = input_signature[0].shape[-1]
        rng_w, rng_b = jax.random.split(rng)
        return (GLOROT_UNIFORM(rng_w, (d_model, self._vocab_size), jnp.float32),
                TINY_NORMAL(rng_b, (self._vocab_size,), jnp.float32)), ()
