"""The block computations shared by blockwise and ring attention.

`revtrain.layers.attention.blockwise` (one device) and `revtrain.layers.attention.ring`
(the length split over a mesh axis) run the same two loops over blocks of ``block``
rows, defined here once:

* `query_block_forward` -- the online softmax (Milakov & Gimelshein, 2018): one query
  block's running maximum ``m``, sum of exponentials ``total`` and unnormalised output
  ``acc``, updated by key blocks ``0 .. i``;
* `backward_blocks` -- FlashAttention-2's backward loop order (Dao, 2023): an outer loop
  over key blocks accumulating ``dk, dv``, an inner one over the query blocks ``i >= j``
  adding into ``dq``, with each block's probabilities recomputed from the saved per-row
  log-sum-exp.

Positions. Row ``r`` of the arrays a call holds is global position ``r * stride +
offset``: ``stride = 1, offset = 0`` on one device; on ``n`` striped sequence shards
(`revtrain.layers.sequence_parallel`) ``stride = n`` and the offset is the shard index of
the queries (``row_offset``) or of the keys (``col_offset``). The causal mask and the
attention-dropout mask are functions of these global positions, so a block computes the
same logits and drops the same probabilities however the sequence is split. For either
layout key blocks after query block ``i`` (``j > i``) hold no visible key, so both loops
visit only ``j <= i``.

Logits, softmax statistics and accumulators are at least float32
(`accumulation_dtype`); a loop iteration holds a few ``float32[batch, n_heads, block,
block]`` temporaries.

References: Milakov & Gimelshein, 2018, "Online normalizer calculation for softmax"; Dao
et al., 2022, "FlashAttention"; Dao, 2023, "FlashAttention-2".
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from revtrain.layers.core import check_rate
from revtrain.layers.dropout_masks import (
    apply_keep_mask,
    check_mask_bits,
    drop_threshold,
    mask_seed,
    position_keep_mask,
)


class BlockConfig(NamedTuple):
    """Static settings of one blockwise computation (hashable, a custom_vjp nondiff arg)."""
    length: int        # unpadded rows held by this call (the local length when sharded)
    block: int         # rows per block
    rate: float        # attention-dropout rate (0: none)
    mask_bits: int
    total_heads: int   # heads of the whole attention (this call may hold some of them)
    stride: int = 1    # global position of row r: r * stride + offset


def check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, owner: str) -> None:
    """Raises ValueError unless ``q, k, v`` are float ``[batch, length, n_heads, d_head]``
    alike (``v`` may differ in ``d_head``) with ``length > 0``."""
    if q.ndim != 4 or q.shape != k.shape or q.shape[:3] != v.shape[:3]:
        raise ValueError(f"{owner} expects q, k, v of shape [batch, length, n_heads, d_head] "
                         f"alike; got {q.shape}, {k.shape}, {v.shape}")
    if not all(jnp.issubdtype(a.dtype, jnp.floating) for a in (q, k, v)):
        raise ValueError(f"{owner} needs float q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}; "
                         f"cast them (e.g. to float32) first")
    if q.shape[1] == 0:
        raise ValueError(f"{owner} got a length-0 sequence; pass at least one position")


def dropout_seed(dropout_rate: float, rng: jax.Array | None, mask_bits: int,
                 head_start: int | jax.Array, owner: str) -> tuple[float, int, jax.Array]:
    """``(rate, mask_bits, seed)``: the rate in effect (0 when it quantises to nothing) and
    the uint32[3] seed ``(mask_seed(rng), head_start)`` of the dropout masks.

    Raises:
      ValueError: for a rate outside ``[0, 1)``, ``mask_bits`` not 8 or 16, or dropout
        without an rng.
    """
    mask_bits = check_mask_bits(mask_bits, owner)
    rate = check_rate(dropout_rate, owner)
    if rate and drop_threshold(rate, mask_bits) == 0:
        rate = 0.0
    if rate and rng is None:
        raise ValueError(f"{owner} with dropout_rate={rate} needs an rng; pass a "
                         f"jax.random.key or use dropout_rate=0")
    seed = mask_seed(rng) if rate else jnp.zeros((2,), jnp.uint32)
    head = jnp.asarray(head_start).astype(jnp.uint32).reshape(1)
    return rate, mask_bits, jnp.concatenate([seed, head])


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


def mesh_full(shape: tuple[int, ...], value: float, *like: jax.Array, dtype=jnp.float32
              ) -> jax.Array:
    """``dtype`` ``shape`` filled with ``value``, varying over every mesh axis any of
    ``like`` varies over (inside ``shard_map`` a loop carry must keep its axes' type)."""
    base = sum(jnp.zeros_like(x, shape=(), dtype=dtype) for x in like)
    return jnp.full(shape, value, dtype) + base


def accumulation_dtype(x: jax.Array):
    """The dtype of logits and sums for inputs like ``x``: at least float32."""
    return jnp.promote_types(x.dtype, jnp.float32)


def pad(x: jax.Array, config: BlockConfig) -> jax.Array:
    """Zero-pads axis 1 (length) to a multiple of the block (no copy when it divides)."""
    extra = -config.length % config.block
    return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2)) if extra else x


def block(x: jax.Array, index: jax.Array, config: BlockConfig, axis: int = 1) -> jax.Array:
    """Block ``index`` of ``x`` along its length axis."""
    return lax.dynamic_slice_in_dim(x, index * config.block, config.block, axis=axis)


def put(x: jax.Array, value: jax.Array, index: jax.Array, config: BlockConfig,
        axis: int = 1) -> jax.Array:
    """``x`` with block ``index`` (along the length axis) replaced by ``value``."""
    return lax.dynamic_update_slice_in_dim(x, value.astype(x.dtype), index * config.block,
                                           axis=axis)


def heads_last(x: jax.Array) -> jax.Array:
    """``[batch, heads, rows] -> [batch, rows, heads, 1]``, to scale ``[b, q, h, d]``."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def _first(index: jax.Array, offset: jax.Array, config: BlockConfig) -> jax.Array:
    """Global position of block ``index``'s first row."""
    return index * (config.block * config.stride) + offset


def _positions(index: jax.Array, offset: jax.Array, config: BlockConfig) -> jax.Array:
    """int32 ``[block]`` global positions of block ``index``'s rows."""
    return _first(index, offset, config) + jnp.arange(config.block) * config.stride


def _logits(q_blk: jax.Array, k_blk: jax.Array, rows: jax.Array, cols: jax.Array
            ) -> jax.Array:
    """``[batch, heads, block, block]`` scaled logits, -inf where a key is after a query."""
    scale = 1.0 / math.sqrt(q_blk.shape[-1])
    s = jnp.einsum("bqhd,bkhd->bhqk", q_blk, k_blk,
                   preferred_element_type=accumulation_dtype(q_blk)) * scale
    return jnp.where(cols[None, :] <= rows[:, None], s, -jnp.inf)


def _keep(shape: tuple[int, ...], seed: jax.Array, i: jax.Array, j: jax.Array,
          offsets: tuple, config: BlockConfig) -> jax.Array | None:
    """Block ``(i, j)``'s dropout keep-mask (None without dropout)."""
    if not config.rate:
        return None
    return position_keep_mask(seed, shape, _first(i, offsets[0], config),
                              _first(j, offsets[1], config), config.length * config.stride,
                              config.rate, config.mask_bits, head_start=seed[2],
                              total_heads=config.total_heads, stride=config.stride)


def _dropped(x: jax.Array, keep: jax.Array | None, config: BlockConfig) -> jax.Array:
    """``x`` with the probabilities ``keep`` drops zeroed and the rest scaled."""
    return x if keep is None else apply_keep_mask(x, keep, config.rate, config.mask_bits)


def query_block_forward(config: BlockConfig, q_blk: jax.Array, kp: jax.Array, vp: jax.Array,
                        seed: jax.Array, i: jax.Array, carry: tuple, row_offset: jax.Array = 0,
                        col_offset: jax.Array = 0) -> tuple:
    """Online-softmax update of query block ``i`` by key blocks ``0 .. i`` of ``kp, vp``.

    Args:
      config: the static settings.
      q_blk: ``[batch, block, heads, d]`` query block ``i``.
      kp, vp: ``[batch, padded_length, heads, d]`` padded keys and values.
      seed: uint32[3] dropout seed (`dropout_seed`).
      i: the query block's index.
      carry: ``(m, total: [batch, heads, block], acc: [batch, block, heads, d_v])`` in
        `accumulation_dtype`; ``m`` must become finite in the first key block visited
        (it does when these are a query's own keys: position ``offset`` is always seen).
      row_offset, col_offset: the offsets of the queries' and the keys' positions.

    Returns:
      The updated ``(m, total, acc)``.
    """
    rows = _positions(i, row_offset, config)
    acc_dtype = accumulation_dtype(q_blk)

    def key_block(j, carry):
        m, total, acc = carry
        s = _logits(q_blk, block(kp, j, config), rows, _positions(j, col_offset, config))
        m_new = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        total = total * correction + p.sum(axis=-1)
        keep = _keep(p.shape, seed, i, j, (row_offset, col_offset), config)
        p = _dropped(p, keep, config).astype(vp.dtype)
        pv = jnp.einsum("bhqk,bkhd->bqhd", p, block(vp, j, config),
                        preferred_element_type=acc_dtype)
        return m_new, total, acc * heads_last(correction) + pv

    return lax.fori_loop(0, i + 1, key_block, carry)


def row_deltas(dop: jax.Array, outp: jax.Array) -> jax.Array:
    """``D_r = sum_c A_rc (do_r . v_c) = do_r . out_r`` (``A``: the dropped probabilities):
    ``[batch, heads, rows]`` in `accumulation_dtype`, from ``[batch, rows, heads, d]``."""
    return jnp.einsum("bqhd,bqhd->bhq", dop, outp, preferred_element_type=accumulation_dtype(dop))


def backward_blocks(config: BlockConfig, qp: jax.Array, kp: jax.Array, vp: jax.Array,
                    dop: jax.Array, lse: jax.Array, delta: jax.Array, seed: jax.Array,
                    grads: tuple, row_offset: jax.Array = 0, col_offset: jax.Array = 0
                    ) -> tuple:
    """Adds the attention of queries ``qp`` to keys ``kp, vp`` into ``grads = (dq, dk, dv)``.

    Args:
      config: the static settings.
      qp, kp, vp, dop: padded ``[batch, padded_length, heads, d]`` queries, keys, values
        and output cotangents.
      lse, delta: ``[batch, heads, padded_length]`` per-row log-sum-exp and `row_deltas`.
      seed: uint32[3] dropout seed.
      grads: ``(dq, dk, dv)`` shaped as ``qp, kp, vp``: ``dq`` in `accumulation_dtype`,
        ``dk, dv`` in any float dtype (each block is added in `accumulation_dtype` and
        stored back in theirs).
      row_offset, col_offset: the offsets of the queries' and the keys' positions.

    Returns:
      ``(dq, dk, dv)`` with this pair of query and key shards' terms added.
    """
    acc_dtype = accumulation_dtype(qp)
    n_blocks = qp.shape[1] // config.block
    scale = 1.0 / math.sqrt(qp.shape[-1])
    offsets = (row_offset, col_offset)

    def key_block(j, grads):
        dq, dk_all, dv_all = grads
        k_blk, v_blk = block(kp, j, config), block(vp, j, config)
        cols = _positions(j, col_offset, config)

        def query_block(i, carry):
            dk, dv, dq = carry
            q_blk, do_blk = block(qp, i, config), block(dop, i, config)
            lse_blk = block(lse, i, config, axis=2)
            s = _logits(q_blk, k_blk, _positions(i, row_offset, config), cols)
            p = jnp.exp(s - lse_blk[..., None])
            keep = _keep(p.shape, seed, i, j, offsets, config)   # one mask for p and dp
            dropped = _dropped(p, keep, config).astype(do_blk.dtype)
            dv = dv + jnp.einsum("bhqk,bqhd->bkhd", dropped, do_blk,
                                 preferred_element_type=acc_dtype)
            dp = jnp.einsum("bqhd,bkhd->bhqk", do_blk, v_blk, preferred_element_type=acc_dtype)
            ds = p * (_dropped(dp, keep, config)
                      - block(delta, i, config, axis=2)[..., None])
            dq_blk = jnp.einsum("bhqk,bkhd->bqhd", ds, k_blk,
                                preferred_element_type=acc_dtype) * scale
            dq = put(dq, block(dq, i, config) + dq_blk, i, config)
            dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds, q_blk,
                                 preferred_element_type=acc_dtype) * scale
            return dk, dv, dq

        init = (block(dk_all, j, config).astype(acc_dtype),
                block(dv_all, j, config).astype(acc_dtype), dq)
        dk, dv, dq = lax.fori_loop(j, n_blocks, query_block, init)
        return dq, put(dk_all, dk, j, config), put(dv_all, dv, j, config)

    return lax.fori_loop(0, n_blocks, key_block, grads)


__all__ = ["BlockConfig", "accumulation_dtype", "backward_blocks", "block", "check_inputs",
           "dropout_seed", "heads_last", "mesh_full", "pad", "put", "query_block_forward",
           "row_deltas", "vary_alike"]
