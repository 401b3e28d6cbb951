"""LSH hashing and sorting for `LSHCausalAttention`: buckets, the sort order, permutations.

Angular LSH (Andoni et al., 2015; Kitaev et al., 2020, section 3) hashes each position of
``[batch, length, d]`` into ``argmax([x R; -x R])`` of a random rotation ``R``; many
buckets are a mixed-radix product of smaller rotations (Trax's rule above 128 buckets).
Positions are then sorted by ``(bucket, position)`` (`sort_order`) and moved with
`permute`, a gather whose cotangent is the inverse gather (O(length), no scatter).

References: Kitaev, Kaiser & Levskaya, 2020, "Reformer: The Efficient Transformer"; Trax
1.4.1 ``trax.layers.research.efficient_attention`` (the bucket factorisation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

# Buckets hashed by one rotation at most; above, two factors (Trax's rule).
MAX_UNFACTORED_BUCKETS = 128
# The most buckets an int32 bucket id holds.
MAX_BUCKETS = 2 ** 31 - 1
# Positions hashed at a time (`hash_buckets`).
HASH_CHUNK = 4096


def default_n_buckets(length: int, chunk_len: int) -> tuple[int, ...]:
    """Reformer's bucket count for ``length``: ``2 * max(1, length // chunk_len)``, so an
    average bucket holds about half a chunk; above `MAX_UNFACTORED_BUCKETS` it is cut into
    two even factors ``(2**ceil(log2(sqrt(n))), 2 * (n // (2 * that)))`` as Trax does
    (their product may be a little below ``n``).

    Returns:
      the factors, e.g. ``(16,)`` at length 1,024 with chunk_len 128, ``(128, 64)`` at
      524,288.
    """
    n = 2 * max(1, length // chunk_len)
    if n <= MAX_UNFACTORED_BUCKETS:
        return (n,)
    first = 2 ** math.ceil(math.log2(math.sqrt(n)))
    return (first, 2 * (n // (2 * first)))


def check_n_buckets(n_buckets: Any, owner: str) -> tuple[int, ...] | None:
    """``n_buckets`` as a tuple of factors (None stays None), or ValueError: an int or a
    sequence of ints, each even and >= 2."""
    if n_buckets is None:
        return None
    factors = (n_buckets,) if isinstance(n_buckets, (int, np.integer)) else n_buckets
    try:
        factors = tuple(factors)
    except TypeError:
        factors = (n_buckets,)
    bad = (isinstance(n_buckets, (dict, set, str)) or not factors
           or any(isinstance(f, bool) or not isinstance(f, (int, np.integer)) or f < 2
                  or f % 2 for f in factors))
    if bad:
        raise ValueError(f"{owner} n_buckets={n_buckets!r} must be an even int >= 2 (or a "
                         f"tuple of even ints, hashed as their product), or None for "
                         f"Reformer's 2 * length // chunk_len; e.g. n_buckets=64")
    factors = tuple(int(f) for f in factors)
    if math.prod(factors) > MAX_BUCKETS:
        raise ValueError(f"{owner} n_buckets={n_buckets!r} makes {math.prod(factors):,} "
                         f"buckets, more than the {MAX_BUCKETS:,} an int32 bucket id holds; "
                         f"use fewer (Reformer's default is 2 * length // chunk_len)")
    return factors



# Sort and unsort: a gather whose cotangent is the inverse gather.

def _gather(x: jax.Array, order: jax.Array) -> jax.Array:
    """``y[b, i] = x[b, order[b, i]]`` along axis 1 (trailing axes carried along)."""
    index = order.reshape(order.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


@jax.custom_vjp
def permute(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """``x[b, order[b, i]]`` for ``x: [batch, length, ...]`` and int ``order: [batch,
    length]`` a permutation per row with inverse ``inverse``; the vjp gathers the
    cotangent by ``inverse`` (O(length) and no scatter, unlike XLA's gather transpose)."""
    return _gather(x, order)


def _permute_fwd(x, order, inverse):
    return _gather(x, order), (order, inverse)


def _permute_bwd(residuals, ct):
    order, inverse = residuals
    return _gather(ct, inverse), None, None


permute.defvjp(_permute_fwd, _permute_bwd)


def _hash_rows(x: jax.Array, rotations: Sequence[jax.Array]) -> jax.Array:
    x = x.astype(jnp.float32)
    buckets = jnp.zeros(x.shape[:2], jnp.int32)
    for rotation in rotations:
        rotated = jnp.einsum("bld,dr->blr", x, rotation)
        factor = jnp.argmax(jnp.concatenate([rotated, -rotated], axis=-1), axis=-1)
        buckets = buckets * (2 * rotation.shape[-1]) + factor.astype(jnp.int32)
    return buckets


def hash_buckets(x: jax.Array, rotations: Sequence[jax.Array]) -> jax.Array:
    """Angular LSH buckets of ``x: [batch, length, d]``: int32 ``[batch, length]`` in
    ``[0, prod(n_f))``, mixed radix over the factors, one rotation ``[d, n_f / 2]`` each:
    ``argmax([x R; -x R])`` (Kitaev et al., 2020, section 3). Not differentiated.

    Each position hashes alone, so the positions go `HASH_CHUNK` at a time (a
    ``lax.fori_loop`` writing the ids in place): the rotated ``[batch, chunk, n_f]``
    values exist one chunk at a time, not ``[batch, length, n_f]`` (2 GiB at 1,048,576
    tokens and 128 buckets a factor)."""
    x = lax.stop_gradient(x)
    batch, length = x.shape[:2]
    if length <= HASH_CHUNK:
        return _hash_rows(x, rotations)
    n_full, rest = divmod(length, HASH_CHUNK)

    def chunk(i, buckets):
        start = i * HASH_CHUNK
        rows = lax.dynamic_slice_in_dim(x, start, HASH_CHUNK, axis=1)
        return lax.dynamic_update_slice_in_dim(buckets, _hash_rows(rows, rotations), start,
                                               axis=1)

    # The carry takes the first chunk's type: inside shard_map it varies over the mesh
    # axes that x or the rotations vary over.
    first = _hash_rows(x[:, :HASH_CHUNK], rotations)
    buckets = lax.dynamic_update_slice_in_dim(jnp.zeros_like(first, shape=(batch, length)),
                                              first, 0, axis=1)
    buckets = lax.fori_loop(1, n_full, chunk, buckets)
    if rest:
        tail = _hash_rows(x[:, n_full * HASH_CHUNK:], rotations)
        buckets = lax.dynamic_update_slice_in_dim(buckets, tail, n_full * HASH_CHUNK, axis=1)
    return buckets


def sort_order(buckets: jax.Array, n_buckets: int) -> tuple[jax.Array, jax.Array]:
    """The permutation sorting each row of int32 ``buckets: [batch, length]`` by (bucket,
    position), and its inverse; both int32 ``[batch, length]``, tagged ``'lsh_sort'``
    (`jax.ad_checkpoint.checkpoint_name`) so that recomputation can keep them.

    Where ``n_buckets x length`` fits 32 bits the key is the one uint32 ``bucket x length
    + position`` (a single-key sort: 5x faster on CPU than sorting a pair at 64K), else
    the (bucket, position) pair; the inverse is a scatter of the positions, not a sort.
    """
    batch, length = buckets.shape
    positions = jnp.zeros_like(buckets) + jnp.arange(length, dtype=jnp.int32)
    if n_buckets * length <= 2 ** 32:
        key = buckets.astype(jnp.uint32) * jnp.uint32(length) + positions.astype(jnp.uint32)
        order = (lax.sort(key, dimension=1) % jnp.uint32(length)).astype(jnp.int32)
    else:
        _, order = lax.sort((buckets, positions), dimension=1, num_keys=2)
    rows = jnp.arange(batch)[:, None]
    inverse = jnp.zeros_like(order).at[rows, order].set(positions, unique_indices=True)
    return checkpoint_name(order, "lsh_sort"), checkpoint_name(inverse, "lsh_sort")


# ------------------------------------------------------------------------------------------


__all__ = ["HASH_CHUNK", "MAX_BUCKETS", "MAX_UNFACTORED_BUCKETS", "check_n_buckets",
           "default_n_buckets", "hash_buckets", "permute", "sort_order"]
