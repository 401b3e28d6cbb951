"""Attention as per-head stages: position-wise projections around a full-length core.

Both attention layers compute ``y = sum_h out_h(core_h(project_h(x))) + b_out``:

* ``project_h`` -- head ``h``'s input projections (queries, keys, values; rotary angles
  where set), position by position: a chunk of positions can be projected alone;
* ``core_h`` -- the attention itself over the whole length (blockwise, ring, full or LSH);
* ``out_h`` -- head ``h``'s rows of the output projection, position by position.

`Headwise` holds these stages for one call (the layer's rng, rate and implementation
already chosen), `split_heads` turns the layer's weights into per-head stacks, and
`run_by_head` is the layers' one-head-at-a-time forward pass. The reverse pass of a
reversible half-residual (`revtrain.layers.position_chunks`) runs the same stages with
the position-wise ones over chunks of positions, so that only the core sees the whole
length.

References: Liu & Abbeel, 2023, "Blockwise Parallel Transformer for Large Context
Models" (position-wise work fused per block of positions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from revtrain.layers.attention.dense import by_head


class Headwise(NamedTuple):
    """One attention call as per-head stages (module docstring).

    Attributes:
      n_heads: heads, run one at a time.
      n_projections: input projections per head (3: query, key, value; 2 for LSH's
        shared query/key and value); the layer's weights are these pairs, then the
        output pair.
      dtype: the dtype the stages compute in (the attention's input dtype).
      project: ``(x: [batch, n, d_feature], pairs_h, h, positions: int[n]) -> tuple of
        [batch, n, width]`` -- head ``h``'s projections of ``n`` positions (``pairs_h``:
        ``n_projections`` ``(w: [d_feature, width], b: [width])`` pairs).
      core: ``(projected: that tuple over the whole length, h) -> [batch, length,
        d_value]`` -- head ``h``'s attention; traceable with ``h`` a traced int.
      positions: int ``[length]``: each row's position (global under a sequence split).
      policy: the ``jax.checkpoint`` policy of a head in `run_by_head` (None: save
        nothing).
    """
    n_heads: int
    n_projections: int
    dtype: Any
    project: Callable[..., tuple]
    core: Callable[[tuple, Any], jax.Array]
    positions: jax.Array
    policy: Any = None


def split_heads(weights: Any, headwise: Headwise) -> tuple[tuple, jax.Array]:
    """The layer's weights as per-head stacks: ``((pairs, w_out), b_out)``.

    ``pairs`` is the ``n_projections`` input pairs, each ``([heads, d_feature, width],
    [heads, width])``; ``w_out`` is ``[heads, d_value, d_feature]`` and ``b_out``
    ``[d_feature]``; all in ``headwise.dtype``. Differentiable: its vjp maps per-head
    cotangents back to the layer's weights.
    """
    n = headwise.n_projections
    pairs = tuple(by_head(pair, headwise.n_heads, headwise.dtype) for pair in weights[:n])
    w_out, b_out = weights[n]
    d_feature = w_out.shape[1]
    w_out = w_out.astype(headwise.dtype).reshape(headwise.n_heads, -1, d_feature)
    return (pairs, w_out), b_out.astype(headwise.dtype)


def head_output(attended: jax.Array, w_out: jax.Array) -> jax.Array:
    """One head's share of the output: ``attended [batch, n, d_value] @ w_out[h]``."""
    return jnp.dot(attended.astype(w_out.dtype), w_out)


def run_by_head(headwise: Headwise, x: jax.Array, weights: Any) -> jax.Array:
    """``sum_h out_h(core_h(project_h(x))) + b_out``: a ``lax.scan`` over the heads, each
    under ``jax.checkpoint`` (``headwise.policy``), so one head's projections, core
    output and cotangents exist at a time beside ``x``, the sum and their cotangents.

    Args:
      headwise: the stages.
      x: ``[batch, length, d_feature]`` in ``headwise.dtype``.
      weights: the layer's weights.

    Returns:
      ``[batch, length, d_feature]`` in ``x.dtype``.
    """
    (pairs, w_out), b_out = split_heads(weights, headwise)

    def head_fn(x, pairs_h, w_out_h, h):
        projected = headwise.project(x, pairs_h, h, headwise.positions)
        return head_output(headwise.core(projected, h), w_out_h)

    head = jax.checkpoint(head_fn, policy=headwise.policy)

    def add_head(total, xs):
        return total + head(x, *xs), None

    total = jnp.zeros_like(x)
    total, _ = lax.scan(add_head, total, (pairs, w_out, jnp.arange(headwise.n_heads)))
    return total + b_out


__all__ = ["Headwise", "head_output", "run_by_head", "split_heads"]
