"""Ring attention: exact causal attention over a sequence split across a mesh axis.

Inside ``shard_map`` over ``axis_name`` (``n`` devices), each device holds its queries,
keys and values for ``L / n`` positions in the striped layout of
`revtrain.layers.sequence_parallel` (local row ``r`` of device ``s`` is position ``r * n +
s``). The forward pass makes ``n`` steps: at step ``k`` device ``s`` holds the keys and
values of device ``(s - k) % n`` and folds them into its queries' online softmax
(`revtrain.layers.attention.blockwise_kernel.query_block_forward`, per query block, the blockwise
kernel's code); each step also sends its key/value blocks one device along the ring
with ``lax.ppermute``, issued before the step's compute so that the transfer can overlap
it. The steps are one ``lax.fori_loop``, so the program holds one copy of a step whatever
``n``; the price is an ``n``-th move at the last step (bringing the blocks home), which
that step's compute hides. The
online-softmax statistics ``(m, total, acc)`` of the local queries are carried across
the steps, so the result is one softmax over all keys, not a merge of partial ones.

The backward pass is a ``jax.custom_vjp`` that runs the same ring: at each step device
``s`` adds its queries' terms with the visiting keys into its own ``dq`` and into the
visiting ``dk, dv`` accumulators (`revtrain.layers.attention.blockwise_kernel.backward_blocks`,
recomputing each block's probabilities from the saved log-sum-exp), and the
accumulators travel with their keys and values; after ``n`` moves they are home.

Residuals (what the forward pass keeps for the backward pass): the local ``q, k, v``, the
output and the float32 per-row log-sum-exp, as one-device blockwise attention keeps:
``O(batch x L / n x n_heads x d_head)`` per device. A reversible layer's reverse pass
re-runs the same ring to rebuild its input. Per device and step, the forward pass holds
the carried statistics (``float32[batch, L / n, heads, d_head]`` and two
``[batch, heads, L / n]``) and two key/value buffers (the one in use and the next); the
backward pass ``dq`` and two sets of keys, values and float32 ``dk, dv``.

Exactness: causal masks and attention-dropout masks are functions of global positions
(`revtrain.layers.dropout_masks.position_keep_mask` with ``stride = n``), so with the same
key on every device ring attention equals one-device blockwise attention up to float
rounding (the keys are summed in another order), dropout included. Load balance: every
device visits the same ``nb (nb + 1) / 2`` local block pairs at every step
(`revtrain.layers.sequence_parallel.ring_block_counts`).

References: Liu, Zaharia & Abbeel, 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"; Brandon et al., 2023, "Striped Attention: Faster Ring Attention
for Causal Transformers"; Dao, 2023, "FlashAttention-2" (the block loops).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from revtrain.layers.attention.blockwise import DEFAULT_BLOCK_SIZE, check_block_size
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


class _RingConfig(NamedTuple):
    """Static settings of one ring computation (hashable, a custom_vjp nondiff arg)."""
    kernel: BlockConfig   # stride = n_shards
    axis_name: str


def _axis_size(axis_name: object) -> int:
    """The size of mesh axis ``axis_name`` of the enclosing ``shard_map``."""
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(f"ring_attention(axis_name={axis_name!r}) runs inside shard_map over "
                         f"that mesh axis, but none is being traced; call it inside "
                         f"jax.shard_map(..., mesh=<a mesh with axis {axis_name!r}>)") from e


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: str,
                   block_size: int = DEFAULT_BLOCK_SIZE, dropout_rate: float = 0.0,
                   rng: jax.Array | None = None, mask_bits: int = DEFAULT_MASK_BITS,
                   head_start: int | jax.Array = 0, total_heads: int | None = None
                   ) -> jax.Array:
    """Causal attention over a length split (striped) over mesh axis ``axis_name``.

    Call it inside ``jax.shard_map``. With ``n = lax.axis_size(axis_name)`` devices,
    each passes its ``L / n`` rows in the striped layout (`revtrain.layers.
    sequence_parallel.sequence_layout`); the result is row for row what one-device
    `revtrain.layers.attention.blockwise` gives on the whole sequence, to float rounding.

    Args:
      q: this device's ``[batch, L / n, n_heads, d_head]`` queries (a float dtype;
        logits and sums in at least float32).
      k: this device's ``[batch, L / n, n_heads, d_head]`` keys.
      v: this device's ``[batch, L / n, n_heads, d_head]`` values.
      axis_name: the mesh axis the length is split over.
      block_size: local rows per block (``4 * batch * n_heads * block_size**2`` bytes of
        logits per block); need not divide ``L / n``.
      dropout_rate: drop rate of the attention probabilities, as `blockwise_attention`.
      rng: PRNG key of the dropout mask, as `blockwise_attention`; masks are keyed by
        global positions, so give every device of the ring the same ``rng`` to drop what
        one device would.
      mask_bits: random bits per mask element, as `blockwise_attention`.
      head_start: the first head ``q, k, v`` hold, as `blockwise_attention`.
      total_heads: the attention's number of heads, as `blockwise_attention`.

    Returns:
      ``[batch, L / n, n_heads, d_head]`` in ``v.dtype``: this device's rows.

    Raises:
      ValueError: outside a ``shard_map`` over ``axis_name``, for arguments
        `blockwise_attention` refuses (shapes, dtypes, block size, rates, dropout
        without an rng).
    """
    block_size = check_block_size(block_size, "ring_attention")
    check_inputs(q, k, v, "ring_attention")
    n_shards = _axis_size(axis_name)
    rate, mask_bits, seed = dropout_seed(dropout_rate, rng, mask_bits, head_start,
                                         "ring_attention")
    length = q.shape[1]
    total = q.shape[2] if total_heads is None else int(total_heads)
    kernel = BlockConfig(length, min(block_size, length), rate, mask_bits, total, n_shards)
    q, k, v, seed = vary_alike(q, k, v, seed)
    return _ring(_RingConfig(kernel, axis_name), q, k, v, seed)


def _ring_permute(x, config: _RingConfig):
    """``x`` (a pytree) moved one device along the ring: device ``s`` gets ``s - 1``'s."""
    n = config.kernel.stride
    return lax.ppermute(x, config.axis_name, [(d, (d + 1) % n) for d in range(n)])


def _ring_forward(config: _RingConfig, q, k, v, seed):
    """Returns the padded local output (``v.dtype``) and per-row log-sum-exp (float32)."""
    kc = config.kernel
    n = kc.stride
    qp, kp, vp = (pad(x, kc) for x in (q, k, v))
    batch, padded, heads, _ = qp.shape
    like = (qp, kp, vp, seed)
    acc_dtype = accumulation_dtype(qp)
    shard = lax.axis_index(config.axis_name)

    def accumulate(step, stats, kv):
        source = (shard - step) % n

        def query_block(i, stats):
            m, total, acc = stats
            carry = (block(m, i, kc, axis=2), block(total, i, kc, axis=2), block(acc, i, kc))
            carry = query_block_forward(kc, block(qp, i, kc), *kv, seed, i, carry, shard,
                                        source)
            return (put(m, carry[0], i, kc, axis=2), put(total, carry[1], i, kc, axis=2),
                    put(acc, carry[2], i, kc))

        return lax.fori_loop(0, padded // kc.block, query_block, stats)

    def step(index, carry):
        stats, kv = carry
        incoming = _ring_permute(kv, config)
        return accumulate(index, stats, kv), incoming

    stats = (mesh_full((batch, heads, padded), -jnp.inf, *like, dtype=acc_dtype),
             mesh_full((batch, heads, padded), 0.0, *like, dtype=acc_dtype),
             mesh_full((batch, padded, heads, vp.shape[-1]), 0.0, *like, dtype=acc_dtype))
    (m, total, acc), _ = lax.fori_loop(0, n, step, (stats, (kp, vp)))
    # Every row, padded or not, saw key 0 of its own shard (position s <= its own) at
    # step 0, so total > 0.
    return (acc / heads_last(total)).astype(vp.dtype), m + jnp.log(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(config: _RingConfig, q, k, v, seed):
    out, _ = _ring_forward(config, q, k, v, seed)
    return out[:, :config.kernel.length]


def _ring_fwd(config: _RingConfig, q, k, v, seed):
    out, lse = _ring_forward(config, q, k, v, seed)
    out = out[:, :config.kernel.length]
    return out, (q, k, v, out, lse, seed)


def _ring_bwd(config: _RingConfig, residuals, d_out):
    q, k, v, out, lse, seed = residuals
    kc = config.kernel
    n = kc.stride
    qp, kp, vp, dop = (pad(x, kc) for x in (q, k, v, d_out))
    delta = row_deltas(dop, pad(out, kc))
    like = (qp, kp, vp, dop, lse, seed)
    acc_dtype = accumulation_dtype(qp)
    shard = lax.axis_index(config.axis_name)

    def accumulate(step, dq, kv, dkv):
        dq, dk, dv = backward_blocks(kc, qp, *kv, dop, lse, delta, seed, (dq, *dkv), shard,
                                     (shard - step) % n)
        return dq, (dk, dv)

    def step(index, carry):
        dq, kv, dkv = carry
        incoming = _ring_permute(kv, config)
        dq, dkv = accumulate(index, dq, kv, dkv)
        return dq, incoming, _ring_permute(dkv, config)

    zeros = tuple(mesh_full(x.shape, 0.0, *like, dtype=acc_dtype) for x in (kp, vp))
    dq = mesh_full(qp.shape, 0.0, *like, dtype=acc_dtype)
    # After n moves the dk, dv accumulators are home, each holding every shard's terms.
    dq, _, (dk, dv) = lax.fori_loop(0, n, step, (dq, (kp, vp), zeros))
    length = kc.length
    return (dq[:, :length].astype(q.dtype), dk[:, :length].astype(k.dtype),
            dv[:, :length].astype(v.dtype), None)


_ring.defvjp(_ring_fwd, _ring_bwd)

__all__ = ["ring_attention"]
