"""Dropout keep-masks from few random bits per element.

`keep_mask` draws ``mask_bits`` (8 or 16) random bits per element instead of the 32 of
``jax.random.bernoulli``: it asks ``jax.random.bits`` for ``ceil(n * mask_bits / 32)``
uint32 words and cuts each word into ``32 // mask_bits`` lanes (by shifts, so the result
does not depend on the platform's byte order). An element is dropped when its lane is below
the integer threshold ``round(rate * 2**mask_bits)``, so the drop rate is quantised:

    realised_rate = round(rate * 2**mask_bits) / 2**mask_bits

(`quantised_rate`): the absolute error is at most ``2**-(mask_bits + 1)``, i.e. ``7.6e-6``
with 16 bits and ``2.0e-3`` with 8 bits (rate 0.1 becomes 6554/65536 = 0.100006 with 16
bits, 26/256 = 0.1016 with 8); rates that are multiples of ``2**-mask_bits`` (0.25, 0.5,
0.125, ...) are exact. A rate below ``2**-(mask_bits + 1)`` rounds to 0 and drops nothing.

The mask is a pure function of ``(rng, shape, rate, mask_bits)``: the same key gives the
same mask, so a reversible layer that recomputes its forward pass reproduces it, and every
trainer (which splits the step's key by device, then by layer) draws the same masks.
Cost: with threefry keys (JAX's default, partitionable implementation) each uint32 word is
one threefry2x32 hash, so 16-bit masks hash half as often as ``bernoulli`` and 8-bit masks a
quarter as often. The key's implementation is the caller's (``jax.random.key(seed,
impl=...)``); this module works with any.

References: Srivastava et al., 2014 (dropout); Salmon et al., 2011, "Parallel random numbers:
as easy as 1, 2, 3" (threefry).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

MASK_BITS = (8, 16)
DEFAULT_MASK_BITS = 16


def is_mask_bits(value: object) -> bool:
    """Whether ``value`` is the integer 8 or 16 (a Python or numpy int; not a bool, a float
    such as ``8.0`` or a string)."""
    return (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            and value in MASK_BITS)


def check_mask_bits(mask_bits: int, layer_name: str) -> int:
    """Returns ``mask_bits`` as an int if it is the integer 8 or 16 (`is_mask_bits`), else
    raises a ValueError naming it."""
    if not is_mask_bits(mask_bits):
        raise ValueError(f"{layer_name} mask_bits={mask_bits!r} is not one of {MASK_BITS}; "
                         f"use 16 (rate error <= 7.6e-6) or 8 (faster, error <= 2e-3)")
    return int(mask_bits)


def drop_threshold(rate: float, mask_bits: int = DEFAULT_MASK_BITS) -> int:
    """The integer threshold ``round(rate * 2**mask_bits)``: lanes below it are dropped.

    Capped at ``2**mask_bits - 1`` so that a rate just below 1 keeps a few elements.
    """
    return min(round(float(rate) * 2 ** mask_bits), 2 ** mask_bits - 1)


def quantised_rate(rate: float, mask_bits: int = DEFAULT_MASK_BITS) -> float:
    """The drop rate `keep_mask` realises for ``rate``: ``drop_threshold / 2**mask_bits``."""
    return drop_threshold(rate, mask_bits) / 2 ** mask_bits


def apply_keep_mask(x: jax.Array, keep: jax.Array, rate: float,
                    mask_bits: int = DEFAULT_MASK_BITS) -> jax.Array:
    """Inverted dropout with a given mask: ``x / (1 - r)`` where ``keep``, else 0, with ``r``
    the `quantised_rate` the mask realises, so ``E[y] = x``; in ``x.dtype``."""
    scale = jnp.asarray(1.0 / (1.0 - quantised_rate(rate, mask_bits)), x.dtype)
    return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))


def keep_mask(rng: jax.Array, shape: Sequence[int], rate: float,
              mask_bits: int = DEFAULT_MASK_BITS) -> jax.Array:
    """Bool ``shape`` mask, True (keep) with probability ``1 - quantised_rate(rate)``.

    Args:
      rng: a PRNG key (any implementation); the same key gives the same mask.
      shape: the mask's shape.
      rate: drop probability in ``[0, 1)``, quantised to ``mask_bits`` bits (module doc).
      mask_bits: random bits per element, 8 or 16.

    Returns:
      bool array of ``shape``.

    Raises:
      ValueError: if ``mask_bits`` is not 8 or 16.
    """
    mask_bits = check_mask_bits(mask_bits, "keep_mask")
    shape = tuple(shape)
    n = math.prod(shape)
    lanes = 32 // mask_bits
    words = jax.random.bits(rng, (-(-n // lanes),), jnp.uint32)
    shifts = jnp.arange(lanes, dtype=jnp.uint32) * jnp.uint32(mask_bits)
    values = (words[:, None] >> shifts) & jnp.uint32(2 ** mask_bits - 1)
    values = values.reshape(-1)
    if values.shape[0] != n:
        values = values[:n]
    return values.reshape(shape) >= jnp.uint32(drop_threshold(rate, mask_bits))


def mask_seed(rng: jax.Array) -> jax.Array:
    """Two uint32 words drawn from ``rng`` (any key implementation): the seed of
    `position_keep_mask`."""
    return jax.random.bits(rng, (2,), jnp.uint32)


def position_keep_mask(seed: jax.Array, shape: Sequence[int], row_start: Any,
                       col_start: Any, length: int, rate: float,
                       mask_bits: int = DEFAULT_MASK_BITS, head_start: Any = 0,
                       total_heads: int | None = None, stride: int = 1) -> jax.Array:
    """Bool ``[batch, n_heads, n_rows, n_cols]`` keep-mask of one block of an attention matrix.

    Element ``(b, h, r, c)`` of the block is element ``(b, h, row_start + r * stride,
    col_start + c * stride)`` of the whole ``[batch, n_heads, length, length]`` matrix, and
    its value is a pure function of ``seed`` and those global indices: it hashes the
    counter pair ``(row, word)`` with threefry2x32, ``row = (b * n_heads + h) * length + i``
    and ``word = j // lanes``, and takes lane ``j % lanes`` of the 64 bits (``lanes = 64 //
    mask_bits``). So the mask of a block does not depend on how the matrix is cut into
    blocks: the full attention path (one block), the blockwise path (many) and ring
    attention (blocks of strided rows and columns, ``stride`` = the number of sequence
    shards) drop exactly the same probabilities, whatever the block size or split
    (FlashAttention draws its dropout mask from the global element offset for the same
    reason; Dao et al., 2022). Drop rule and rate quantisation as `keep_mask`.

    Cost: with ``stride == 1`` one hash gives ``lanes`` neighbouring columns; with a larger
    stride each element takes its own hash (``lanes`` times the hashing).

    Args:
      seed: uint32[2] from `mask_seed`.
      shape: ``(batch, n_heads, n_rows, n_cols)``, the block's shape.
      row_start, col_start: the block's first row and column (ints or int32 scalars).
      length: the matrix's number of rows (the sequence length, unpadded).
      rate: drop probability in ``[0, 1)``.
      mask_bits: 8 or 16 random bits per element.
      head_start, total_heads: the block's first head and the matrix's number of heads
        (default 0 and ``n_heads``), for a block of some heads only: ``h`` above is then
        ``head_start + `` the block's head index, and ``n_heads`` is ``total_heads``.
      stride: distance between the block's consecutive rows, and between its columns, in
        the whole matrix (a static positive int).

    Returns:
      bool array of ``shape``; True keeps.
    """
    mask_bits = check_mask_bits(mask_bits, "position_keep_mask")
    batch, n_heads, n_rows, n_cols = (int(s) for s in shape)
    lanes = 64 // mask_bits
    u32 = jnp.uint32
    total_heads = n_heads if total_heads is None else int(total_heads)
    b = jnp.arange(batch, dtype=u32)[:, None, None, None]
    h = (jnp.asarray(head_start).astype(u32)
         + jnp.arange(n_heads, dtype=u32))[None, :, None, None]
    rows = (jnp.asarray(row_start).astype(u32)
            + jnp.arange(n_rows, dtype=u32)[:, None] * u32(stride))
    rows = (b * u32(total_heads) + h) * u32(length) + rows
    col_start = jnp.asarray(col_start).astype(u32)
    if stride != 1:
        values = _lanes_at(seed, rows, col_start + jnp.arange(n_cols, dtype=u32) * u32(stride),
                           (batch, n_heads, n_rows, n_cols), mask_bits)
        return values >= u32(drop_threshold(rate, mask_bits))
    n_words = -(-n_cols // lanes) + 1
    words = col_start // u32(lanes) + jnp.arange(n_words, dtype=u32)
    shape4 = (batch, n_heads, n_rows, n_words)
    hi, lo = threefry2x32_p.bind(seed[0], seed[1], jnp.broadcast_to(rows, shape4),
                                 jnp.broadcast_to(words, shape4))
    per_word = lanes // 2
    shifts = jnp.arange(per_word, dtype=u32) * u32(mask_bits)
    low_mask = u32(2 ** mask_bits - 1)
    values = jnp.concatenate([(lo[..., None] >> shifts) & low_mask,
                              (hi[..., None] >> shifts) & low_mask], axis=-1)
    values = values.reshape(batch, n_heads, n_rows, n_words * lanes)
    offset = (col_start % u32(lanes)).astype(jnp.int32)
    values = jax.lax.dynamic_slice_in_dim(values, offset, n_cols, axis=3)
    return values >= u32(drop_threshold(rate, mask_bits))


def _lanes_at(seed: jax.Array, rows: jax.Array, cols: jax.Array, shape: tuple[int, ...],
              mask_bits: int) -> jax.Array:
    """uint32 ``shape``: the ``mask_bits``-bit lane of column ``cols[c]`` in the hash of
    ``(rows, cols[c] // lanes)``, the value `position_keep_mask` gives that element (lanes
    ``0 .. lanes / 2 - 1`` from the low word, the rest from the high word)."""
    u32 = jnp.uint32
    lanes = 64 // mask_bits
    per_word = lanes // 2
    hi, lo = threefry2x32_p.bind(seed[0], seed[1], jnp.broadcast_to(rows, shape),
                                 jnp.broadcast_to(cols // u32(lanes), shape))
    lane = cols % u32(lanes)
    low = lane < u32(per_word)
    shift = jnp.where(low, lane, lane - u32(per_word)) * u32(mask_bits)
    return (jnp.where(low, lo, hi) >> shift) & u32(2 ** mask_bits - 1)
