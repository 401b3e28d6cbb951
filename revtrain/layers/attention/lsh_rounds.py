"""All hashing rounds of one LSH head, combined by the softmax of their log-sum-exp.

Reformer hashes each head ``n_hashes`` times and combines the rounds' outputs weighted by
each round's normaliser (Kitaev et al., 2020, section 3, "Multi-round LSH attention").
`lsh_rounds` computes that combination online over the rounds (`lsh_round` is one round)
under a custom vjp that stores no per-round output: the backward pass recomputes one round
at a time, so one round's sorted arrays exist at a time.

References: Kitaev, Kaiser & Levskaya, 2020, "Reformer: The Efficient Transformer".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from revtrain.layers.attention.blockwise import accumulation_dtype, mesh_full
from revtrain.layers.attention.lsh_chunks import lsh_round
from revtrain.layers.dropout_masks import DEFAULT_MASK_BITS


class _Rounds(NamedTuple):
    """Static settings of `lsh_rounds` (hashable: a custom_vjp nondiff arg)."""
    chunk: int
    before: int
    rate: float
    mask_bits: int
    total_heads: int
    n_hashes: int


def lsh_rounds(qk: jax.Array, v: jax.Array, rotations: Sequence[jax.Array], *,
               chunk_len: int, n_chunks_before: int, dropout_rate: float = 0.0,
               seed: jax.Array | None = None, mask_bits: int = DEFAULT_MASK_BITS,
               head: Any = 0, total_heads: int = 1) -> jax.Array:
    """All hashing rounds of one head, combined by the softmax of their log-sum-exp.

    ``out = sum_r w_r out_r`` with ``w_r = exp(lse_r) / sum_r' exp(lse_r')``, computed
    online over the rounds (a running maximum, weight and weighted sum: equal rounds stay
    exact where the self penalty puts the log-sum-exp near -1e5). A custom vjp keeps only
    ``qk, v``, the output and two per-position statistics, and recomputes one round at a
    time in the backward pass (``d out_r = w_r d_out``, ``d lse_r = w_r (out_r - out) .
    d_out``), so one round's sorted arrays exist at a time and no per-round output is
    stored.

    Args:
      qk, v: ``[batch, length, d_key]`` and ``[batch, length, d_value]``, as `lsh_round`.
      rotations: one ``float32[n_hashes, d_key, n_f / 2]`` per bucket factor.
      chunk_len, n_chunks_before, dropout_rate, seed, mask_bits, head, total_heads: as
        `lsh_round` (round ``r`` draws its own dropout mask).

    Returns:
      ``[batch, length, d_value]`` in the accumulation dtype (at least float32).
    """
    static = _Rounds(chunk_len, n_chunks_before, float(dropout_rate), mask_bits,
                     total_heads, int(rotations[0].shape[0]))
    seed = jnp.zeros((2,), jnp.uint32) if seed is None else seed
    return _rounds(static, qk, v, tuple(rotations), jnp.asarray(head, jnp.int32), seed)


def _round(static: _Rounds, qk, v, rotations, head, seed, r):
    return lsh_round(qk, v, tuple(rotation[r] for rotation in rotations),
                     chunk_len=static.chunk, n_chunks_before=static.before,
                     dropout_rate=static.rate, seed=seed if static.rate else None,
                     mask_bits=static.mask_bits, head=head, total_heads=static.total_heads,
                     round_index=r, n_hashes=static.n_hashes)


def _rounds_forward(static: _Rounds, qk, v, rotations, head, seed):
    acc = accumulation_dtype(qk)

    def step(carry, r):
        top, weight, total = carry
        out, lse = _round(static, qk, v, rotations, head, seed, r)
        new_top = jnp.maximum(top, lse)
        old, this = jnp.exp(top - new_top), jnp.exp(lse - new_top)
        total = total * old[..., None] + out.astype(acc) * this[..., None]
        return (new_top, weight * old + this, total), None

    init = (mesh_full(qk.shape[:2], -jnp.inf, qk, dtype=acc),
            mesh_full(qk.shape[:2], 0.0, qk, dtype=acc),
            mesh_full(v.shape, 0.0, v, dtype=acc))
    (top, weight, total), _ = lax.scan(step, init, jnp.arange(static.n_hashes))
    return total / weight[..., None], top, weight


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rounds(static: _Rounds, qk, v, rotations, head, seed):
    return _rounds_forward(static, qk, v, rotations, head, seed)[0]


def _rounds_fwd(static: _Rounds, qk, v, rotations, head, seed):
    out, top, weight = _rounds_forward(static, qk, v, rotations, head, seed)
    return out, (qk, v, rotations, head, seed, out, top, weight)


def _rounds_bwd(static: _Rounds, residuals, d_out):
    qk, v, rotations, head, seed, out, top, weight = residuals
    d_out = d_out.astype(out.dtype)
    base = jnp.sum(out * d_out, axis=-1)

    def step(grads, r):
        (o, lse), vjp = jax.vjp(lambda a, b: _round(static, a, b, rotations, head, seed, r),
                                qk, v)
        w = jnp.exp(lse - top) / weight
        d_lse = w * (jnp.sum(o.astype(out.dtype) * d_out, axis=-1) - base)
        d_qk, d_v = vjp(((w[..., None] * d_out).astype(o.dtype), d_lse.astype(lse.dtype)))
        return (grads[0] + d_qk, grads[1] + d_v), None

    zeros = (jnp.zeros_like(qk), jnp.zeros_like(v))
    (d_qk, d_v), _ = lax.scan(step, zeros, jnp.arange(static.n_hashes))
    return d_qk, d_v, jax.tree.map(jnp.zeros_like, rotations), None, None


_rounds.defvjp(_rounds_fwd, _rounds_bwd)


__all__ = ["lsh_rounds"]
