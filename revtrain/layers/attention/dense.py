"""What both attention layers share: dense causal attention and the head projections.

`dot_product_attention` and `einsum_attention` are scaled dot-product attention
(Vaswani et al., 2017, section 3.2) over ``[batch, length, n_heads, d_head]`` queries, keys
and values, causal, with logits and softmax in at least float32 and attention dropout by
the position-keyed mask of `revtrain.layers.dropout_masks` (so the full and blockwise
paths of `revtrain.layers.CausalAttention` drop alike). `project`, `by_head` and
`init_projections` are the ``(w: [d_in, d_out], b: [d_out])`` projections of
`CausalAttention` and `revtrain.layers.LSHCausalAttention` (Trax's ``Dense``
initialisers), and `head_widths` their per-head query/key and value widths.

References: Vaswani et al., 2017, "Attention Is All You Need"; Trax's
``trax.layers.attention`` (dropout on the attention probabilities).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revtrain.layers.core import GLOROT_UNIFORM, TINY_NORMAL
from revtrain.layers.dropout_masks import (
    DEFAULT_MASK_BITS,
    apply_keep_mask,
    check_mask_bits,
    drop_threshold,
    mask_seed,
    position_keep_mask,
)
from revtrain.layers.sequence_parallel import check_not_split


def causal_mask(length: int) -> jax.Array:
    """Returns bool ``[length, length]``, True where query ``i`` may attend to key ``j <= i``."""
    return jnp.tril(jnp.ones((length, length), dtype=bool))


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                          mask: jax.Array | None = None, dropout_rate: float = 0.0,
                          rng: jax.Array | None = None, *, is_causal: bool = False,
                          implementation: str | None = None,
                          mask_bits: int = DEFAULT_MASK_BITS, head_start: Any = 0,
                          total_heads: int | None = None) -> jax.Array:
    """Scaled dot-product attention over heads.

    Without dropout (``dropout_rate == 0``) this is ``jax.nn.dot_product_attention``, with
    its ``implementation``: None (JAX's default, XLA's attention in jax 0.8-0.10) or
    ``'cudnn'`` (cuDNN's fused flash attention: NVIDIA GPUs, float16/bfloat16 inputs; JAX
    raises where it does not apply). With dropout, or for what ``jax.nn`` does not take
    (``q, k, v`` of different dtypes; float64, whose logits it would round to float32; a
    ``v`` whose ``d_head`` differs from ``q``'s), a plain einsum-softmax-einsum path
    (`einsum_attention`) that drops attention probabilities (`revtrain.layers.core.dropout`,
    Trax's place for attention dropout). Both compute logits and softmax in at least
    float32 and agree to float rounding.

    Args:
      q: ``[batch, length_q, n_heads, d_head]`` queries.
      k: ``[batch, length_k, n_heads, d_head]`` keys, of ``q``'s dtype.
      v: ``[batch, length_k, n_heads, d_head]`` values, of ``q``'s dtype.
      mask: None, or bool broadcastable to ``[batch, n_heads, length_q, length_k]``; False
        entries get zero probability. Every query must see at least one key.
      dropout_rate: drop rate for the attention probabilities (0 disables dropout).
      rng: PRNG key for the dropout mask; needed when ``dropout_rate > 0``.
      is_causal: also mask keys after each query (query ``i`` sees keys ``j <= i``; needs
        ``length_q == length_k``). Lets the fused kernels skip the masked blocks.
      implementation: passed to ``jax.nn.dot_product_attention`` (see above).
      mask_bits: random bits per element of the dropout mask, 16 or 8
        (`revtrain.layers.dropout_masks`).
      head_start: when ``q, k, v`` hold heads ``head_start ..`` of an attention of
        ``total_heads`` heads (default: all), so that a call per head drops what one call
        over all heads would.
      total_heads: the attention's number of heads (default: ``n_heads``).

    Returns:
      ``[batch, length_q, n_heads, d_head]`` in ``v.dtype``.
    """
    _check_whole(is_causal, "dot_product_attention")
    fused = (dropout_rate == 0.0 and q.dtype == k.dtype == v.dtype
             and jnp.promote_types(q.dtype, jnp.float32) == jnp.float32
             and q.shape[-1] == v.shape[-1])
    if fused:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal,
                                            implementation=implementation)
    return einsum_attention(q, k, v, mask, dropout_rate, rng, is_causal=is_causal,
                            mask_bits=mask_bits, head_start=head_start,
                            total_heads=total_heads)


def einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     mask: jax.Array | None = None, dropout_rate: float = 0.0,
                     rng: jax.Array | None = None, *, is_causal: bool = False,
                     mask_bits: int = DEFAULT_MASK_BITS, head_start: Any = 0,
                     total_heads: int | None = None) -> jax.Array:
    """`dot_product_attention` as plain einsums (materialises the attention probabilities).

    The path `dot_product_attention` takes when dropping attention probabilities; with
    ``dropout_rate == 0`` it equals ``jax.nn.dot_product_attention``. Arguments, shapes and
    dtypes as `dot_product_attention`.
    """
    _check_whole(is_causal, "einsum_attention")
    if is_causal:
        causal = causal_mask(q.shape[1])
        mask = causal if mask is None else jnp.logical_and(mask, causal)
    compute = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=compute)
    logits = logits / math.sqrt(q.shape[-1])
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(compute).min)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = _drop_probabilities(probs, dropout_rate, rng, mask_bits, head_start, total_heads)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


def _check_whole(is_causal: bool, owner: str) -> None:
    """Raises ValueError for causal self-attention under a sequence split: these functions
    see this device's rows only (`revtrain.layers.sequence_parallel`)."""
    if is_causal:
        check_not_split(owner, "use revtrain.layers.attention.ring (or CausalAttention, "
                        "which runs it)", why="attends to keys")


def _drop_probabilities(probs: jax.Array, rate: float, rng: jax.Array | None,
                        mask_bits: int, head_start: Any = 0,
                        total_heads: int | None = None) -> jax.Array:
    """Attention dropout on ``[batch, n_heads, length_q, length_k]`` probabilities, with
    the position-keyed mask the blockwise path draws (module docstring)."""
    check_mask_bits(mask_bits, "attention dropout")
    if rate == 0.0 or drop_threshold(rate, mask_bits) == 0:
        return probs
    if rng is None:
        raise ValueError(f"attention dropout with rate={rate} needs an rng; pass a "
                         f"jax.random.key or use mode='eval'")
    keep = position_keep_mask(mask_seed(rng), probs.shape, 0, 0, probs.shape[2], rate,
                              mask_bits, head_start=head_start, total_heads=total_heads)
    return apply_keep_mask(probs, keep, rate, mask_bits)


def project(pair: tuple[jax.Array, jax.Array], x: jax.Array) -> jax.Array:
    """``x @ w + b`` for one ``(w, b)`` projection pair, in ``x``'s dtype."""
    w, b = pair
    return jnp.dot(x, w.astype(x.dtype)) + b.astype(x.dtype)


def head_widths(d_feature: int, n_heads: int, d_attention_key: int | None,
                d_attention_value: int | None, owner: str) -> tuple[int, int]:
    """``(d_key, d_value)``: the per-head widths of queries/keys and of values.

    Each defaults to ``d_feature // n_heads`` (which then must divide); Trax's
    ``ReformerLM`` names them ``d_attention_key`` and ``d_attention_value``.

    Raises:
      ValueError: for a width that is not a positive int, or a default width where
        ``n_heads`` does not divide ``d_feature``; the message names the value and the fix.
    """
    widths = []
    for name, value in (("d_attention_key", d_attention_key),
                        ("d_attention_value", d_attention_value)):
        if value is None:
            if d_feature % n_heads:
                raise ValueError(f"{owner} d_feature={d_feature} is not divisible by "
                                 f"n_heads={n_heads}; use an n_heads that divides "
                                 f"d_feature, or set d_attention_key and d_attention_value")
            value = d_feature // n_heads
        elif isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{owner} {name}={value!r} must be a positive int (per-head "
                             f"width) or None for d_feature // n_heads")
        widths.append(int(value))
    return widths[0], widths[1]


def by_head(pair: tuple[jax.Array, jax.Array], n_heads: int, dtype) -> tuple[jax.Array,
                                                                            jax.Array]:
    """A ``(w: [d, n_heads * d_head], b: [n_heads * d_head])`` projection as per-head
    ``([heads, d, d_head], [heads, d_head])`` in ``dtype``, for a ``lax.scan`` over the
    heads."""
    w, b = pair
    d, width = w.shape
    return (jnp.moveaxis(w.astype(dtype).reshape(d, n_heads, width // n_heads), 1, 0),
            b.astype(dtype).reshape(n_heads, width // n_heads))


def init_projections(input_signature, rng: jax.Array, shapes: Sequence[tuple[int, int]],
                     cache_len: int | None, cache_heads: tuple[int, int, int] = (1, 1, 1)
                     ) -> tuple[tuple, tuple]:
    """One ``(w: float32[d_in, d_out], b: float32[d_out])`` pair per ``(d_in, d_out)`` of
    ``shapes`` (Glorot-uniform kernels, normal biases with stddev 1e-6, as Trax's
    ``Dense``) and, for ``cache_len``, a predict-mode cache ``(keys: float32[batch,
    cache_len, n_heads, d_key], values: float32[batch, cache_len, n_heads, d_value],
    index: int32[])`` with ``cache_heads = (n_heads, d_key, d_value)`` (else ``()``).

    One key of ``jax.random.split(rng, len(shapes))`` per pair, so weights of the default
    widths (``d_in = d_out = d_feature``) do not depend on whether widths were given."""
    pairs = []
    for key, (d_in, d_out) in zip(jax.random.split(rng, len(shapes)), shapes, strict=True):
        rng_w, rng_b = jax.random.split(key)
        pairs.append((GLOROT_UNIFORM(rng_w, (d_in, d_out), jnp.float32),
                      TINY_NORMAL(rng_b, (d_out,), jnp.float32)))
    if cache_len is None:
        return tuple(pairs), ()
    n_heads, d_key, d_value = cache_heads
    batch = input_signature.shape[0]
    cache = (jnp.zeros((batch, cache_len, n_heads, d_key), jnp.float32),
             jnp.zeros((batch, cache_len, n_heads, d_value), jnp.float32),
             jnp.zeros((), jnp.int32))
    return tuple(pairs), cache


__all__ = ["by_head", "causal_mask", "dot_product_attention", "einsum_attention",
           "head_widths", "init_projections", "project"]
