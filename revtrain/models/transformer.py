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
from revtrain.layers.attention.causal import CausalAttention
from revtrain.layers.chunk import Chunk, check_chunk_size
from revtrain.layers.core import check_rate
from revtrain.layers.core import dropout as drop_rows
from revtrain.layers.dropout_masks import DEFAULT_MASK_BITS, MASK_BITS, is_mask_bits
from revtrain.layers.normalization import LayerNorm
from revtrain.layers.position_tables import sinusoidal_encoding, sinusoidal_rows
from revtrain.layers.sequence_parallel import check_not_split


class _Cast(Layer):
    """Casts a floating-point input to ``dtype`` (integer inputs pass unchanged)."""

    position_wise = True

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


POS_TYPES = ("sinusoidal", "rotary", "trained")


def _check_long_context(attention_type: Any, ff_chunk_size: Any, pos_type: Any) -> None:
    """Raises ValueError for a non-callable ``attention_type``, a non-positive
    ``ff_chunk_size`` or an unknown ``pos_type``."""
    if not callable(attention_type):
        raise ValueError(f"attention_type={attention_type!r} is not callable; pass a layer "
                         f"class or factory such as CausalAttention or functools.partial("
                         f"CausalAttention, implementation='blockwise')")
    if ff_chunk_size is not None:
        check_chunk_size(ff_chunk_size, "the LM's", "ff_chunk_size")
    if pos_type not in POS_TYPES:
        raise ValueError(f"pos_type={pos_type!r} is not one of {POS_TYPES}; use 'sinusoidal' "
                         f"(an added table), 'rotary' (RoFormer rotations in attention) or "
                         f"'trained' (a trained table, Trax's default)")


def _attention(attention_type: Callable[..., Layer], d_model: int, n_heads: int,
               dropout: float, mode: str, max_len: int, mask_bits: int,
               pos_type: str, widths: tuple[int | None, int | None] = (None, None)) -> Layer:
    """``attention_type(d_model, n_heads=, dropout=, mode=, max_len=, mask_bits=)``, with
    ``rotary=True`` added for ``pos_type='rotary'`` and ``d_attention_key=``,
    ``d_attention_value=`` for the ``widths`` that are set; in ``'predict'`` mode
    ``max_len`` is the key/value cache length, else None."""
    kwargs = dict(n_heads=n_heads, dropout=dropout, mode=mode,
                  max_len=max_len if mode == "predict" else None, mask_bits=mask_bits)
    if pos_type == "rotary":
        kwargs["rotary"] = True
    for name, width in zip(("d_attention_key", "d_attention_value"), widths, strict=True):
        if width is not None:
            kwargs[name] = width
    layer = attention_type(d_model, **kwargs)
    if not isinstance(layer, Layer) or layer.n_in != 1 or layer.n_out != 1:
        raise ValueError(f"attention_type={attention_type!r} gave {layer!r}, not a layer "
                         f"with one input and one output; pass a layer class or factory "
                         f"such as CausalAttention")
    return layer


class _PositionalEncodingAt(Layer):
    """`PositionalEncoding` for incremental decoding: adds the rows of the positions decoded.

    Its state is the next position (int32[]), so ``[batch, length, d]`` inputs get rows
    ``position .. position + length - 1`` (Trax's ``PositionalEncoding`` in ``'predict'``
    mode), computed as `PositionalEncoding` computes them, so the rows a ``'train'``-mode
    forward adds at those positions (up to float32 rounding). No weights, as
    `PositionalEncoding`, so train-mode weights load unchanged.
    """

    def __init__(self, max_len: int):
        super().__init__(n_in=1, n_out=1, name="PositionalEncoding")
        self._max_len = max_len

    def forward_with_state(self, x, weights, state, rng):
        check_not_split("PositionalEncoding (mode='predict')", "decode without a sequence "
                        "split (seq=1)", why="counts decoded positions")
        positions = state + jnp.arange(x.shape[1], dtype=jnp.int32)
        rows = sinusoidal_rows(positions, x.shape[-1], self._max_len).astype(x.dtype)
        return x + rows[None], state + x.shape[1]

    def init_weights_and_state(self, input_signature, rng):
        return (), jnp.zeros((), jnp.int32)


class _TrainedPositionalEncoding(Layer):
    """Adds a trained ``[max_len, d_feature]`` table, initialised with the sinusoids of
    `PositionalEncoding` (Trax's ``PositionalEncoding``, whose table is a weight).

    Dropout (``'train'`` mode) applies to the added rows, as in `PositionalEncoding`; in
    ``'predict'`` mode the state is the next position, so decoding adds the rows of the
    positions decoded. A sequence split is refused (the table is not split by position).
    """

    def __init__(self, max_len: int, dropout: float, mode: str, mask_bits: int):
        super().__init__(n_in=1, n_out=1, name="TrainedPositionalEncoding")
        self._max_len, self._dropout = max_len, check_rate(dropout, "PositionalEncoding")
        self._mode, self._mask_bits = mode, mask_bits

    def forward_with_state(self, x, weights, state, rng):
        check_not_split("pos_type='trained'", "use pos_type='sinusoidal' or 'rotary' with a "
                        "sequence split", why="adds rows of one table")
        start = state if self._mode == "predict" else 0
        if self._mode != "predict" and x.shape[1] > self._max_len:
            raise ValueError(f"input length {x.shape[1]} exceeds max_len={self._max_len}; "
                             f"build the model with max_len >= {x.shape[1]}")
        rows = jax.lax.dynamic_slice_in_dim(weights, start, x.shape[1]).astype(x.dtype)
        if self._mode == "train" and self._dropout:
            rows = drop_rows(rows, self._dropout, rng, mask_bits=self._mask_bits)
        new_state = state + x.shape[1] if self._mode == "predict" else state
        return x + rows[None], new_state

    def init_weights_and_state(self, input_signature, rng):
        table = jnp.asarray(sinusoidal_encoding(self._max_len, input_signature.shape[-1]))
        state = jnp.zeros((), jnp.int32) if self._mode == "predict" else ()
        return table, state


def _feed_forward(d_model: int, d_ff: int, dropout: float,
                  ff_activation: Callable[[], Layer], mode: str,
                  compute_dtype: Any, mask_bits: int, ff_chunk_size: int | None) -> list[Layer]:
    """Pre-norm feed-forward: LayerNorm, [cast], Dense(d_ff), act, Dropout, Dense, Dropout;
    with ``ff_chunk_size`` all of it in one `Chunk` of that many positions."""
    layers = [LayerNorm(), *_cast(compute_dtype), Dense(d_ff), ff_activation(),
              Dropout(dropout, mode=mode, mask_bits=mask_bits), Dense(d_model),
              Dropout(dropout, mode=mode, mask_bits=mask_bits)]
    return layers if ff_chunk_size is None else [Chunk(Serial(*layers), ff_chunk_size)]


def _embed(vocab_size: int, d_model: int, max_len: int, dropout: float,
           mode: str, mask_bits: int, pos_type: str) -> list[Layer]:
    """Embedding and Dropout, then the sinusoidal (or trained) table unless positions are
    rotary."""
    layers = [Embedding(vocab_size, d_model), Dropout(dropout, mode=mode, mask_bits=mask_bits)]
    if pos_type == "rotary":
        return layers
    if pos_type == "trained":
        return layers + [_TrainedPositionalEncoding(max_len, dropout, mode, mask_bits)]
    position = (_PositionalEncodingAt(max_len) if mode == "predict" else
                PositionalEncoding(max_len, dropout=dropout, mode=mode, mask_bits=mask_bits))
    return layers + [position]


def _head(vocab_size: int, ff_chunk_size: int | None, streams: int = 1) -> list[Layer]:
    """``[Concatenate] LayerNorm, Dense(vocab_size), LogSoftmax``; with ``ff_chunk_size`` the
    position-wise normalisation (and the concatenation of ``streams > 1`` residual streams)
    runs in a `Chunk` too, so its ``[batch, length, streams * d_model]`` temporaries exist
    one chunk at a time; the logits are chunked by the fused loss
    (`revtrain.layers.fused_head`)."""
    norm = [Concatenate(), LayerNorm()] if streams > 1 else [LayerNorm()]
    if ff_chunk_size is not None:
        norm = [Chunk(Serial(*norm), ff_chunk_size)]
    return [*norm, Dense(vocab_size), LogSoftmax()]


def _accepts(model: Layer, vocab_size: int, max_len: int) -> Layer:
    """Records what ``model`` accepts as public attributes, read by the training loop to
    check the data before the first step (`revtrain.training.validation`)."""
    model.vocab_size, model.max_len = vocab_size, max_len
    return model


def ReversibleTransformerLM(vocab_size: int = 256, d_model: int = 512, d_ff: int = 2048,
                            n_layers: int = 6, n_heads: int = 8, max_len: int = 2048,
                            dropout: float = 0.1, ff_activation: Callable[[], Layer] = Relu,
                            mode: str = "train", compute_dtype: Any = jnp.float32,
                            dropout_mask_bits: int = DEFAULT_MASK_BITS,
                            attention_type: Callable[..., Layer] = CausalAttention,
                            ff_chunk_size: int | None = None,
                            pos_type: str = "sinusoidal",
                            d_attention_key: int | None = None,
                            d_attention_value: int | None = None) -> Layer:
    """A Reformer-style reversible Transformer LM: ``int32[batch, length]`` -> log-probs.

    Layers: ``Embedding, Dropout, PositionalEncoding, Dup``, then one `ReversibleSerial` of
    ``n_layers`` blocks ``[ReversibleHalfResidual(LayerNorm, attention_layer=
    attention_type(...)), ReversibleSwap, ReversibleHalfResidual(LayerNorm, Dense(d_ff),
    activation, Dropout, Dense(d_model), Dropout), ReversibleSwap]`` (pre-norm; each block
    maps ``(x1, x2)`` to ``(x1 + Attn(x2), x2 + FF(x1 + Attn(x2)))``), then ``Concatenate``
    (``[batch, length, 2 * d_model]``), ``LayerNorm, Dense(vocab_size), LogSoftmax``.

    With ``compute_dtype=jnp.bfloat16`` the inside of each half-residual runs in bfloat16
    (a cast after its LayerNorm), while the two residual streams stay float32: bfloat16
    streams lose the exactness of the subtraction that reversal relies on and drift badly
    with depth. The cast has no weights but adds one entry to each half-residual's weights
    tuple, so float32 and bfloat16 models have different weight trees.

    Long sequences (Reformer's recipe, Kitaev et al., 2020): ``attention_type=
    functools.partial(CausalAttention, implementation='blockwise')`` (or the default
    implementation, which turns blockwise above 64 MiB of logits) keeps attention linear
    in the length, ``ff_chunk_size`` the feed-forward, and ``pos_type='rotary'`` drops the
    position table.

    Args:
      vocab_size: number of token ids; the output's last axis.
      d_model: width of each residual stream.
      d_ff: hidden width of the feed-forward blocks.
      n_layers: number of (attention, feed-forward) block pairs.
      n_heads: attention heads; must divide ``d_model``.
      max_len: longest sequence accepted (the sinusoidal table's and the decoding cache's
        length).
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
      attention_type: the attention layer (Trax's name): a class or factory called as
        ``attention_type(d_model, n_heads=, dropout=, mode=, max_len=, mask_bits=)``
        (``max_len`` is the cache length in ``'predict'`` mode, else None), plus
        ``rotary=True`` when ``pos_type='rotary'`` and the widths below when they are
        set. Default `CausalAttention`.
      ff_chunk_size: run each feed-forward block, and the head's concatenation and
        LayerNorm, over chunks of this many positions (`revtrain.layers.Chunk`; Trax's
        ``ff_chunk_size``), so their ``[batch, length, d_ff]`` and ``[batch, length, 2 *
        d_model]`` temporaries exist one chunk at a time; in `ReversibleTransformerLM`
        the half-residuals' reverse passes run over chunks of this size too (everything
        but attention's core: `revtrain.layers.position_chunks`); None runs them whole. Chunking
        adds a level to those weights trees, and with dropout the feed-forward masks
        depend on the chunk size.
      pos_type: ``'sinusoidal'`` (the added table of `PositionalEncoding`),
        ``'rotary'`` (no table: queries and keys rotated by their positions, RoFormer) or
        ``'trained'`` (an added ``[max_len, d_model]`` weight initialised with the same
        sinusoids, as Trax's ``PositionalEncoding``; refused under a sequence split).
      d_attention_key: per-head width of attention's queries and keys (Trax's
        ``ReformerLM`` name), passed to ``attention_type`` when set; None (default)
        leaves the layer's own default, ``d_model // n_heads``. Trax's ``ReformerLM``
        defaults to 64.
      d_attention_value: per-head width of attention's values, passed as
        ``d_attention_key`` is.

    Returns:
      A `Serial`: ``int32[batch, length] -> float32[batch, length, vocab_size]``, with
      attributes ``vocab_size`` and ``max_len``.

    Raises:
      ValueError: when ``n_heads`` does not divide ``d_model`` and a width is left at its
        default (from `CausalAttention`),
        ``n_layers < 0``, ``compute_dtype`` is not a float dtype, ``dropout_mask_bits``
        is not 8 or 16, ``ff_chunk_size`` is not a positive int or None, ``pos_type`` is
        unknown, ``attention_type`` does not make a one-in-one-out layer, or rotary
        positions meet an odd head size.
    """
    _check_arguments(n_layers, compute_dtype, dropout_mask_bits)
    _check_long_context(attention_type, ff_chunk_size, pos_type)
    blocks = []
    for _ in range(n_layers):
        blocks += [
            ReversibleHalfResidual(LayerNorm(), *_cast(compute_dtype),
                                   attention_layer=_attention(
                                       attention_type, d_model, n_heads, dropout, mode,
                                       max_len, dropout_mask_bits, pos_type,
                                       (d_attention_key, d_attention_value)),
                                   chunk_size=ff_chunk_size),
            ReversibleSwap(),
            ReversibleHalfResidual(*_feed_forward(d_model, d_ff, dropout, ff_activation, mode,
                                                  compute_dtype, dropout_mask_bits,
                                                  ff_chunk_size), chunk_size=ff_chunk_size),
            ReversibleSwap(),
        ]
    model = Serial(_embed(vocab_size, d_model, max_len, dropout, mode, dropout_mask_bits,
                          pos_type),
                   Dup(),
                   ReversibleSerial(blocks), _head(vocab_size, ff_chunk_size, streams=2),
                   name="ReversibleTransformerLM")
    return _accepts(model, vocab_size, max_len)


def TransformerLM(vocab_size: int = 256, d_model: int = 512, d_ff: int = 2048,
                  n_layers: int = 6, n_heads: int = 8, max_len: int = 2048,
                  dropout: float = 0.1, ff_activation: Callable[[], Layer] = Relu,
                  mode: str = "train", compute_dtype: Any = jnp.float32,
                  dropout_mask_bits: int = DEFAULT_MASK_BITS,
                  attention_type: Callable[..., Layer] = CausalAttention,
                  ff_chunk_size: int | None = None, pos_type: str = "sinusoidal",
                  d_attention_key: int | None = None,
                  d_attention_value: int | None = None) -> Layer:
    """The plain (non-reversible) pre-norm Transformer LM, the baseline of the reversible one.

    Layers: ``Embedding, Dropout, PositionalEncoding``, ``n_layers`` pairs of
    ``Residual(LayerNorm, attention_type(...))`` and ``Residual(LayerNorm, Dense(d_ff),
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
    _check_long_context(attention_type, ff_chunk_size, pos_type)
    back = [] if not _cast(compute_dtype) else [_Cast(jnp.float32)]
    blocks = []
    for _ in range(n_layers):
        blocks += [
            Residual(LayerNorm(), *_cast(compute_dtype),
                     _attention(attention_type, d_model, n_heads, dropout, mode, max_len,
                                dropout_mask_bits, pos_type,
                                (d_attention_key, d_attention_value)), *back),
            Residual(*_feed_forward(d_model, d_ff, dropout, ff_activation, mode,
                                    compute_dtype, dropout_mask_bits, ff_chunk_size), *back),
        ]
    model = Serial(_embed(vocab_size, d_model, max_len, dropout, mode, dropout_mask_bits,
                          pos_type),
                   blocks,
                   _head(vocab_size, ff_chunk_size), name="TransformerLM")
    return _accepts(model, vocab_size, max_len)
