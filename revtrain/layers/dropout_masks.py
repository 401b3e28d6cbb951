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

import jax
import jax.numpy as jnp
import numpy as np

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
