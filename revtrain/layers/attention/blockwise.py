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

The block loops are `revtrain.layers.attention.blockwise_kernel`'s, shared with ring attention
(`revtrain.layers.attention.ring`), which runs them over a sequence split across devices.
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

import jax
import jax.numpy as jnp
from jax import lax

from revtrain.layers.attention.blockwise_kernel import (
    BlockConfig,
    accumulation_dtype,
    backward_blocks,
    block,
    check_inputs,
    dropout_seed,
    heads_last,
    mesh_full,
    pad,
    put,
    query_block_forward,
    row_deltas,
    vary_alike,
)
from revtrain.layers.dropout_masks import DEFAULT_MASK_BITS
from revtrain.layers.sequence_parallel import check_not_split

DEFAULT_BLOCK_SIZE = 512


def check_block_size(block_size: object, owner: str) -> int:
    """Returns ``block_size`` as an int if it is a positive int, else raises ValueError."""
    if (isinstance(block_size, bool) or not isinstance(block_size, int)
            or block_size < 1):
        raise ValueError(f"{owner} block_size={block_size!r} must be a positive int; use e.g. "
                         f"block_size={DEFAULT_BLOCK_SIZE}")
    return block_size


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                        block_size: int = DEFAULT_BLOCK_SIZE, dropout_rate: float = 0.0,
                        rng: jax.Array | None = None,
                        mask_bits: int = DEFAULT_MASK_BITS, head_start: int | jax.Array = 0,
                        total_heads: int | None = None) -> jax.Array:
    """Causal scaled dot-product attention over blocks, in memory linear in the length.

    Args:
      q: ``[batch, length, n_heads, d_head]`` queries (one length: causal
        self-attention); a float dtype, e.g. float32 or bfloat16.
      k: ``[batch, length, n_heads, d_head]`` keys.
      v: ``[batch, length, n_heads, d_head]`` values.
      block_size: positions per query and key block (a block's logits take ``4 * batch *
        n_heads * block_size**2`` bytes). Need not divide the length.
      dropout_rate: drop rate of the attention probabilities, in ``[0, 1)``.
      rng: PRNG key of the dropout mask; needed when ``dropout_rate > 0``.
      mask_bits: random bits per mask element, 16 or 8 (`revtrain.layers.dropout_masks`).
      head_start: when ``q, k, v`` hold heads ``head_start ..`` of an attention of
        ``total_heads`` heads (default: all of them), so that a call per head draws the
        dropout masks of one call over all heads.
      total_heads: the attention's number of heads (default: ``n_heads``).

    Returns:
      ``[batch, length, n_heads, d_head]`` in ``v.dtype``; equal to the full path
      (`revtrain.layers.attention.dense.einsum_attention` with ``is_causal=True``) up to float
      rounding, dropout included.

    Raises:
      ValueError: for a non-positive ``block_size``, shapes that are not
        ``[batch, length, n_heads, d_head]`` alike, dropout without an rng, or a call
        under a `revtrain.layers.sequence_parallel.sequence_sharded` split (each device
        holds part of the sequence: use `revtrain.layers.attention.ring`).
    """
    block_size = check_block_size(block_size, "blockwise_attention")
    check_inputs(q, k, v, "blockwise_attention")
    check_not_split("blockwise_attention", "use revtrain.layers.attention.ring (or "
                    "CausalAttention, which runs it)", why="attends to keys")
    rate, mask_bits, seed = dropout_seed(dropout_rate, rng, mask_bits, head_start,
                                         "blockwise_attention")
    length = q.shape[1]
    total = q.shape[2] if total_heads is None else int(total_heads)
    config = BlockConfig(length, min(block_size, length), rate, mask_bits, total)
    # Inside shard_map every operand must vary over the mesh axes any of them varies over,
    # so that the custom vjp's cotangents have their primals' types; autodiff turns the
    # cast of a replicated operand into a sum over the axis outside the kernel.
    q, k, v, seed = vary_alike(q, k, v, seed)
    return _attention(config, q, k, v, seed)


def _forward(config: BlockConfig, q: jax.Array, k: jax.Array, v: jax.Array,
             seed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns the output ``[batch, padded_length, heads, d]`` in ``v.dtype`` and the
    per-row log-sum-exp ``[batch, heads, padded_length]`` (float32, or float64 for float64 inputs).

    Everything stays in the inputs' ``[batch, length, heads, d]`` layout: a block is a
    slice of it, and outputs are written into place, so no whole-array transpose or
    stacked copy exists beside the inputs.
    """
    qp, kp, vp = (pad(x, config) for x in (q, k, v))
    batch, padded, heads, _ = qp.shape
    rows = (batch, heads, config.block)
    like = (qp, kp, vp, seed)
    acc_dtype = accumulation_dtype(qp)

    def query_block(i, outputs):
        out, lse = outputs
        q_blk = block(qp, i, config)
        init = (mesh_full(rows, -jnp.inf, *like, dtype=acc_dtype),
                mesh_full(rows, 0.0, *like, dtype=acc_dtype),
                mesh_full(q_blk.shape[:3] + (vp.shape[-1],), 0.0, *like, dtype=acc_dtype))
        m, total, acc = query_block_forward(config, q_blk, kp, vp, seed, i, init)
        out = put(out, acc / heads_last(total), i, config)
        return out, put(lse, m + jnp.log(total), i, config, axis=2)

    out = mesh_full((batch, padded, heads, vp.shape[-1]), 0.0, *like).astype(vp.dtype)
    lse = mesh_full((batch, heads, padded), 0.0, *like, dtype=acc_dtype)
    return lax.fori_loop(0, padded // config.block, query_block, (out, lse))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config: BlockConfig, q, k, v, seed):
    out, _ = _forward(config, q, k, v, seed)
    return out[:, :config.length]


def _attention_fwd(config: BlockConfig, q, k, v, seed):
    out, lse = _forward(config, q, k, v, seed)
    out = out[:, :config.length]
    return out, (q, k, v, out, lse, seed)


def _attention_bwd(config: BlockConfig, residuals, d_out):
    q, k, v, out, lse, seed = residuals
    qp, kp, vp, dop = (pad(x, config) for x in (q, k, v, d_out))
    delta = row_deltas(dop, pad(out, config))
    like = (qp, kp, vp, dop, lse, seed)
    zeros = [mesh_full(x.shape, 0.0, *like).astype(x.dtype) for x in (kp, vp)]
    dq = mesh_full(qp.shape, 0.0, *like, dtype=accumulation_dtype(qp))
    dq, dk, dv = backward_blocks(config, qp, kp, vp, dop, lse, delta, seed, (dq, *zeros))
    n = config.length
    return dq[:, :n].astype(q.dtype), dk[:, :n], dv[:, :n], None


_attention.defvjp(_attention_fwd, _attention_bwd)

__all__ = ["DEFAULT_BLOCK_SIZE", "accumulation_dtype", "blockwise_attention", "check_block_size",
           "mesh_full", "vary_alike"]
