"""Rotary position embeddings (RoPE): positions as rotations of query and key features.

`rotary_embedding` rotates each pair of features ``(x[i], x[i + d/2])`` of a head by the
angle ``position * theta_i``, ``theta_i = 10000 ** (-2 i / d_head)`` (Su et al., 2021), so
the dot product of a rotated query at position ``m`` and a rotated key at ``n`` depends on
the positions only through ``m - n``. Applied to queries and keys inside attention, it
replaces an added position table: nothing grows with the length, and incremental decoding
only needs the absolute position of each new token. Pairs are the two halves of the head
(the "rotate half" layout of GPT-NeoX and most JAX code) rather than the paper's adjacent
features; the two are the same up to a fixed permutation of the projection weights.

References: Su et al., 2021, "RoFormer: Enhanced Transformer with Rotary Position
Embedding", section 3.4.2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROTARY_BASE = 10000.0


def check_rotary_head_size(d_head: int, owner: str) -> None:
    """Raises ValueError when ``d_head`` is odd (rotary pairs features)."""
    if d_head % 2:
        raise ValueError(f"{owner}: rotary position embeddings pair the features of a head, "
                         f"but d_head={d_head} is odd; use an even d_model // n_heads (or an "
                         f"even d_attention_key)")


def rotary_embedding(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotates ``x`` by its positions: ``[batch, length, n_heads, d_head]`` -> same.

    Args:
      x: queries or keys, ``[batch, length, n_heads, d_head]`` with even ``d_head``; any
        float dtype (computed in float32, returned in ``x.dtype``).
      positions: int ``[length]``, the absolute position of each row (``arange(length)`` in
        training; the cache index onwards when decoding).

    Returns:
      ``x`` with features ``(i, i + d_head / 2)`` rotated by ``positions * theta_i``.
    """
    half = x.shape[-1] // 2
    theta = ROTARY_BASE ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, None] * theta[None, :]   # [length, half]
    cos = jnp.cos(angle)[None, :, None, :]
    sin = jnp.sin(angle)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


__all__ = ["check_rotary_head_size", "rotary_embedding"]
