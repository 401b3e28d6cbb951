"""Core layers: `Dense`, `Embedding`, `Dropout`, positional encoding, reshapes.

Every layer here is a leaf `Layer` with plain constructor arguments. Weights are float32;
layers compute in the dtype of their input (a bfloat16 activation gives a bfloat16 output),
except `Embedding`, whose output has the dtype of its table.

Modes follow Trax: ``'train'`` turns dropout on, ``'eval'`` and ``'predict'`` turn it off,
and `ShiftRight` skips its shift in ``'predict'`` mode. The layers of this module keep no
decoding state; incremental (one-token-at-a-time) decoding keeps its state in the
attention layers' key/value caches (`revtrain.layers.CausalAttention`,
`revtrain.layers.LSHCausalAttention`) and the models' position counter. Dropout masks come
from 16 (or 8) random bits per element (`revtrain.layers.dropout_masks`), not from 32-bit
uniforms.

References: the Trax layers ``trax.layers.core`` and ``trax.layers.attention`` (names,
arguments and defaults); Vaswani et al., 2017, "Attention Is All You Need" (positional
encoding); Srivastava et al., 2014 (dropout).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from revtrain.layers.dropout_masks import (
    DEFAULT_MASK_BITS,
    apply_keep_mask,
    check_mask_bits,
    drop_threshold,
    keep_mask,
)
from revtrain.layers.layer import Layer
from revtrain.layers.position_tables import sinusoidal_rows
from revtrain.layers.sequence_parallel import check_local_length, check_not_split, shard_key
from revtrain.layers.signatures import float_dtype

Initializer = jax.nn.initializers.Initializer

MODES = ("train", "eval", "predict")

_GLOROT_UNIFORM = jax.nn.initializers.glorot_uniform()
_TINY_NORMAL = jax.nn.initializers.normal(1e-6)
_EMBEDDING_INIT = jax.nn.initializers.variance_scaling(1.0, "fan_out", "uniform", in_axis=-2,
                                                       out_axis=-1)


# The default initialisers (as Trax's) are module-level named functions, not the closures
# jax.nn.initializers returns: a layer's structure key can then name them, so default-built
# layers share compiled programs (revtrain.layers.structure_keys keys a closure argument as None).
def glorot_uniform_init(key: jax.Array, shape: Sequence[int],
                        dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Glorot (Xavier) uniform ``[..., fan_in, fan_out]`` weights; `Dense`/`Conv` kernels."""
    return _GLOROT_UNIFORM(key, shape, dtype)


def tiny_normal_init(key: jax.Array, shape: Sequence[int],
                     dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Normal weights with standard deviation 1e-6; the default biases, as Trax's."""
    return _TINY_NORMAL(key, shape, dtype)


def embedding_init(key: jax.Array, shape: Sequence[int],
                   dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Uniform ``[vocab_size, d_feature]`` table, variance ``1 / d_feature`` (Trax's)."""
    return _EMBEDDING_INIT(key, shape, dtype)


GLOROT_UNIFORM = glorot_uniform_init
TINY_NORMAL = tiny_normal_init
EMBEDDING_INIT = embedding_init


def check_mode(mode: str, layer_name: str) -> str:
    """Returns ``mode`` if it is one of `MODES`, else raises a ValueError naming it."""
    if mode not in MODES:
        raise ValueError(f"{layer_name} mode={mode!r} is not one of {MODES}; pass mode='train' "
                         f"or mode='eval'")
    return mode


def check_rate(rate: float, layer_name: str) -> float:
    """Returns ``rate`` as a float if ``0 <= rate < 1``, else raises a ValueError."""
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{layer_name} dropout rate={rate} must be in [0, 1); use e.g. 0.1")
    return rate


def dropout(x: jax.Array, rate: float, rng: jax.Array | None,
            shared_axes: Sequence[int] = (),
            mask_bits: int = DEFAULT_MASK_BITS) -> jax.Array:
    """Inverted dropout: zeroes entries with probability ``rate``, scales the rest.

    The mask comes from `revtrain.layers.dropout_masks.keep_mask`: ``mask_bits`` random bits
    per element compared with an integer threshold, so the realised drop rate is
    ``r = round(rate * 2**mask_bits) / 2**mask_bits`` (within ``7.6e-6`` of ``rate`` for 16
    bits, ``2e-3`` for 8) and kept values are scaled by ``1 / (1 - r)``, which keeps
    ``E[y] = x`` exactly. Trax draws a 32-bit uniform per element; the masks differ, not
    the distribution (up to the quantisation).

    Args:
      x: array of any shape and float dtype.
      rate: drop probability in ``[0, 1)``; 0 (or a rate that quantises to 0) returns
        ``x`` unchanged.
      rng: PRNG key for the mask; the same key gives the same mask.
      shared_axes: axes along which one mask value is shared (size 1 in the mask).
      mask_bits: random bits per mask element, 16 (default) or 8 (half the hashing).

    Returns:
      ``x * mask / (1 - r)`` in ``x.dtype``, with ``mask ~ Bernoulli(1 - r)``.

    Raises:
      ValueError: if ``rate > 0`` and ``rng`` is None, ``x`` is not of a float dtype (e.g.
        token ids: drop after the `Embedding`), a shared axis is out of range, or
        ``mask_bits`` is not 8 or 16.
    """
    check_mask_bits(mask_bits, "dropout")
    if rate == 0.0 or drop_threshold(rate, mask_bits) == 0:
        return x
    if rng is None:
        raise ValueError(f"dropout with rate={rate} needs an rng; pass a jax.random.key or "
                         f"use mode='eval'")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"dropout needs float inputs but received {x.dtype}; apply it to "
                         f"activations (e.g. after Embedding), not to integer ids")
    if any(not -x.ndim <= a < x.ndim for a in shared_axes):
        raise ValueError(f"dropout shared_axes={tuple(shared_axes)} are out of range for "
                         f"rank-{x.ndim} inputs; use axes in [-{x.ndim}, {x.ndim})")
    shared = {a % x.ndim for a in shared_axes}
    noise_shape = tuple(1 if i in shared else d for i, d in enumerate(x.shape))
    keep = keep_mask(rng, noise_shape, rate, mask_bits)
    return apply_keep_mask(x, keep, rate, mask_bits)


class Dense(Layer):
    """A fully-connected layer: ``[..., d_in] -> [..., n_units]``, ``y = x @ w + b``.

    Weights are ``(w, b)`` with ``w: float32[d_in, n_units]`` and ``b: float32[n_units]``;
    with ``use_bias=False`` they are the 1-tuple ``(w,)``, so ``weights[0]`` is always the
    kernel. Defaults as Trax's ``Dense``: Glorot-uniform kernel (Glorot & Bengio, 2010),
    bias from a normal distribution with stddev 1e-6.

    Raises (from ``pure_fn``):
      LayerError: when the input's last axis differs from the ``d_in`` seen at ``init``.
    """

    position_wise = True

    def __init__(self, n_units: int, use_bias: bool = True,
                 kernel_init: Initializer = GLOROT_UNIFORM,
                 bias_init: Initializer = TINY_NORMAL):
        super().__init__(n_in=1, n_out=1)
        if n_units < 1:
            raise ValueError(f"Dense n_units={n_units} must be >= 1")
        self._n_units = n_units
        self._use_bias = use_bias
        self._kernel_init = kernel_init
        self._bias_init = bias_init

    def forward_with_state(self, x, weights, state, rng):
        w = weights[0]
        if x.shape[-1:] != w.shape[:1]:
            raise ValueError(f"Dense expects inputs with last axis d_in={w.shape[0]} (as at "
                             f"init) but received d_in={x.shape[-1] if x.ndim else None}; "
                             f"feed [..., {w.shape[0]}] or re-init the layer")
        dtype = float_dtype(x, w.dtype)
        y = jnp.dot(x.astype(dtype), w.astype(dtype))
        if self._use_bias:
            y = y + weights[1].astype(dtype)
        return y, state

    def init_weights_and_state(self, input_signature, rng):
        if not input_signature.shape:
            raise ValueError("Dense expects inputs [..., d_in] of rank >= 1; got a scalar")
        d_in = input_signature.shape[-1]
        rng_w, rng_b = jax.random.split(rng)
        w = self._kernel_init(rng_w, (d_in, self._n_units), jnp.float32)
        if not self._use_bias:
            return (w,), ()
        return (w, self._bias_init(rng_b, (self._n_units,), jnp.float32)), ()


class Embedding(Layer):
    """Maps integer token ids to vectors: int ``[batch, length] -> [batch, length, d_feature]``.

    Weights are one ``float32[vocab_size, d_feature]`` table, initialised as in Trax (uniform
    variance scaling with fan-out ``d_feature``, so rows have norm about 1). Ids outside
    ``[0, vocab_size)`` give NaN rows (``jnp.take`` fill mode). Any leading shape works.

    Raises (from ``pure_fn``):
      LayerError: when the ids are not of an integer dtype.
    """

    def __init__(self, vocab_size: int, d_feature: int,
                 embedding_init: Initializer = EMBEDDING_INIT):
        super().__init__(n_in=1, n_out=1)
        if vocab_size < 1 or d_feature < 1:
            raise ValueError(f"Embedding needs vocab_size >= 1 and d_feature >= 1; got "
                             f"vocab_size={vocab_size}, d_feature={d_feature}")
        self._vocab_size = vocab_size
        self._d_feature = d_feature
        self._embedding_init = embedding_init

    def forward_with_state(self, x, weights, state, rng):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"Embedding expects token ids of an integer dtype (e.g. int32) "
                             f"but received {x.dtype}; cast with x.astype(jnp.int32)")
        return jnp.take(weights, x, axis=0), state

    def init_weights_and_state(self, input_signature, rng):
        del input_signature
        return self._embedding_init(rng, (self._vocab_size, self._d_feature), jnp.float32), ()


class Dropout(Layer):
    """Inverted dropout with a mask drawn from the layer's rng (see `dropout`).

    In ``'train'`` mode with ``rate > 0``: ``y = x * mask / (1 - r)``, ``mask ~
    Bernoulli(1 - r)`` with ``r`` the rate quantised to ``mask_bits`` bits (`dropout`); the
    same rng gives the same mask (the reversible trainers rely on this to recompute
    activations). Otherwise ``y = x``.

    Args:
      rate: drop probability in ``[0, 1)``.
      shared_axes: axes along which one mask value is shared (Trax's ``shared_axes``), e.g.
        ``(1,)`` drops whole feature vectors per position of a ``[batch, length, d]`` input.
      mode: ``'train'``, ``'eval'`` or ``'predict'``.
      mask_bits: random bits per mask element: 16 (rate error <= 7.6e-6) or 8 (rate error
        <= 2e-3, half the random-number work of 16).

    Under a sequence split (`revtrain.layers.sequence_parallel`) the mask of a shard's rows
    is drawn with the key folded with the shard index, unless ``shared_axes`` holds the
    length axis 1 (then every shard uses the key as given, sharing the mask along the
    whole sequence).

    Raises (from ``pure_fn``, in ``'train'`` mode with ``rate > 0``):
      LayerError: for inputs not of a float dtype, or ``shared_axes`` out of their range.
    """

    def __init__(self, rate: float = 0.0, shared_axes: Sequence[int] | None = None,
                 mode: str = "train", mask_bits: int = DEFAULT_MASK_BITS):
        super().__init__(n_in=1, n_out=1)
        self._rate = check_rate(rate, "Dropout")
        self._shared_axes = tuple(shared_axes or ())
        self._mode = check_mode(mode, "Dropout")
        self._mask_bits = check_mask_bits(mask_bits, "Dropout")

    def forward_with_state(self, x, weights, state, rng):
        if self._mode != "train":
            return x, state
        if self._rate and 1 not in {a % x.ndim for a in self._shared_axes if x.ndim}:
            rng = shard_key(rng)  # a split length: each shard draws its own rows' mask
        return dropout(x, self._rate, rng, self._shared_axes, self._mask_bits), state


class PositionalEncoding(Layer):
    """Adds the fixed sinusoidal encoding: ``[batch, length, d_feature]`` -> same shape.

    The encoding is not a weight, so it is never trained. Its rows are computed inside the
    program (`revtrain.layers.position_tables.sinusoidal_rows` at ``max_len``): equal to
    `sinusoidal_encoding`'s float64-computed table to about 2e-7, without a ``[length,
    d_feature]`` constant in the program (32 MiB at 64K tokens and d_model 128, rebuilt on
    the host at every trace), and fused into the addition. A position's row is computed
    from the position and ``max_len`` alone, the same way at every sequence length, under
    a sequence split (`revtrain.layers.sequence_parallel.sequence_sharded`: a shard adds
    the rows of its global positions) and when decoding (``'predict'`` mode of the LMs):
    equal up to the float32 rounding of each program's fusion (about 1e-7).

    As in Trax, dropout (``'train'`` mode only) applies to the encoding, not to ``x``, with
    one ``[length, d_feature]`` mask shared across the batch; under a sequence split a
    shard's mask comes from the key folded with the shard index.

    Args:
      max_len: longest sequence accepted.
      dropout: drop rate for the encoding, in ``[0, 1)``.
      mode: ``'train'``, ``'eval'`` or ``'predict'``.
      mask_bits: random bits per element of the dropout mask, 16 or 8 (`dropout`).

    Raises (from ``pure_fn``):
      LayerError: when the input is longer than ``max_len``, not of rank 3, or not of a
        float dtype (token ids: put an `Embedding` first).
    """

    def __init__(self, max_len: int = 2048, dropout: float = 0.0, mode: str = "train",
                 mask_bits: int = DEFAULT_MASK_BITS):
        super().__init__(n_in=1, n_out=1)
        self._max_len = max_len
        self._dropout = check_rate(dropout, "PositionalEncoding")
        self._mode = check_mode(mode, "PositionalEncoding")
        self._mask_bits = check_mask_bits(mask_bits, "PositionalEncoding")

    def forward_with_state(self, x, weights, state, rng):
        if x.ndim != 3:
            raise ValueError(f"PositionalEncoding expects [batch, length, d_feature] inputs; "
                             f"got rank {x.ndim}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"PositionalEncoding expects float embeddings but received "
                             f"{x.dtype}; put an Embedding layer before it")
        length, d_feature = x.shape[1], x.shape[2]
        sharded = check_local_length("PositionalEncoding", length)
        total = length if sharded is None else sharded.length
        if total > self._max_len:
            raise ValueError(f"input length {total} exceeds PositionalEncoding "
                             f"max_len={self._max_len}; build it with max_len >= {total}")
        positions = jnp.arange(length) if sharded is None else sharded.local_positions()
        pe = sinusoidal_rows(positions, d_feature, self._max_len).astype(x.dtype)
        if self._mode == "train" and self._dropout:
            pe = dropout(pe, self._dropout, shard_key(rng), mask_bits=self._mask_bits)
        return x + pe[None], state


class Flatten(Layer):
    """Keeps the first ``n_axes_to_keep`` axes and flattens the rest into one.

    ``[batch, h, w, c] -> [batch, h * w * c]`` with the default ``n_axes_to_keep=1``.

    Raises (from ``pure_fn``):
      LayerError: when the input has no more than ``n_axes_to_keep`` axes.
    """

    def __init__(self, n_axes_to_keep: int = 1):
        super().__init__(n_in=1, n_out=1)
        if n_axes_to_keep < 0:
            raise ValueError(f"Flatten n_axes_to_keep={n_axes_to_keep} must be >= 0")
        self._n_axes_to_keep = n_axes_to_keep

    def forward_with_state(self, x, weights, state, rng):
        n = self._n_axes_to_keep
        if x.ndim <= n:
            raise ValueError(f"Flatten(n_axes_to_keep={n}) needs inputs with more than {n} "
                             f"axes; got shape {x.shape}")
        if n <= 1 and x.ndim > 2:
            check_not_split(f"Flatten(n_axes_to_keep={n})", "keep the batch and length axes "
                            "(n_axes_to_keep=2) or use seq=1", why="merges axis 1")
        return jnp.reshape(x, x.shape[:n] + (-1,)), state


class Mean(Layer):
    """Mean over ``axis`` (an int or a tuple of ints), as ``jnp.mean``."""

    def __init__(self, axis: int | Sequence[int] = -1, keepdims: bool = False):
        super().__init__(n_in=1, n_out=1)
        self._axis = axis if isinstance(axis, int) else tuple(axis)
        self._keepdims = keepdims

    def forward_with_state(self, x, weights, state, rng):
        axes = (self._axis,) if isinstance(self._axis, int) else self._axis
        if any(not -x.ndim <= a < x.ndim for a in axes):
            raise ValueError(f"Mean axis={self._axis} is out of range for inputs of shape "
                             f"{x.shape}; use axes in [-{x.ndim}, {x.ndim})")
        if x.ndim > 2 and 1 in {a % x.ndim for a in axes}:
            check_not_split(f"Mean(axis={self._axis})", "average over other axes (or weight "
                            "positions in a loss) or use seq=1", why="averages")
        return jnp.mean(x, axis=self._axis, keepdims=self._keepdims), state


class ShiftRight(Layer):
    """Shifts ``[batch, length, ...]`` right by ``n_positions`` along axis 1, padding zeros.

    Used to make decoder inputs from targets (``y[:, t] = x[:, t - n]``). As in Trax, the
    shift is skipped in ``'predict'`` mode.
    """

    def __init__(self, n_positions: int = 1, mode: str = "train"):
        super().__init__(n_in=1, n_out=1)
        if n_positions < 0:
            raise ValueError(f"ShiftRight n_positions={n_positions} must be >= 0")
        self._n_positions = n_positions
        self._mode = check_mode(mode, "ShiftRight")

    def forward_with_state(self, x, weights, state, rng):
        if x.ndim < 2:
            raise ValueError(f"ShiftRight expects inputs [batch, length, ...]; got shape "
                             f"{x.shape}")
        if self._mode == "predict" or self._n_positions == 0:
            return x, state
        check_not_split("ShiftRight", "shift the inputs in the data pipeline (the LMs take "
                        "inputs = window[:-1]) or use seq=1", why="moves positions")
        pad = [(0, 0)] * x.ndim
        pad[1] = (self._n_positions, 0)
        return jnp.pad(x, pad)[:, :x.shape[1]], state
