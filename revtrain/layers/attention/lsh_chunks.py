"""One LSH hashing round of one head: hash, sort, attention within chunks, unsort.

`lsh_round` sorts the positions by bucket (`revtrain.layers.attention.lsh_hashing`), cuts the
sorted rows into chunks of ``chunk_len`` and runs the chunk kernel: each chunk attends to
itself and the ``n_chunks_before`` chunks before it, causal by original position and with
a position's own key lowered by `SELF_PENALTY`. The kernel loops over groups of chunks
(about 4,096 sorted rows at a time, ``float32[batch, chunks, chunk_len, (1 + before) x
chunk_len]`` logits each) and has a custom vjp that saves ``q, k, v``, the positions, the
output and the per-row log-sum-exp (``O(batch x length x d_head)``) and recomputes the
probabilities from the log-sum-exp (FlashAttention's backward). `shared_qk_attention` is
the dense limit under the same rules (one chunk; decoding).

References: Kitaev, Kaiser & Levskaya, 2020, "Reformer: The Efficient Transformer"; Trax
1.4.1 ``trax.layers.research.efficient_attention.LSHSelfAttention`` (the ``1e5`` self
penalty); Dao et al., 2022, "FlashAttention" (the backward pass).
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

from revtrain.layers.attention.blockwise import accumulation_dtype, mesh_full, vary_alike
from revtrain.layers.attention.lsh_hashing import hash_buckets, permute, sort_order
from revtrain.layers.dropout_masks import (
    DEFAULT_MASK_BITS,
    apply_keep_mask,
    drop_threshold,
    position_keep_mask,
)

# Subtracted from a position's logit for its own key (Trax's value): it attends to itself
# only when every other key is masked.
SELF_PENALTY = 1e5
# Sorted query rows the chunk kernel handles per loop iteration.
_GROUP_ROWS = 4096
_SENTINEL = np.iinfo(np.int32).max  # the position of padding: after every real position


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


def _sliced(x: jax.Array, config: _Config) -> bool:
    """Whether `_window` slices ``x`` in place: its chunks before a group (``before x
    chunk`` rows) fit in it. Else (a sequence shorter than them) it is front-padded."""
    return config.before * config.chunk <= x.shape[1]


def _rows(x: jax.Array, g: jax.Array, config: _Config) -> jax.Array:
    """Group ``g``'s query rows of ``x`` as ``[batch, group, chunk, ...]``."""
    size = config.group * config.chunk
    block = lax.dynamic_slice_in_dim(x, g * size, size, axis=1)
    return block.reshape(x.shape[0], config.group, config.chunk, *x.shape[2:])


def _window(x: jax.Array, g: jax.Array, config: _Config, fill=None) -> jax.Array:
    """Group ``g``'s key rows of ``x``: ``[batch, group + before, chunk, ...]``, the
    ``before`` chunks before the group, then its own.

    The rows before group 0 do not exist: they are ``fill`` where given (the positions:
    `_SENTINEL`, so the causal mask hides them) and otherwise whatever rows the clamped
    slice holds (keys and values under masked logits, whose probabilities are exactly 0).
    No front-padded copy of ``x`` is made unless ``x`` is shorter than those rows.
    """
    size, before = config.group * config.chunk, config.before * config.chunk
    if not _sliced(x, config):
        x = _front_pad(x, config, _SENTINEL if fill is not None else 0)
        block = lax.dynamic_slice_in_dim(x, g * size, size + before, axis=1)
    else:
        block = lax.dynamic_slice_in_dim(x, g * size, size, axis=1)
        if before:
            prev = lax.dynamic_slice_in_dim(x, jnp.maximum(g * size - before, 0), before,
                                            axis=1)
            if fill is not None:
                prev = jnp.where(g == 0, jnp.asarray(fill, x.dtype), prev)
            block = jnp.concatenate([prev, block], axis=1)
    return block.reshape(x.shape[0], config.group + config.before, config.chunk,
                         *x.shape[2:])


def _add_window(total: jax.Array, part: jax.Array, g: jax.Array, config: _Config
                ) -> jax.Array:
    """``total`` with `_window`'s transpose of ``part`` (``[batch, group + before, chunk,
    ...]``) added in place: its own chunks at group ``g``'s rows, the chunks before at the
    rows before them (for group 0 those parts are exactly zero: masked keys)."""
    size, before = config.group * config.chunk, config.before * config.chunk
    part = part.reshape(part.shape[0], -1, *part.shape[3:]).astype(total.dtype)

    def add(total, rows, start):
        current = lax.dynamic_slice_in_dim(total, start, rows.shape[1], axis=1)
        return lax.dynamic_update_slice_in_dim(total, current + rows, start, axis=1)

    if not _sliced(total, config):   # tiny: whole-sequence arithmetic on a padded copy
        padded = add(_front_pad(total, config), part, g * size)
        return padded[:, before:]
    total = add(total, part[:, before:], g * size)
    return add(total, part[:, :before], jnp.maximum(g * size - before, 0)) if before else total


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
                   preferred_element_type=accumulation_dtype(q)) / math.sqrt(q.shape[-1])
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


def _window_keys(q: jax.Array, g: jax.Array, config: _Config) -> jax.Array:
    """Group ``g``'s keys, ``[batch, group, (before + 1) chunk, d]``: the normalised
    queries of its window (`normalised`, in the accumulation dtype), computed here rather
    than kept as a second sorted array."""
    return _keys(normalised(_window(q, g, config), keep_wide=True), config)


def _forward(config: _Config, q, v, positions, seed):
    """Output ``[batch, n, d_v]`` and log-sum-exp ``[batch, n]`` of the sorted rows."""
    batch, n, _ = q.shape
    size = config.group * config.chunk
    acc = accumulation_dtype(q)
    like = (q, v, seed)

    def group(g, carry):
        out, lse = carry
        s = _logits(_rows(q, g, config), _window_keys(q, g, config),
                    _rows(positions, g, config),
                    _keys(_window(positions, g, config, _SENTINEL), config))
        m = s.max(axis=-1, keepdims=True)
        p = jnp.exp(s - m)
        total = p.sum(axis=-1, keepdims=True)
        p = _dropped(p, seed, g, config).astype(v.dtype)
        o = jnp.einsum("bgqk,bgkd->bgqd", p, _keys(_window(v, g, config), config),
                       preferred_element_type=acc) / total
        out = lax.dynamic_update_slice_in_dim(
            out, o.reshape(batch, size, -1).astype(out.dtype), g * size, axis=1)
        lse = lax.dynamic_update_slice_in_dim(
            lse, (m + jnp.log(total)).reshape(batch, size), g * size, axis=1)
        return out, lse

    init = (mesh_full((batch, n, v.shape[-1]), 0.0, *like).astype(v.dtype),
            mesh_full((batch, n), 0.0, *like, dtype=acc))
    return lax.fori_loop(0, n // size, group, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk_attention(config: _Config, q, v, positions, seed):
    return _forward(config, q, v, positions, seed)


def _chunk_attention_fwd(config: _Config, q, v, positions, seed):
    out, lse = _forward(config, q, v, positions, seed)
    return (out, lse), (q, v, positions, seed, out, lse)


def _chunk_attention_bwd(config: _Config, residuals, cts):
    q, v, positions, seed, out, lse = residuals
    d_out, d_lse = cts
    batch, n, _ = q.shape
    acc = accumulation_dtype(q)
    # d out_r / d s_rc as blockwise attention's backward; d lse_r / d s_rc = p_rc adds
    # d_lse_r, which enters as a shift of D_r = do_r . out_r.
    delta = jnp.einsum("bnd,bnd->bn", d_out, out, preferred_element_type=acc) - d_lse
    size = config.group * config.chunk
    scale = 1.0 / math.sqrt(q.shape[-1])
    like = (q, v, d_out, d_lse, seed)

    def group(g, carry):
        dq, dk, dv = carry
        q_g, do_g = _rows(q, g, config), _rows(d_out, g, config)
        k_g, v_g = _window_keys(q, g, config), _keys(_window(v, g, config), config)
        s = _logits(q_g, k_g, _rows(positions, g, config),
                    _keys(_window(positions, g, config, _SENTINEL), config))
        p = jnp.exp(s - _rows(lse, g, config)[..., None])
        dv_g = jnp.einsum("bgqk,bgqd->bgkd", _dropped(p, seed, g, config).astype(do_g.dtype),
                          do_g, preferred_element_type=acc)
        dp = jnp.einsum("bgqd,bgkd->bgqk", do_g, v_g, preferred_element_type=acc)
        ds = p * (_dropped(dp, seed, g, config) - _rows(delta, g, config)[..., None])
        dq_g = jnp.einsum("bgqk,bgkd->bgqd", ds, k_g, preferred_element_type=acc) * scale
        dk_g = jnp.einsum("bgqk,bgqd->bgkd", ds, q_g, preferred_element_type=acc) * scale
        dq = lax.dynamic_update_slice_in_dim(dq, dq_g.reshape(batch, size, -1), g * size,
                                             axis=1)
        return (dq, _add_window(dk, _unkeys(dk_g, config), g, config),
                _add_window(dv, _unkeys(dv_g, config), g, config))

    zeros = [mesh_full(x.shape, 0.0, *like, dtype=acc) for x in (q, q, v)]
    dq, dk, dv = lax.fori_loop(0, n // size, group, tuple(zeros))
    # The keys are the normalised queries: their cotangent joins the queries' through it.
    _, normalised_vjp = jax.vjp(lambda x: normalised(x, keep_wide=True), q)
    (dq_from_keys,) = normalised_vjp(dk)
    return (dq + dq_from_keys).astype(q.dtype), dv.astype(v.dtype), None, None


_chunk_attention.defvjp(_chunk_attention_fwd, _chunk_attention_bwd)


def lsh_round(qk: jax.Array, v: jax.Array, rotations: Sequence[jax.Array], *, chunk_len: int,
              n_chunks_before: int, dropout_rate: float = 0.0,
              seed: jax.Array | None = None, mask_bits: int = DEFAULT_MASK_BITS,
              head: Any = 0, total_heads: int = 1, round_index: Any = 0,
              n_hashes: int = 1) -> tuple[jax.Array, jax.Array]:
    """One hashing round of one head: hash, sort, chunk attention, unsort.

    Args:
      qk: ``[batch, length, d_head]`` shared queries/keys (keys are their normalisation).
      v: ``[batch, length, d_value]`` values (``d_value`` may differ from ``d_head``).
      rotations: one ``float32[d_head, n_f / 2]`` per bucket factor (`hash_buckets`).
      chunk_len, n_chunks_before: as `LSHCausalAttention`.
      dropout_rate, seed, mask_bits: attention dropout (``seed``: uint32[2] from
        `revtrain.layers.dropout_masks.mask_seed`).
      head, total_heads, round_index, n_hashes: where this call sits among all heads and
        rounds, so every (head, round) draws its own dropout mask.

    Returns:
      the output ``[batch, length, d_value]`` in ``v.dtype`` and the per-position
      log-sum-exp of the logits it saw, ``[batch, length]`` (at least float32).
    """
    batch, length, _ = qk.shape
    order, inverse = sort_order(hash_buckets(qk, rotations),
                                math.prod(2 * r.shape[-1] for r in rotations))
    q = permute(qk, order, inverse)
    # Keys are q's normalisation, computed per window inside the kernel in the
    # accumulation dtype (their cotangent, before the normalisation's 1 / |q| shrinks it,
    # can exceed float16's range), so no second sorted array is kept.
    sv = permute(v, order, inverse)
    n_chunks = -(-length // chunk_len)
    group = min(max(1, _GROUP_ROWS // chunk_len), n_chunks)
    chunked = n_chunks * chunk_len  # the dropout mask's rows per round: not the grouping's
    padded = -(-n_chunks // group) * group * chunk_len
    pad = padded - length
    if pad:
        q, sv = (jnp.pad(a, [(0, 0), (0, pad), (0, 0)]) for a in (q, sv))
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
    q, sv, order_p, seed = vary_alike(q, sv, order_p, seed)
    out, lse = _chunk_attention(config, q, sv, order_p, seed)
    if pad:
        out, lse = out[:, :length], lse[:, :length]
    return permute(out, inverse, order), permute(lse, inverse, order)


def normalised(x: jax.Array, keep_wide: bool = False) -> jax.Array:
    """``x / sqrt(|x|^2 + 1e-6)`` over the last axis, computed in at least float32 (so a
    float16 ``x`` neither overflows nor loses its gradient), returned in ``x.dtype`` (in
    that wider dtype with ``keep_wide``)."""
    wide = x.astype(accumulation_dtype(x))
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
    acc = accumulation_dtype(qk)
    s = jnp.einsum("bqhd,bkhd->bhqk", qk, keys.astype(qk.dtype),
                   preferred_element_type=acc) / math.sqrt(qk.shape[-1])
    qp, kp = q_positions[:, None], k_positions[None, :]
    s = jnp.where(kp <= qp, s, -jnp.inf)
    s = jnp.where(kp == qp, s - SELF_PENALTY, s)
    probs = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


__all__ = ["SELF_PENALTY", "lsh_round", "normalised", "shared_qk_attention"]
