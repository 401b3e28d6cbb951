"""Decoder-only Transformer language models: reversible (Reformer-style) and plain.

Both take token ids ``int32[batch, length]`` and return log-probabilities
``float32[batch, length, vocab_size]``. They have no ``ShiftRight``: the data pipeline
already feeds ``inputs = window[:-1]`` and ``targets = window[1:]``. A trainer takes the
model followed by its loss, e.g. ``Serial(ReversibleTransformerLM(...), CrossEntropyLoss())``
on ``(inputs, targets, weights)``.

References:
  Vaswani et al., "Attention Is All You Need", NeurIPS 2017 (the Transformer); Kitaev et
  al., "Reformer: The Efficient Transformer", ICLR 2020 (reversible half-residual blocks,
  two residual streams concatenated at the end); Trax's ``TransformerLM`` and
  ``ReformerLM`` (arguments and defaults).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from revtrain.layers import (
    Concatenate,
    Dense,
    Dropout,
    Dup,
    Embedding,
    Layer,
    LogSoftmax,
    PositionalEncoding,
    Relu,
    Residual,
    ReversibleHalfResidual,
    ReversibleSerial,
    ReversibleSwap,
    Serial,
)
from revtrain.layers.attention import CausalAttention
from revtrain.layers.core import sinusoidal_encoding
from revtrain.layers.dropout_masks import DEFAULT_MASK_BITS, MASK_BITS, is_mask_bits
from revtrain.layers.normalization import LayerNorm


class _Cast(Layer):
    """Casts a floating-point input to ``dtype`` (integer inputs pass unchanged)."""

    def __init__(self, dtype: Any):
        super().__init__(n_in=1, n_out=1, name=f"Cast[{jnp.dtype(dtype).name}]")
        self._dtype = jnp.dtype(dtype)

    def forward_with_state(self, x, weights, state, rng):
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(self._dtype)
        return x, state


def _cast(compute_dtype: Any) -> list[Layer]:
    """``[_Cast(compute_dtype)]``, or nothing when computing in float32."""
    return [] if jnp.dtype(compute_dtype) == jnp.float32 else [_Cast(compute_dtype)]


def _check_arguments(n_layers: int, compute_dtype: Any, mask_bits: Any) -> None:
    """Raises ValueError for a negative ``n_layers``, a non-float ``compute_dtype`` or
    ``dropout_mask_bits`` other than 8 or 16."""
    if n_layers < 0:
        raise ValueError(f"n_layers={n_layers} must be >= 0")
    if not is_mask_bits(mask_bits):
        raise ValueError(f"dropout_mask_bits={mask_bits!r} is not one of {MASK_BITS}; use 16 "
                         f"(rate error <= 7.6e-6) or 8 (faster, rate error <= 2e-3)")
    try:
        dtype = jnp.dtype(compute_dtype)
    except TypeError as e:
        raise ValueError(f"compute_dtype={compute_dtype!r} is not a dtype; use jnp.float32 or "
                         f"jnp.bfloat16 (or their names)") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"compute_dtype={dtype.name} is not a float dtype; use jnp.float32 or "
                         f"jnp.bfloat16")


def _attention(d_model: int, n_heads: int, dropout: float, mode: str, max_len: int,
               mask_bits: int) -> Layer:
    """Causal attention; in ``'predict'`` mode with a key/value cache of ``max_len``."""
    return CausalAttention(d_model, n_heads=n_heads, dropout=dropout, mode=mode,
                           max_len=max_len if mode == "predict" else None,
                           mask_bits=mask_bits)


class _PositionalEncodingAt(Layer):
    """`PositionalEncoding` for incremental decoding: adds the rows of the positions decoded.

    Its state is the next position (int32[]), so ``[batch, length, d]`` inputs get rows
    ``position .. position + length - 1`` of the same sinusoidal table (Trax's
    ``PositionalEncoding`` in ``'predict'`` mode). No weights, as `PositionalEncoding`, so
    train-mode weights load unchanged.
    """

    def __init__(self, max_len: int):
        super().__init__(n_in=1, n_out=1, name="PositionalEncoding")
        self._max_len = max_len

    def forward_with_state(self, x, weights, state, rng):
        table = jnp.asarray(sinusoidal_encoding(self._max_len, x.shape[-1]), x.dtype)
        rows = jax.lax.dynamic_slice_in_dim(table, state, x.shape[1])
        return x + rows[None], state + x.shape[1]

    def init_weights_and_state(self, input_signature, rng):
        return (), jnp.zeros((), jnp.int32)


def _feed_forward(d_model: int, d_ff: int, dropout: float,
                  ff_activation: Callable[[], Layer], mode: str,
                  compute_dtype: Any, mask_bits: int) -> list[Layer]:
    """Pre-norm feed-forward: LayerNorm, [cast], Dense(d_ff), act, Dropout, Dense, Dropout."""
    return [LayerNorm(), *_cast(compute_dtype), Dense(d_ff), ff_activation(),
            Dropout(dropout, mode=mode, mask_bits=mask_bits), Dense(d_model),
            Dropout(dropout, mode=mode, mask_bits=mask_bits)]


def _embed(vocab_size: int, d_model: int, max_len: int, dropout: float,
           mode: str, mask_bits: int) -> list[Layer]:
    position = (_PositionalEncodingAt(max_len) if mode == "predict" else
                PositionalEncoding(max_len, dropout=dropout, mode=mode, mask_bits=mask_bits))
    return [Embedding(vocab_size, d_model), Dropout(dropout, mode=mode, mask_bits=mask_bits),
            position]


def _head(vocab_size: int) -> list[Layer]:
    return [LayerNorm(), Dense(vocab_size), LogSoftmax()]


def _accepts(model: Layer, vocab_size: int, max_len: int) -> Layer:
    """Records what ``model`` accepts as public attributes, read by the training loop to
    check the data before the first step (`revtrain.training.validation`)."""
    model.vocab_size, model.max_len = vocab_size, max_len
    return model


def ReversibleTransformerLM(vocab_size: int = 256, d_model: int = 512, d_ff: int = 2048,
                            n_layers: int = 6, n_heads: int = 8, max_len: int = 2048,
                            dropout: float = 0.1, ff_activation: Callable[[], Layer] = Relu,
                            mode: str = "train", compute_dtype: Any = jnp.float32,
                            dropout_mask_bits: int = DEFAULT_MASK_BITS) -> Layer:
    """A Reformer-style reversible Transformer LM: ``int32[batch, length]`` -> log-probs.

    Layers: ``Embedding, Dropout, PositionalEncoding, Dup``, then one `ReversibleSerial` of
    ``n_layers`` blocks ``[ReversibleHalfResidual(LayerNorm, attention_layer=
    CausalAttention), ReversibleSwap, ReversibleHalfResidual(LayerNorm, Dense(d_ff),
    activation, Dropout, Dense(d_model), Dropout), ReversibleSwap]`` (pre-norm; each block
    maps ``(x1, x2)`` to ``(x1 + Attn(x2), x2 + FF(x1 + Attn(x2)))``), then ``Concatenate``
    (``[batch, length, 2 * d_model]``), ``LayerNorm, Dense(vocab_size), LogSoftmax``.

    With ``compute_dtype=jnp.bfloat16`` the inside of each half-residual runs in bfloat16
    (a cast after its LayerNorm), while the two residual streams stay float32: bfloat16
    streams lose the exactness of the subtraction that reversal relies on and drift badly
    with depth. The cast has no weights but adds one entry to each half-residual's weights
    tuple, so float32 and bfloat16 models have different weight trees.

    Args:
      vocab_size: number of token ids; the output's last axis.
      d_model: width of each residual stream.
      d_ff: hidden width of the feed-forward blocks.
      n_layers: number of (attention, feed-forward) block pairs.
      n_heads: attention heads; must divide ``d_model``.
      max_len: longest sequence accepted.
      dropout: rate for embedding, positional-encoding, attention and feed-forward dropout.
      ff_activation: a layer class (or function) giving the feed-forward activation.
      mode: ``'train'`` (dropout on), ``'eval'`` or ``'predict'`` (incremental decoding:
        attention keeps a key/value cache of ``max_len`` positions and the positional
        encoding its position, in the layer state; see `revtrain.training.decoding`).
      compute_dtype: dtype inside the half-residuals: ``jnp.float32`` or ``jnp.bfloat16``
        (a dtype or its name, e.g. ``"bfloat16"`` from gin).
      dropout_mask_bits: random bits per element of every dropout mask: 16 (the realised
        rate is within 7.6e-6 of ``dropout``) or 8 (within 2e-3: 0.1 becomes 26/256 =
        0.1016; the masks take a quarter of the time on a 2-core CPU). See
        `revtrain.layers.dropout_masks`.

    Returns:
      A `Serial`: ``int32[batch, length] -> float32[batch, length, vocab_size]``, with
      attributes ``vocab_size`` and ``max_len``.

    Raises:
      ValueError: when ``n_heads`` does not divide ``d_model`` (from `CausalAttention`),
        ``n_layers < 0``, ``compute_dtype`` is not a float dtype or ``dropout_mask_bits``
        is not 8 or 16.
    """
    _check_arguments(n_layers, compute_dtype, dropout_mask_bits)
    blocks = []
    for _ in range(n_layers):
        blocks += [
            ReversibleHalfResidual(LayerNorm(), *_cast(compute_dtype),
                                   attention_layer=_attention(d_model, n_heads, dropout, mode,
                                                              max_len, dropout_mask_bits)),
            ReversibleSwap(),
            ReversibleHalfResidual(*_feed_forward(d_model, d_ff, dropout, ff_activation, mode,
                                                  compute_dtype, dropout_mask_bits)),
            ReversibleSwap(),
        ]
    model = Serial(_embed(vocab_size, d_model, max_len, dropout, mode, dropout_mask_bits),
                   Dup(),
                   ReversibleSerial(blocks), Concatenate(), _head(vocab_size),
                   name="ReversibleTransformerLM")
    return _accepts(model, vocab_size, max_len)


def TransformerLM(vocab_size: int = 256, d_model: int = 512, d_ff: int = 2048,
                  n_layers: int = 6, n_heads: int = 8, max_len: int = 2048,
                  dropout: float = 0.1, ff_activation: Callable[[], Layer] = Relu,
                  mode: str = "train", compute_dtype: Any = jnp.float32,
                  dropout_mask_bits: int = DEFAULT_MASK_BITS) -> Layer:
    """The plain (non-reversible) pre-norm Transformer LM, the baseline of the reversible one.

    Layers: ``Embedding, Dropout, PositionalEncoding``, ``n_layers`` pairs of
    ``Residual(LayerNorm, CausalAttention)`` and ``Residual(LayerNorm, Dense(d_ff),
    activation, Dropout, Dense(d_model), Dropout)``, then ``LayerNorm, Dense(vocab_size),
    LogSoftmax``. Arguments as `ReversibleTransformerLM`; with bfloat16 ``compute_dtype`` the
    residual branches compute in bfloat16 and are cast back to the float32 stream.

    Returns:
      A `Serial`: ``int32[batch, length] -> float32[batch, length, vocab_size]``, with
      attributes ``vocab_size`` and ``max_len``.

    Raises:
      ValueError: as `ReversibleTransformerLM`.
    """
    _check_arguments(n_layers, compute_dtype, dropout_mask_bits)
    back = [] if not _cast(compute_dtype) else [_Cast(jnp.float32)]
    blocks = []
    for _ in range(n_layers):
        blocks += [
            Residual(LayerNorm(), *_cast(compute_dtype),
                     _attention(d_model, n_heads, dropout, mode, max_len,
                                dropout_mask_bits), *back),
            Residual(*_feed_forward(d_model, d_ff, dropout, ff_activation, mode,
                                    compute_dtype, dropout_mask_bits), *back),
        ]
    model = Serial(_embed(vocab_size, d_model, max_len, dropout, mode, dropout_mask_bits),
                   blocks,
                   _head(vocab_size), name="TransformerLM")
    return _accepts(model, vocab_size, max_len)
