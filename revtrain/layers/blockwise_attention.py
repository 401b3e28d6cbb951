"""Exact causal attention in O(length) memory: online softmax over blocks, recomputing vjp.

`blockwise_attention` computes ``softmax(q k^T / sqrt(d_head) + causal_mask) v`` without
ever holding the ``[batch, n_heads, length, length]`` logits or probabilities. The
sequence is cut into blocks of ``block_size`` positions; for each query block a loop over
the key blocks at or before it keeps a running maximum, a running sum of exponentials and
an unnormalised output (the online softmax of Milakov & Gimelshein, 2018, as used by Rabe &
Staats, 2021, and FlashAttention, Dao et al., 2022). Key blocks wholly after a query block
are never visited, so causal attention does about half the work of the full product.

The backward pass is a ``jax.custom_vjp`` that recomputes each block's probabilities from
the saved per-row log-sum-exp (FlashAttention's backward, in the loop order of
FlashAttention-2: an outer loop over key blocks accumulating ``dk, dv``, an inner one over
the query blocks at or after it adding into ``dq``). Residuals kept between the passes:
``q, k, v`` and the output in their dtype and the log-sum-exp in float32, i.e.
``O(batch x length x n_heads x d_head)``; no ``length x length`` array is saved. Each loop
iteration holds a few ``float32[batch, n_heads, block_size, block_size]`` temporaries.

Loops are ``lax.fori_loop``/``lax.scan`` over block indices, so the compiled program and its
compile time do not grow with the length. Logits, softmax statistics and accumulators are
at least float32 whatever the input dtype (bfloat16 inputs are multiplied with float32
accumulation; float64 stays float64); the output has ``v``'s dtype.

Differentiation: reverse mode (``jax.grad``, ``jax.vjp``) and forward-over-reverse
(``jax.jacfwd(jax.grad(f))``, Hessian-vector products) work; forward mode alone
(``jax.jvp``) and reverse-over-reverse (``jax.grad`` of ``jax.grad``) do not -- the vjp is
custom and its loops have data-dependent bounds -- so use ``implementation='xla'`` where a
second reverse-mode derivative is needed.

Attention dropout drops normalised probabilities, as the full path does; each element's
keep decision is `revtrain.layers.dropout_masks.position_keep_mask` of its global ``(row,
column)``, so the mask is the same for every block size and equals the full path's mask:
blockwise and full attention agree with dropout too, and the reverse pass and every
trainer draw the same mask from the same key.

A length that ``block_size`` does not divide is padded to a multiple of it; the padded keys
lie after every real query, so the causal mask hides them, and the padded queries'
outputs are cut off (their cotangents are zero).

References:
  Rabe & Staats, 2021, "Self-attention Does Not Need O(n^2) Memory"; Dao et al., 2022,
  "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness"; Dao, 2023,
  "FlashAttention-2"; Milakov & Gimelshein, 2018, "Online normalizer calculation for
  softmax".
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from revtrain.layers.core import check_rate
from revtrain.layers.dropout_masks import (
    DEFAULT_MASK_BITS,
    apply_keep_mask,
    check_mask_bits,
    drop_threshold,
    mask_seed,
    position_keep_mask,
)

DEFAULT_BLOCK_SIZE = 512


def check_block_size(block_size: object, owner: str) -> int:
    """Returns ``block_size`` as an int if it is a positive int, else raises ValueError."""
    if (isinstance(block_size, bool) or not isinstance(block_size, int)
            or block_size < 1):
        raise ValueError(f"{owner} block_size={block_size!r} must be a positive int; use e.g. "
                         f"block_size={DEFAULT_BLOCK_SIZE}")
    return block_size


class _Config(NamedTuple):
    """Static settings of one blockwise computation (hashable, a custom_vjp nondiff arg);
    logits and accumulators are ``promote_types(dtype, float32)``: float32, or float64
    for float64 inputs."""
    length: int        # unpadded sequence length
    block: int         # positions per block
    rate: float        # attention-dropout rate (0: none)
    mask_bits: int
    total_heads: int   # heads of the whole attention (this call may hold some of them)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                        block_size: int = DEFAULT_BLOCK_SIZE, dropout_rate: float = 0.0,
                        rng: jax.Array | None = None,
                        mask_bits: int = DEFAULT_MASK_BITS, head_start: int | jax.Array = 0,
                        total_heads: int | None = None) -> jax.Array:
    """Causal scaled dot-product attention over blocks, in memory linear in the length.

    Args:
      q, k, v: ``[batch, length, n_heads, d_head]`` queries, keys and values (one length:
        causal self-attention); float dtypes, e.g. float32 or bfloat16.
      block_size: positions per query and key block (a block's logits take ``4 * batch *
        n_heads * block_size**2`` bytes). Need not divide the length.
      dropout_rate: drop rate of the attention probabilities, in ``[0, 1)``.
      rng: PRNG key of the dropout mask; needed when ``dropout_rate > 0``.
      mask_bits: random bits per mask element, 16 or 8 (`revtrain.layers.dropout_masks`).
      head_start, total_heads: when ``q, k, v`` hold heads ``head_start ..`` of an
        attention of ``total_heads`` heads (default: all of them), so that a call per head
        draws the dropout masks of one call over all heads.

    Returns:
      ``[batch, length, n_heads, d_head]`` in ``v.dtype``; equal to the full path
      (`revtrain.layers.attention.einsum_attention` with ``is_causal=True``) up to float
      rounding, dropout included.

    Raises:
      ValueError: for a non-positive ``block_size``, shapes that are not
        ``[batch, length, n_heads, d_head]`` alike, or dropout without an rng.
    """
    block_size = check_block_size(block_size, "blockwise_attention")
    mask_bits = check_mask_bits(mask_bits, "blockwise_attention")
    if q.ndim != 4 or q.shape != k.shape or q.shape[:3] != v.shape[:3]:
        raise ValueError(f"blockwise_attention expects q, k, v of shape [batch, length, "
                         f"n_heads, d_head] alike; got {q.shape}, {k.shape}, {v.shape}")
    if not all(jnp.issubdtype(a.dtype, jnp.floating) for a in (q, k, v)):
        raise ValueError(f"blockwise_attention needs float q, k, v; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}; cast them (e.g. to float32) first")
    if q.shape[1] == 0:
        raise ValueError("blockwise_attention got a length-0 sequence; pass at least one "
                         "position")
    rate = check_rate(dropout_rate, "blockwise_attention")
    if rate and drop_threshold(rate, mask_bits) == 0:
        rate = 0.0
    if rate and rng is None:
        raise ValueError(f"blockwise_attention with dropout_rate={rate} needs an rng; pass a "
                         f"jax.random.key or use dropout_rate=0")
    seed = mask_seed(rng) if rate else jnp.zeros((2,), jnp.uint32)
    seed = jnp.concatenate([seed, jnp.asarray(head_start).astype(jnp.uint32).reshape(1)])
    length = q.shape[1]
    total = q.shape[2] if total_heads is None else int(total_heads)
    config = _Config(length, min(block_size, length), rate, mask_bits, total)
    # Inside shard_map every operand must vary over the mesh axes any of them varies over,
    # so that the custom vjp's cotangents have their primals' types; autodiff turns the
    # cast of a replicated operand into a sum over the axis outside the kernel.
    q, k, v, seed = vary_alike(q, k, v, seed)
    return _attention(config, q, k, v, seed)


def _varying_axes(x: jax.Array) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def vary_alike(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """``xs``, each cast to vary over the union of the axes any of them varies over."""
    axes = frozenset().union(*(_varying_axes(x) for x in xs))
    out = []
    for x in xs:
        missing = tuple(sorted(axes - _varying_axes(x)))
        out.append(lax.pcast(x, missing, to="varying") if missing else x)
    return tuple(out)


def _pad(x: jax.Array, config: _Config) -> jax.Array:
    """Zero-pads axis 1 (length) to a multiple of the block (no copy when it divides)."""
    pad = -config.length % config.block
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x


def _block(x: jax.Array, index: jax.Array, config: _Config, axis: int = 1) -> jax.Array:
    """Block ``index`` of ``x`` along its length axis."""
    return lax.dynamic_slice_in_dim(x, index * config.block, config.block, axis=axis)


def _put(x: jax.Array, value: jax.Array, index: jax.Array, config: _Config,
         axis: int = 1) -> jax.Array:
    """``x`` with block ``index`` (along the length axis) replaced by ``value``."""
    return lax.dynamic_update_slice_in_dim(x, value.astype(x.dtype), index * config.block,
                                           axis=axis)


def _logits(q_blk: jax.Array, k_blk: jax.Array, i: jax.Array, j: jax.Array,
            config: _Config) -> jax.Array:
    """float32 ``[batch, heads, block, block]`` scaled logits, -inf where causally hidden."""
    scale = 1.0 / math.sqrt(q_blk.shape[-1])
    s = jnp.einsum("bqhd,bkhd->bhqk", q_blk, k_blk,
                   preferred_element_type=accumulation_dtype(q_blk)) * scale
    rows = i * config.block + jnp.arange(config.block)
    cols = j * config.block + jnp.arange(config.block)
    return jnp.where(cols[None, :] <= rows[:, None], s, -jnp.inf)


def _dropped(x: jax.Array, seed: jax.Array, i: jax.Array, j: jax.Array,
             config: _Config) -> jax.Array:
    """``x`` with the block's dropped probabilities zeroed and the rest scaled."""
    if not config.rate:
        return x
    keep = position_keep_mask(seed, x.shape, i * config.block, j * config.block,
                              config.length, config.rate, config.mask_bits,
                              head_start=seed[2], total_heads=config.total_heads)
    return apply_keep_mask(x, keep, config.rate, config.mask_bits)


def mesh_full(shape: tuple[int, ...], value: float, *like: jax.Array, dtype=jnp.float32
          ) -> jax.Array:
    """``dtype`` ``shape`` filled with ``value``, varying over every mesh axis any of
    ``like`` varies over (inside ``shard_map`` a loop carry must keep its axes' type)."""
    base = sum(jnp.zeros_like(x, shape=(), dtype=dtype) for x in like)
    return jnp.full(shape, value, dtype) + base


def accumulation_dtype(x: jax.Array):
    """The dtype of logits and sums for inputs like ``x``: at least float32."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _heads_last(x: jax.Array) -> jax.Array:
    """``[batch, heads, rows] -> [batch, rows, heads, 1]``, to scale ``[b, q, h, d]``."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def _forward(config: _Config, q: jax.Array, k: jax.Array, v: jax.Array,
             seed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns the output ``[batch, padded_length, heads, d]`` in ``v.dtype`` and the
    per-row log-sum-exp ``[batch, heads, padded_length]`` (float32, or float64 for float64 inputs).

    Everything stays in the inputs' ``[batch, length, heads, d]`` layout: a block is a
    slice of it, and outputs are written into place, so no whole-array transpose or
    stacked copy exists beside the inputs.
    """
    qp, kp, vp = (_pad(x, config) for x in (q, k, v))
    batch, padded, heads, _ = qp.shape
    rows = (batch, heads, config.block)
    like = (qp, kp, vp, seed)
    acc_dtype = accumulation_dtype(qp)

    def query_block(i, outputs):
        out, lse = outputs
        q_blk = _block(qp, i, config)

        def key_block(j, carry):
            m, total, acc = carry
            s = _logits(q_blk, _block(kp, j, config), i, j, config)
            m_new = jnp.maximum(m, s.max(axis=-1))
            correction = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            total = total * correction + p.sum(axis=-1)
            p = _dropped(p, seed, i, j, config).astype(vp.dtype)
            pv = jnp.einsum("bhqk,bkhd->bqhd", p, _block(vp, j, config),
                            preferred_element_type=acc_dtype)
            return m_new, total, acc * _heads_last(correction) + pv

        init = (mesh_full(rows, -jnp.inf, *like, dtype=acc_dtype),
                mesh_full(rows, 0.0, *like, dtype=acc_dtype),
                mesh_full(q_blk.shape[:3] + (vp.shape[-1],), 0.0, *like, dtype=acc_dtype))
        m, total, acc = lax.fori_loop(0, i + 1, key_block, init)
        out = _put(out, acc / _heads_last(total), i, config)
        return out, _put(lse, m + jnp.log(total), i, config, axis=2)

    out = mesh_full((batch, padded, heads, vp.shape[-1]), 0.0, *like).astype(vp.dtype)
    lse = mesh_full((batch, heads, padded), 0.0, *like, dtype=acc_dtype)
    return lax.fori_loop(0, padded // config.block, query_block, (out, lse))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config: _Config, q, k, v, seed):
    out, _ = _forward(config, q, k, v, seed)
    return out[:, :config.length]


def _attention_fwd(config: _Config, q, k, v, seed):
    out, lse = _forward(config, q, k, v, seed)
    out = out[:, :config.length]
    return out, (q, k, v, out, lse, seed)


def _attention_bwd(config: _Config, residuals, d_out):
    q, k, v, out, lse, seed = residuals
    qp, kp, vp, dop = (_pad(x, config) for x in (q, k, v, d_out))
    # D_r = sum_c A_rc (do_r . v_c) = do_r . out_r  (A: the dropped probabilities).
    acc_dtype = accumulation_dtype(qp)
    delta = jnp.einsum("bqhd,bqhd->bhq", dop, _pad(out, config),
                       preferred_element_type=acc_dtype)
    n_blocks = qp.shape[1] // config.block
    scale = 1.0 / math.sqrt(q.shape[-1])
    like = (qp, kp, vp, dop, lse, seed)

    def key_block(j, grads):
        dq, dk_all, dv_all = grads
        k_blk, v_blk = _block(kp, j, config), _block(vp, j, config)

        def query_block(i, carry):
            dk, dv, dq = carry
            q_blk, do_blk = _block(qp, i, config), _block(dop, i, config)
            lse_blk = _block(lse, i, config, axis=2)
            p = jnp.exp(_logits(q_blk, k_blk, i, j, config) - lse_blk[..., None])
            dv = dv + jnp.einsum("bhqk,bqhd->bkhd",
                                 _dropped(p, seed, i, j, config).astype(do_blk.dtype), do_blk,
                                 preferred_element_type=acc_dtype)
            dp = jnp.einsum("bqhd,bkhd->bhqk", do_blk, v_blk,
                            preferred_element_type=acc_dtype)
            ds = p * (_dropped(dp, seed, i, j, config)
                      - _block(delta, i, config, axis=2)[..., None])
            dq_blk = jnp.einsum("bhqk,bkhd->bqhd", ds, k_blk,
                                preferred_element_type=acc_dtype) * scale
            dq = _put(dq, _block(dq, i, config) + dq_blk, i, config)
            dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds, q_blk,
                                 preferred_element_type=acc_dtype) * scale
            return dk, dv, dq

        init = (mesh_full(k_blk.shape, 0.0, *like, dtype=acc_dtype),
                mesh_full(v_blk.shape, 0.0, *like, dtype=acc_dtype), dq)
        dk, dv, dq = lax.fori_loop(j, n_blocks, query_block, init)
        return dq, _put(dk_all, dk, j, config), _put(dv_all, dv, j, config)

    zeros = [mesh_full(x.shape, 0.0, *like).astype(x.dtype) for x in (kp, vp)]
    dq, dk, dv = lax.fori_loop(0, n_blocks, key_block,
                               (mesh_full(qp.shape, 0.0, *like, dtype=acc_dtype), *zeros))
    n = config.length
    return dq[:, :n].astype(q.dtype), dk[:, :n], dv[:, :n], None


_attention.defvjp(_attention_fwd, _attention_bwd)

__all__ = ["DEFAULT_BLOCK_SIZE", "accumulation_dtype", "blockwise_attention", "check_block_size",
           "mesh_full", "vary_alike"]
