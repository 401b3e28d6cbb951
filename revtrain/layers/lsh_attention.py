"""Locality-sensitive-hashing causal attention (Reformer): `LSHCausalAttention`.

Reformer's attention (Kitaev et al., 2020, section 3) attends only among positions whose
queries hash alike, so its work and memory grow as ``length x chunk_len`` rather than
``length**2``. Per head and per hashing round:

1. **Shared query/key.** One projection gives ``qk``; queries are ``qk`` and keys its
   unit-length normalisation ``qk / |qk|``, so a query's own key is always among its most
   similar; logits are ``q . k / sqrt(d_head)`` (Trax: keys normalised, then scaled).
2. **Angular LSH.** ``bucket = argmax([x R; -x R])`` for a random Gaussian rotation ``R``
   of ``d_head x n_buckets / 2`` (Andoni et al., 2015). Many buckets are hashed as a
   product of two smaller rotations (mixed radix), as Trax does above 128 buckets: the
   hash then costs ``length x d_head x (n1 + n2) / 2`` instead of ``length x d_head x n / 2``.
3. **Sort** the positions by ``(bucket, position)`` and cut the sorted sequence into chunks
   of ``chunk_len``; each chunk attends to itself and the ``n_chunks_before`` chunks before
   it (in sorted order; the first chunk has no chunk before it).
4. **Masks, by original position:** a query never sees a later position (causal), and it
   sees itself only when nothing else is available: its own logit is lowered by ``1e5``
   (Reformer's rule, Trax's constant), which with shared query/key would otherwise dominate.
   No same-bucket mask is applied (as Trax): a chunk's keys from a neighbouring bucket stay.
5. **Unsort** the outputs, and combine the ``n_hashes`` rounds with the softmax of their
   per-position log-sum-exp (each round's output weighted by the probability mass it saw).

Costs (per layer; ``B`` batch, ``H`` heads, ``L`` length, ``c`` chunk_len, ``b``
n_chunks_before, ``n`` n_hashes): ``B x H x n x L x c x (1 + b) x d_head`` multiply-adds
for the attention products plus the hash and an ``O(L log L)`` sort per round. Heads run
one at a time (a ``lax.scan`` under ``jax.checkpoint``, as `CausalAttention`'s blockwise
path), rounds one at a time within a head, and the chunk kernel loops over groups of
chunks holding ``float32[B, chunks, c, (1 + b) c]`` logits for about 4,096 sorted rows at a
time, so the memory beside the layer's input and output is ``O(B x L x d_head)`` (plus
the hash's ``B x L x n_f / 2`` rotated values per bucket factor): no
``L x c`` array over the whole sequence is kept, and the compiled program does not grow
with the length. The chunk kernel and the sort/unsort gathers have custom vjps: the
kernel recomputes its probabilities from the saved log-sum-exp (FlashAttention's
backward), and a gather's cotangent is the inverse gather (no scatter).

What LSH approximates: within a round a query attends only to the keys that share its
chunks, so probability mass outside them is lost; more rounds (``n_hashes``) make a
missed neighbour less likely at proportionally more work. With ``chunk_len >= length``
there is one chunk and the layer is exact dense attention with the rules of 1 and 4. The
set of keys a position sees depends on how later positions hash (they move the sort), but
never on later positions' values: the output at ``t`` is a function of values ``<= t``
(as in Trax). Decoding (``'predict'`` mode) attends to every cached position with the same
rules, i.e. the ``chunk_len >= length`` limit of the layer.

Randomness: the rotations come from the layer's rng (or, with ``hash_seed``, from a fixed
key: Trax's ``hash_seed``), so a reversible layer's recomputation, and every trainer, hash
alike; attention dropout uses `revtrain.layers.dropout_masks.position_keep_mask` of the
sorted row and key slot, so the forward and backward passes drop alike.

References: Kitaev, Kaiser & Levskaya, 2020, "Reformer: The Efficient Transformer"; Trax
1.4.1 ``trax.layers.research.efficient_attention.LSHSelfAttention`` (argument names,
defaults, the ``1e5`` self penalty, the bucket factorisation); Andoni et al., 2015,
"Practical and Optimal LSH for Angular Distance".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from revtrain.layers.attention import by_head, init_projections, project
from revtrain.layers.blockwise_attention import _accumulation, _full, _vary_alike
from revtrain.layers.core import check_mode, check_rate
from revtrain.layers.dropout_masks import (
    DEFAULT_MASK_BITS,
    apply_keep_mask,
    check_mask_bits,
    drop_threshold,
    mask_seed,
    position_keep_mask,
)
from revtrain.layers.layer import Layer
from revtrain.layers.rotary import check_rotary_head_size, rotary_embedding

DEFAULT_CHUNK_LEN = 128
# Subtracted from a position's logit for its own key (Trax's value): it attends to itself
# only when every other key is masked.
SELF_PENALTY = 1e5
# Buckets hashed by one rotation at most; above, two factors (Trax's rule).
MAX_UNFACTORED_BUCKETS = 128
# The most buckets an int32 bucket id holds.
MAX_BUCKETS = 2 ** 31 - 1
# Sorted query rows the chunk kernel handles per loop iteration.
_GROUP_ROWS = 4096
_SENTINEL = np.iinfo(np.int32).max  # the position of padding: after every real position
# What a head's recomputation keeps rather than recomputes: its sort permutations.
_SAVE_SORT = jax.checkpoint_policies.save_only_these_names("lsh_sort")


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


def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"LSHCausalAttention {name}={value!r} must be an int >= {minimum}")
    return int(value)


# ------------------------------------------------------------------------------------------
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


def hash_buckets(x: jax.Array, rotations: Sequence[jax.Array]) -> jax.Array:
    """Angular LSH buckets of ``x: [batch, length, d]``: int32 ``[batch, length]`` in
    ``[0, prod(n_f))``, mixed radix over the factors, one rotation ``[d, n_f / 2]`` each:
    ``argmax([x R; -x R])`` (Kitaev et al., 2020, section 3). Not differentiated."""
    x = lax.stop_gradient(x).astype(jnp.float32)
    buckets = jnp.zeros(x.shape[:2], jnp.int32)
    for rotation in rotations:
        rotated = jnp.einsum("bld,dr->blr", x, rotation)
        factor = jnp.argmax(jnp.concatenate([rotated, -rotated], axis=-1), axis=-1)
        buckets = buckets * (2 * rotation.shape[-1]) + factor.astype(jnp.int32)
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
# The chunk kernel: attention within sorted chunks and their predecessors.

class _Config(NamedTuple):
    """Static settings of one chunk-kernel call (hashable: a custom_vjp nondiff arg)."""
    chunk: int        # chunk_len
    before: int       # n_chunks_before
    group: int        # chunks per loop iteration
    rate: float       # attention dropout (0: none)
    mask_bits: int
    rows: int         # rows of the dropout mask's matrix: n_hashes x padded length
    total_heads: int


def _front_pad(x: jax.Array, config: _Config, value=0) -> jax.Array:
    pad = [(0, 0), (config.before * config.chunk, 0)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, pad, constant_values=value)


def _rows(x: jax.Array, g: jax.Array, config: _Config) -> jax.Array:
    """Group ``g``'s query rows of ``x`` as ``[batch, group, chunk, ...]``."""
    size = config.group * config.chunk
    block = lax.dynamic_slice_in_dim(x, g * size, size, axis=1)
    return block.reshape(x.shape[0], config.group, config.chunk, *x.shape[2:])


def _window(x_padded: jax.Array, g: jax.Array, config: _Config) -> jax.Array:
    """Group ``g``'s key rows of front-padded ``x``: ``[batch, group + before, chunk, ...]``."""
    size = (config.group + config.before) * config.chunk
    block = lax.dynamic_slice_in_dim(x_padded, g * config.group * config.chunk, size, axis=1)
    return block.reshape(x_padded.shape[0], config.group + config.before, config.chunk,
                         *x_padded.shape[2:])


def _keys(window: jax.Array, config: _Config) -> jax.Array:
    """``[batch, group + before, chunk, ...]`` -> each chunk's keys ``[batch, group,
    (before + 1) chunk, ...]``: the ``before`` chunks before it, then itself."""
    parts = [window[:, a:a + config.group] for a in range(config.before + 1)]
    return jnp.concatenate(parts, axis=2)


def _unkeys(keys_ct: jax.Array, config: _Config) -> jax.Array:
    """The transpose of `_keys`: sums each key slot's cotangent into its window chunk."""
    b, g, _, *rest = keys_ct.shape
    parts = keys_ct.reshape(b, g, config.before + 1, config.chunk, *rest)
    tail = [(0, 0)] * (len(rest) + 1)
    return sum(jnp.pad(parts[:, :, a], [(0, 0), (a, config.before - a)] + tail)
               for a in range(config.before + 1))


def _logits(q: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """Scaled logits ``[batch, group, chunk, keys]``: -inf for later positions, minus
    `SELF_PENALTY` for a position's own key."""
    s = jnp.einsum("bgqd,bgkd->bgqk", q, k,
                   preferred_element_type=_accumulation(q)) / math.sqrt(q.shape[-1])
    qp, kp = q_pos[..., :, None], k_pos[..., None, :]
    s = jnp.where(kp <= qp, s, -jnp.inf)
    return jnp.where(kp == qp, s - SELF_PENALTY, s)


def _dropped(x: jax.Array, seed: jax.Array, g: jax.Array, config: _Config) -> jax.Array:
    """``x: [batch, group, chunk, keys]`` with its dropped probabilities zeroed (keyed by
    the sorted row of this round and the key slot)."""
    if not config.rate:
        return x
    b, groups, chunk, n_keys = x.shape
    flat = (b, 1, groups * chunk, n_keys)
    keep = position_keep_mask(seed, flat, seed[3] + g * groups * chunk, 0, config.rows,
                              config.rate, config.mask_bits, head_start=seed[2],
                              total_heads=config.total_heads)
    return apply_keep_mask(x, keep.reshape(x.shape), config.rate, config.mask_bits)


def _forward(config: _Config, q, k, v, positions, seed):
    """Output ``[batch, n, d_v]`` and log-sum-exp ``[batch, n]`` of the sorted rows."""
    batch, n, _ = q.shape
    kp, vp = _front_pad(k, config), _front_pad(v, config)
    pos_p = _front_pad(positions, config, _SENTINEL)
    size = config.group * config.chunk
    acc = _accumulation(q)
    like = (q, k, v, seed)

    def group(g, carry):
        out, lse = carry
        s = _logits(_rows(q, g, config), _keys(_window(kp, g, config), config),
                    _rows(positions, g, config), _keys(_window(pos_p, g, config), config))
        m = s.max(axis=-1, keepdims=True)
        p = jnp.exp(s - m)
        total = p.sum(axis=-1, keepdims=True)
        p = _dropped(p, seed, g, config).astype(v.dtype)
        o = jnp.einsum("bgqk,bgkd->bgqd", p, _keys(_window(vp, g, config), config),
                       preferred_element_type=acc) / total
        out = lax.dynamic_update_slice_in_dim(
            out, o.reshape(batch, size, -1).astype(out.dtype), g * size, axis=1)
        lse = lax.dynamic_update_slice_in_dim(
            lse, (m + jnp.log(total)).reshape(batch, size), g * size, axis=1)
        return out, lse

    init = (_full((batch, n, v.shape[-1]), 0.0, *like).astype(v.dtype),
            _full((batch, n), 0.0, *like, dtype=acc))
    return lax.fori_loop(0, n // size, group, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk_attention(config: _Config, q, k, v, positions, seed):
    return _forward(config, q, k, v, positions, seed)


def _chunk_attention_fwd(config: _Config, q, k, v, positions, seed):
    out, lse = _forward(config, q, k, v, positions, seed)
    return (out, lse), (q, k, v, positions, seed, out, lse)


def _chunk_attention_bwd(config: _Config, residuals, cts):
    q, k, v, positions, seed, out, lse = residuals
    d_out, d_lse = cts
    batch, n, _ = q.shape
    acc = _accumulation(q)
    # d out_r / d s_rc as blockwise attention's backward; d lse_r / d s_rc = p_rc adds
    # d_lse_r, which enters as a shift of D_r = do_r . out_r.
    delta = jnp.einsum("bnd,bnd->bn", d_out, out, preferred_element_type=acc) - d_lse
    kp, vp = _front_pad(k, config), _front_pad(v, config)
    pos_p = _front_pad(positions, config, _SENTINEL)
    size = config.group * config.chunk
    window = (config.group + config.before) * config.chunk
    scale = 1.0 / math.sqrt(q.shape[-1])
    like = (q, k, v, d_out, d_lse, seed)

    def group(g, carry):
        dq, dk, dv = carry
        q_g, do_g = _rows(q, g, config), _rows(d_out, g, config)
        k_g, v_g = _keys(_window(kp, g, config), config), _keys(_window(vp, g, config), config)
        s = _logits(q_g, k_g, _rows(positions, g, config),
                    _keys(_window(pos_p, g, config), config))
        p = jnp.exp(s - _rows(lse, g, config)[..., None])
        dv_g = jnp.einsum("bgqk,bgqd->bgkd", _dropped(p, seed, g, config).astype(do_g.dtype),
                          do_g, preferred_element_type=acc)
        dp = jnp.einsum("bgqd,bgkd->bgqk", do_g, v_g, preferred_element_type=acc)
        ds = p * (_dropped(dp, seed, g, config) - _rows(delta, g, config)[..., None])
        dq_g = jnp.einsum("bgqk,bgkd->bgqd", ds, k_g, preferred_element_type=acc) * scale
        dk_g = jnp.einsum("bgqk,bgqd->bgkd", ds, q_g, preferred_element_type=acc) * scale
        dq = lax.dynamic_update_slice_in_dim(dq, dq_g.reshape(batch, size, -1), g * size,
                                             axis=1)

        def add(total, part):
            start = g * size
            current = lax.dynamic_slice_in_dim(total, start, window, axis=1)
            part = _unkeys(part, config).reshape(current.shape)
            return lax.dynamic_update_slice_in_dim(total, current + part, start, axis=1)

        return dq, add(dk, dk_g), add(dv, dv_g)

    zeros = [_full(x.shape, 0.0, *like, dtype=acc) for x in (q, kp, vp)]
    dq, dk, dv = lax.fori_loop(0, n // size, group, tuple(zeros))
    front = config.before * config.chunk
    return (dq.astype(q.dtype), dk[:, front:].astype(k.dtype), dv[:, front:].astype(v.dtype),
            None, None)


_chunk_attention.defvjp(_chunk_attention_fwd, _chunk_attention_bwd)


def lsh_round(qk: jax.Array, v: jax.Array, rotations: Sequence[jax.Array], *, chunk_len: int,
              n_chunks_before: int, dropout_rate: float = 0.0,
              seed: jax.Array | None = None, mask_bits: int = DEFAULT_MASK_BITS,
              head: Any = 0, total_heads: int = 1, round_index: Any = 0,
              n_hashes: int = 1) -> tuple[jax.Array, jax.Array]:
    """One hashing round of one head: hash, sort, chunk attention, unsort.

    Args:
      qk: ``[batch, length, d_head]`` shared queries/keys (keys are their normalisation).
      v: ``[batch, length, d_head]`` values.
      rotations: one ``float32[d_head, n_f / 2]`` per bucket factor (`hash_buckets`).
      chunk_len, n_chunks_before: as `LSHCausalAttention`.
      dropout_rate, seed, mask_bits: attention dropout (``seed``: uint32[2] from
        `revtrain.layers.dropout_masks.mask_seed`).
      head, total_heads, round_index, n_hashes: where this call sits among all heads and
        rounds, so every (head, round) draws its own dropout mask.

    Returns:
      the output ``[batch, length, d_head]`` in ``v.dtype`` and the per-position
      log-sum-exp of the logits it saw, ``[batch, length]`` (at least float32).
    """
    batch, length, _ = qk.shape
    order, inverse = sort_order(hash_buckets(qk, rotations),
                                math.prod(2 * r.shape[-1] for r in rotations))
    q = permute(qk, order, inverse)
    # Keys stay in the accumulation dtype: their cotangent (before the normalisation's
    # 1 / |q| shrinks it) can exceed float16's range.
    k = normalised(q, keep_wide=True)
    sv = permute(v, order, inverse)
    n_chunks = -(-length // chunk_len)
    group = min(max(1, _GROUP_ROWS // chunk_len), n_chunks)
    chunked = n_chunks * chunk_len  # the dropout mask's rows per round: not the grouping's
    padded = -(-n_chunks // group) * group * chunk_len
    pad = padded - length
    if pad:
        q, k, sv = (jnp.pad(a, [(0, 0), (0, pad), (0, 0)]) for a in (q, k, sv))
        order_p = jnp.pad(order, [(0, 0), (0, pad)], constant_values=_SENTINEL)
    else:
        order_p = order
    rate = float(dropout_rate)
    if rate and drop_threshold(rate, mask_bits) == 0:
        rate = 0.0
    seed = jnp.zeros((2,), jnp.uint32) if seed is None or not rate else seed
    seed = jnp.concatenate([seed, jnp.stack([jnp.asarray(head).astype(jnp.uint32),
                                             jnp.asarray(round_index).astype(jnp.uint32)
                                             * jnp.uint32(chunked)])])
    config = _Config(chunk_len, n_chunks_before, group, rate, mask_bits, n_hashes * chunked,
                     total_heads)
    q, k, sv, order_p, seed = _vary_alike(q, k, sv, order_p, seed)
    out, lse = _chunk_attention(config, q, k, sv, order_p, seed)
    if pad:
        out, lse = out[:, :length], lse[:, :length]
    return permute(out, inverse, order), permute(lse, inverse, order)


def normalised(x: jax.Array, keep_wide: bool = False) -> jax.Array:
    """``x / sqrt(|x|^2 + 1e-6)`` over the last axis, computed in at least float32 (so a
    float16 ``x`` neither overflows nor loses its gradient), returned in ``x.dtype`` (in
    that wider dtype with ``keep_wide``)."""
    wide = x.astype(_accumulation(x))
    out = wide * lax.rsqrt(jnp.sum(jnp.square(wide), -1, keepdims=True) + 1e-6)
    return out if keep_wide else out.astype(x.dtype)


def shared_qk_attention(qk: jax.Array, v: jax.Array, q_positions: jax.Array,
                        k_positions: jax.Array, keys: jax.Array | None = None) -> jax.Array:
    """Dense attention under the LSH layer's rules: ``[batch, n_q, heads, d]`` queries
    ``qk`` against keys ``keys`` (default: ``qk``'s normalisation; pass cached normalised
    keys ``[batch, n_k, heads, d]``), causal by position, the self penalty; the layer's
    ``chunk_len >= length`` limit and its predict mode."""
    if keys is None:
        keys = normalised(qk)
    acc = _accumulation(qk)
    s = jnp.einsum("bqhd,bkhd->bhqk", qk, keys.astype(qk.dtype),
                   preferred_element_type=acc) / math.sqrt(qk.shape[-1])
    qp, kp = q_positions[:, None], k_positions[None, :]
    s = jnp.where(kp <= qp, s, -jnp.inf)
    s = jnp.where(kp == qp, s - SELF_PENALTY, s)
    probs = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


class LSHCausalAttention(Layer):
    """Reformer's LSH causal self-attention: ``[batch, length, d_feature]`` -> same shape.

    Usable as a language model's ``attention_type`` (it takes the arguments the LMs pass:
    ``n_heads``, ``dropout``, ``mode``, ``max_len``, ``mask_bits``, ``rotary``). Weights
    are three ``(w: float32[d_feature, d_feature], b: float32[d_feature])`` pairs: the
    shared query/key, the value and the output projections (Glorot-uniform kernels, normal
    biases with stddev 1e-6). The algorithm, its costs and what it approximates are in the
    module docstring.

    Args:
      d_feature: model width; the last axis of the input.
      n_heads: heads; each has ``d_head = d_feature // n_heads``.
      dropout: drop rate of the attention probabilities, ``[0, 1)``, ``'train'`` mode only.
      mode: ``'train'``, ``'eval'`` or ``'predict'``. In ``'predict'`` mode with ``max_len``
        set, the layer decodes incrementally with a cache ``(keys, values:
        float32[batch, max_len, n_heads, d_head], index: int32[])`` (normalised keys) and
        attends to every cached position under the layer's rules (the exact
        ``chunk_len >= length`` limit; not hashed). Without ``max_len`` it behaves as
        ``'eval'``.
      max_len: cache length for ``'predict'`` mode.
      chunk_len: sorted positions per chunk (Trax's default 128). A length it does not
        divide is padded at the end of the sorted order with masked positions.
      n_chunks_before: previous chunks each chunk also attends to (Trax's default 1).
      n_hashes: hashing rounds (Trax's default 1): each round costs a full pass of the
        attention; more rounds miss fewer similar keys.
      n_buckets: an even int, or a tuple of even ints hashed as their product; None
        (default) takes `default_n_buckets` of the length (Reformer's ``2 * length //
        chunk_len``, factorised above 128 as Trax).
      hash_seed: None (default) draws the rotations from the layer's rng each call (as
        Reformer: the hash changes every step); an int in ``[0, 2**32)`` fixes them
        (Trax's ``hash_seed``; every layer given the same seed hashes alike), so without
        attention dropout the output no longer depends on the rng -- e.g. the same on any
        device count.
      mask_bits: random bits per attention-dropout mask element, 16 or 8.
      rotary: rotate the shared query/key by position (RoFormer) before hashing; the LMs
        set it for ``pos_type='rotary'``.

    Raises:
      ValueError: at construction, for ``d_feature``/``n_heads`` that are not positive
        ints or do not divide, ``chunk_len < 1``, ``n_hashes < 1``, ``n_chunks_before <
        0``, an odd (or non-int) ``n_buckets`` or more than `MAX_BUCKETS` of them,
        ``hash_seed`` not an int in ``[0, 2**32)``, ``max_len < 1``, a ``dropout`` outside
        ``[0, 1)``, an unknown ``mode``, ``mask_bits`` not 8 or 16, ``rotary`` with an odd
        ``d_head``; on a call (wrapped in `LayerError`), inputs that are not ``[batch,
        length, d_feature]`` or are empty, a call without an rng and without
        ``hash_seed``, and in ``'predict'`` mode inputs of another batch than the cache's
        or longer than ``max_len`` (as `CausalAttention`, the cache index itself is not
        checked: writes past ``max_len`` are clamped).
    """

    def __init__(self, d_feature: int, n_heads: int = 1, dropout: float = 0.0,
                 mode: str = "train", max_len: int | None = None,
                 chunk_len: int = DEFAULT_CHUNK_LEN, n_chunks_before: int = 1,
                 n_hashes: int = 1, n_buckets: int | Sequence[int] | None = None,
                 hash_seed: int | None = None, mask_bits: int = DEFAULT_MASK_BITS,
                 rotary: bool = False):
        super().__init__(n_in=1, n_out=1)
        self._d_feature = _check_int(d_feature, "d_feature", 1)
        self._n_heads = _check_int(n_heads, "n_heads", 1)
        if d_feature % n_heads:
            raise ValueError(f"LSHCausalAttention d_feature={d_feature} is not divisible by "
                             f"n_heads={n_heads}; use an n_heads that divides d_feature")
        self._dropout = check_rate(dropout, "LSHCausalAttention")
        self._mode = check_mode(mode, "LSHCausalAttention")
        if max_len is not None:
            _check_int(max_len, "max_len", 1)
        self._cache_len = max_len if mode == "predict" else None
        self._chunk_len = _check_int(chunk_len, "chunk_len", 1)
        self._n_chunks_before = _check_int(n_chunks_before, "n_chunks_before", 0)
        self._n_hashes = _check_int(n_hashes, "n_hashes", 1)
        self._n_buckets = check_n_buckets(n_buckets, "LSHCausalAttention")
        if hash_seed is not None and not 0 <= _check_int(hash_seed, "hash_seed", 0) < 2 ** 32:
            raise ValueError(f"LSHCausalAttention hash_seed={hash_seed} must be below 2**32; "
                             f"use e.g. hash_seed=0")
        self._hash_seed = hash_seed
        self._mask_bits = check_mask_bits(mask_bits, "LSHCausalAttention")
        if rotary:
            check_rotary_head_size(d_feature // n_heads, "LSHCausalAttention")
        self._rotary = bool(rotary)

    def _check_input(self, shape: tuple[int, ...]) -> None:
        if len(shape) != 3 or shape[-1] != self._d_feature:
            raise ValueError(f"LSHCausalAttention(d_feature={self._d_feature}) expects inputs "
                             f"[batch, length, {self._d_feature}]; got shape {shape}")
        if not shape[0] or not shape[1]:
            raise ValueError(f"LSHCausalAttention got an empty input of shape {shape}; pass "
                             f"at least one sequence of one position")

    def n_buckets_for(self, length: int) -> tuple[int, ...]:
        """The bucket factors the layer hashes a ``length``-long sequence into."""
        return self._n_buckets or default_n_buckets(length, self._chunk_len)

    def forward_with_state(self, x, weights, state, rng):
        self._check_input(x.shape)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(jnp.float32)
        if self._cache_len is not None:
            return self._decode(x, weights, state)
        if self._hash_seed is not None:
            hash_key, dropout_key = jax.random.key(self._hash_seed), rng
        elif rng is None:
            raise ValueError("LSHCausalAttention draws its hash rotations from the rng, but "
                             "got rng=None; pass a jax.random.key or set hash_seed")
        else:
            hash_key, dropout_key = jax.random.split(rng)
        rate = self._dropout if self._mode == "train" else 0.0
        if rate and dropout_key is None:
            raise ValueError(f"LSHCausalAttention dropout={rate} needs an rng; pass a "
                             f"jax.random.key or use mode='eval'")
        seed = mask_seed(dropout_key) if rate else None
        batch, length, d = x.shape
        n_heads, d_head, n_hashes = self._n_heads, d // self._n_heads, self._n_hashes
        factors = self.n_buckets_for(length)
        rotations = tuple(
            jax.random.normal(key, (n_heads, n_hashes, d_head, f // 2), jnp.float32)
            for key, f in zip(jax.random.split(hash_key, len(factors)), factors, strict=True))

        projections = tuple(by_head(pair, n_heads, x.dtype) for pair in weights[:2])
        w_out = weights[2][0].astype(x.dtype).reshape(n_heads, d_head, d)
        positions = jnp.arange(length)

        @functools.partial(jax.checkpoint, policy=_SAVE_SORT)
        def one_round(carry, xs):
            # The rounds' softmax by their log-sum-exp, online (max, weight, weighted sum):
            # normalising by the summed weights keeps equal rounds exact even where the
            # self penalty puts the log-sum-exp near -1e5 (float32 spacing 0.008 there).
            top, weight, total = carry
            qk, v, h, r, round_rotations = xs
            out, lse = lsh_round(qk, v, round_rotations, chunk_len=self._chunk_len,
                                 n_chunks_before=self._n_chunks_before, dropout_rate=rate,
                                 seed=seed, mask_bits=self._mask_bits, head=h,
                                 total_heads=n_heads, round_index=r, n_hashes=n_hashes)
            new_top = jnp.maximum(top, lse)
            old, this = jnp.exp(top - new_top), jnp.exp(lse - new_top)
            total = total * old[..., None] + out.astype(total.dtype) * this[..., None]
            return (new_top, weight * old + this, total), None

        @functools.partial(jax.checkpoint, policy=_SAVE_SORT)
        def head(x, projection, w_o, h, head_rotations):
            qk, v = (jnp.dot(x, w) + b for w, b in projection)
            if self._rotary:
                qk = rotary_embedding(qk[:, :, None], positions)[:, :, 0]
            acc = _accumulation(qk)
            if n_hashes == 1:
                out, _ = lsh_round(qk, v, tuple(r[0] for r in head_rotations),
                                   chunk_len=self._chunk_len,
                                   n_chunks_before=self._n_chunks_before, dropout_rate=rate,
                                   seed=seed, mask_bits=self._mask_bits, head=h,
                                   total_heads=n_heads, round_index=0, n_hashes=1)
            else:
                def scan_round(carry, xs):
                    r, round_rotations = xs
                    return one_round(carry, (qk, v, h, r, round_rotations))
                init = (_full((batch, length), -jnp.inf, qk, dtype=acc),
                        _full((batch, length), 0.0, qk, dtype=acc),
                        _full(v.shape, 0.0, v, dtype=acc))
                (_, weight, out), _ = lax.scan(scan_round, init,
                                               (jnp.arange(n_hashes), head_rotations))
                out = out / weight[..., None]
            return jnp.dot(out.astype(x.dtype), w_o)

        def add_head(total, xs):
            return total + head(x, *xs), None

        total = jnp.zeros_like(x, shape=(batch, length, d))
        total, _ = lax.scan(add_head, total, (projections, w_out, jnp.arange(n_heads),
                                              rotations))
        return total + weights[2][1].astype(x.dtype), state

    def _decode(self, x, weights, state):
        """Writes the new positions' normalised keys and values at the cache index and
        attends to every cached position up to each query (`shared_qk_attention`)."""
        keys, values, index = state
        batch, length, d = x.shape
        d_head = d // self._n_heads
        if batch != keys.shape[0] or length > self._cache_len:
            raise ValueError(f"LSHCausalAttention decodes into a cache of batch "
                             f"{keys.shape[0]} and {self._cache_len} positions, but got "
                             f"inputs of shape {x.shape}; init the layer with this batch, or a "
                             f"larger max_len")

        qk, v = (project(pair, x).reshape(batch, length, self._n_heads, d_head)
                 for pair in weights[:2])
        q_positions = index + jnp.arange(length)
        if self._rotary:
            qk = rotary_embedding(qk, q_positions)
        k = normalised(qk)
        keys = lax.dynamic_update_slice(keys, k.astype(keys.dtype), (0, index, 0, 0))
        values = lax.dynamic_update_slice(values, v.astype(values.dtype), (0, index, 0, 0))
        attended = shared_qk_attention(qk, values.astype(v.dtype), q_positions,
                                       jnp.arange(self._cache_len), keys=keys)
        out = project(weights[2], attended.reshape(batch, length, d))
        return out, (keys, values, index + length)

    def init_weights_and_state(self, input_signature, rng):
        self._check_input(input_signature.shape)
        return init_projections(input_signature, rng, self._d_feature, 3, self._n_heads,
                                self._cache_len)


__all__ = ["DEFAULT_CHUNK_LEN", "MAX_UNFACTORED_BUCKETS", "SELF_PENALTY", "LSHCausalAttention",
           "check_n_buckets", "default_n_buckets", "hash_buckets", "lsh_round", "permute",
           "shared_qk_attention"]
