"""A half-residual's reverse over chunks of positions: only attention's core sees the length.

`ReversibleHalfResidual.reverse_and_grad` recomputes ``F``, takes its vjp and subtracts.
Run whole, that holds several ``[batch, length, d_model]`` temporaries beside the
residual streams: ``F``'s LayerNorm output and its cotangent, the attention's head sum
and its input cotangent, the feed-forward's output. Where ``F`` is position-wise (each
position's output a function of that position's input alone) none of this needs the
whole length, and where ``F`` is position-wise stages around an attention core
(`revtrain.layers.attention.headwise`) only the core does. `chunked_reverse_and_grad`
runs the reverse so, with ``chunk`` positions at a time:

* no attention (a feed-forward block): per chunk, recompute ``F``, take its vjp, subtract
  from the accumulator and add the input cotangent, in place;
* with attention, per head: project the chunks (the compute part, e.g. LayerNorm, then
  the head's input projections) into one head's full-length ``q, k, v``; run the core and
  its vjp over the whole length; per chunk subtract the head's output projection from
  the accumulator and form the core's output cotangent; per chunk take the vjp of the
  compute part and the projections and add it to the input cotangent. The output bias is
  subtracted once at the end.

Where: ``f`` has one ``[batch, length, ...]`` input; the compute part's layers are
``position_wise`` (`revtrain.layers.Layer`) or one-input `revtrain.layers.Chunk` layers,
without state; the attention layer is absent or has ``headwise`` stages
(`revtrain.layers.CausalAttention`, `revtrain.layers.LSHCausalAttention`) that compute in
the accumulator's dtype. Elsewhere (a bfloat16 compute part, whose heads' outputs would be
rounded otherwise than their sum; decoding caches) the reverse runs whole.

Memory beside the four residual items (the two streams and their cotangents) is one
head's ``q, k, v``, output and their cotangents (what the core keeps for its vjp
included) and ``[batch, chunk, ...]`` temporaries: Blockwise Parallel Transformer's fusion
of the position-wise work (Liu & Abbeel, 2023) applied to the reverse pass.

Exactness: every chunk computes what the whole pass computes for its positions -- a
`revtrain.layers.Chunk` in ``F`` is run chunk by chunk with its own chunk size and key
(``fold_in(rng, index)``, the last chunk padded as it is there), so dropout inside it
draws the same masks -- and the weight gradients are sums of the same terms. The
reconstructed accumulator subtracts the heads' outputs one at a time rather than their
sum, so it equals the whole pass's to float rounding (as reconstruction itself does).

References: Liu & Abbeel, 2023, "Blockwise Parallel Transformer for Large Context
Models"; Kitaev et al., 2020, "Reformer" (chunked feed-forward, reversible blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from revtrain.layers.attention.headwise import Headwise, head_output, split_heads
from revtrain.layers.chunk import Chunk, check_chunk_size
from revtrain.layers.combinators import split_rng
from revtrain.layers.layer import Layer


def _take(a: jax.Array, start: Any, n: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(a, start, n, axis=1)


def _put(a: jax.Array, value: jax.Array, start: Any) -> jax.Array:
    return lax.dynamic_update_slice_in_dim(a, value.astype(a.dtype), start, axis=1)


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def over_chunks(length: int, size: int, body: Callable, carry: Any) -> Any:
    """``carry = body(carry, index, start, n)`` for the chunks ``[start, start + n)`` of
    ``[0, length)``: a ``lax.fori_loop`` over the ``length // size`` whole chunks (``n =
    size``, traced ``index`` and ``start``), then one call for the rest (``n = length %
    size``, static), so the program holds at most two copies of ``body``."""
    n_full, rest = divmod(length, size)
    if n_full:
        carry = lax.fori_loop(0, n_full, lambda i, c: body(c, i, i * size, size), carry)
    if rest:
        carry = body(carry, n_full, n_full * size, rest)
    return carry


def compute_stage(layers: Sequence[Layer], state: Any, keys: Sequence[jax.Array | None],
                  length: int) -> Callable:
    """``run(x_chunk, weights, index) -> y_chunk``: ``layers`` (position-wise, or
    `revtrain.layers.Chunk`) on chunk ``index`` of a ``length``-position input, as the
    whole ``Serial(*layers)`` computes those positions (``keys``: the Serial's per-layer
    keys; ``state``: their states)."""
    def run(x, layer_weights, index):
        for layer, w, s, key in zip(layers, layer_weights, state, keys, strict=True):
            if isinstance(layer, Chunk):
                x = layer.run_chunk(x, w, s, key, index, length)
            else:
                x = layer.pure_fn(x, w, s, key)[0]
        return x
    return run


def chunked_reverse_and_grad(stage: Callable, headwise: Headwise | None, size: int,
                             acc: jax.Array, x: jax.Array, ct_acc: jax.Array,
                             ct_x: jax.Array, compute_weights: Any, attention_weights: Any
                             ) -> tuple[jax.Array, jax.Array, Any, Any]:
    """The reverse of ``acc_out = acc + F(x)`` over chunks of ``size`` positions (module
    docstring).

    Args:
      stage: the compute part per chunk (`compute_stage`).
      headwise: the attention's stages after it, or None (``F`` is the compute part).
      size: positions per chunk (need not divide the length).
      acc: ``[batch, length, ...]`` the accumulator's output ``acc + F(x)``.
      x: ``[batch, length, ...]`` ``F``'s input.
      ct_acc, ct_x: the cotangents of ``acc`` and ``x``'s outputs.
      compute_weights, attention_weights: the compute part's and the attention's weights.

    Returns:
      ``(acc_in, x_ct, compute_weights_ct, attention_weights_ct)``: the reconstructed
      accumulator, ``ct_x`` plus ``F``'s input cotangent, and the weight cotangents
      (``attention_weights_ct`` is ``attention_weights``' structure; ``()`` without
      attention).
    """
    length = x.shape[1]
    zeros = jax.tree.map(jnp.zeros_like, compute_weights)
    if headwise is None:
        def body(carry, index, start, n):
            acc, dx, dw = carry
            r, vjp = jax.vjp(lambda x_, w_: stage(x_, w_, index).astype(acc.dtype),
                             _take(x, start, n), compute_weights)
            dx_c, dw_c = vjp(_take(ct_acc, start, n))
            return (_put(acc, _take(acc, start, n) - r, start),
                    _put(dx, _take(dx, start, n) + dx_c, start), _add(dw, dw_c))

        acc, dx, dw = over_chunks(length, size, body, (acc, ct_x, zeros))
        return acc, dx, dw, attention_weights
    return _headwise_reverse(stage, headwise, size, acc, x, ct_acc, ct_x, compute_weights,
                             attention_weights, zeros)


def _headwise_reverse(stage, hw: Headwise, size, acc, x, ct_acc, ct_x, compute_weights,
                      attention_weights, zeros):
    length = x.shape[1]
    split, split_vjp = jax.vjp(lambda w: split_heads(w, hw), attention_weights)
    (pairs, w_out), b_out = split

    def project(x_c, w_c, pairs_h, h, index, start, n):
        positions = lax.dynamic_slice_in_dim(hw.positions, start, n)
        return hw.project(stage(x_c, w_c, index), pairs_h, h, positions)

    def head(carry, xs):
        acc, dx, dw = carry
        pairs_h, w_out_h, h = xs

        def project_body(buffers, index, start, n):
            out = project(_take(x, start, n), compute_weights, pairs_h, h, index, start, n)
            return tuple(_put(b, o, start) for b, o in zip(buffers, out, strict=True))

        shapes = jax.eval_shape(lambda x_c: project(x_c, compute_weights, pairs_h, h, 0, 0,
                                                    x_c.shape[1]), _take(x, 0, min(size, length)))
        buffers = tuple(jnp.zeros_like(x, shape=x.shape[:2] + s.shape[2:], dtype=s.dtype)
                        for s in shapes)
        projected = over_chunks(length, size, project_body, buffers)
        attended, core_vjp = jax.vjp(lambda *p: hw.core(p, h), *projected)
        del projected

        def output_body(carry, index, start, n):
            acc, d_attended, dw_out = carry
            y, vjp = jax.vjp(lambda o_, w_: head_output(o_, w_).astype(acc.dtype),
                             _take(attended, start, n), w_out_h)
            do_c, dw_c = vjp(_take(ct_acc, start, n))
            return (_put(acc, _take(acc, start, n) - y, start),
                    _put(d_attended, do_c, start), dw_out + dw_c)

        acc, d_attended, dw_out = over_chunks(
            length, size, output_body, (acc, jnp.zeros_like(attended), jnp.zeros_like(w_out_h)))
        d_projected = core_vjp(d_attended)

        def input_body(carry, index, start, n):
            dx, dw, d_pairs = carry
            _, vjp = jax.vjp(lambda x_, w_, p_: project(x_, w_, p_, h, index, start, n),
                             _take(x, start, n), compute_weights, pairs_h)
            dx_c, dw_c, dp_c = vjp(tuple(_take(d, start, n) for d in d_projected))
            return (_put(dx, _take(dx, start, n) + dx_c, start), _add(dw, dw_c),
                    _add(d_pairs, dp_c))

        dx, dw, d_pairs = over_chunks(length, size, input_body,
                                      (dx, dw, jax.tree.map(jnp.zeros_like, pairs_h)))
        return (acc, dx, dw), (d_pairs, dw_out)

    (acc, dx, dw), (d_pairs, d_w_out) = lax.scan(
        head, (acc, ct_x, zeros), (pairs, w_out, jnp.arange(hw.n_heads)))
    bias = b_out.astype(acc.dtype)  # Subtracted in place, chunk by chunk, like the heads.
    acc = over_chunks(length, size, lambda a, index, start, n: _put(a, _take(a, start, n) - bias,
                                                                    start), acc)
    d_b_out = jnp.sum(ct_acc.astype(b_out.dtype), axis=tuple(range(ct_acc.ndim - 1)))
    (attention_ct,) = split_vjp(((d_pairs, d_w_out), d_b_out))
    return acc, dx, dw, attention_ct


def chunked_half_residual_reverse(sublayers: tuple[Layer, Layer],
                                  chunking: tuple[int | None, bool], acc: jax.Array,
                                  ctx_items: tuple, ct: tuple, weights: Any, run_state: Any,
                                  rng: jax.Array | None) -> tuple | None:
    """`revtrain.layers.ReversibleHalfResidual.reverse_and_grad` over position chunks, or
    None where its ``f`` does not allow it (module docstring): ``sublayers`` are its
    ``(compute, attention)``, ``chunking`` its ``(chunk_size or None, has attention)``,
    ``ct`` its output cotangents, the other arguments its reverse pass's."""
    chunk_size, has_attention = chunking
    if chunk_size is None or len(ctx_items) != 1:
        return None
    (x,), (ct_acc, ct_x) = ctx_items, ct
    compute, attention = sublayers
    if (x.ndim < 2 or acc.shape[:2] != x.shape[:2] or x.shape[1] == 0
            or not all(jnp.issubdtype(a.dtype, jnp.floating) for a in (acc, x))
            or jax.tree.leaves(run_state[0])):
        return None
    length = x.shape[1]
    size = min(chunk_size, length)
    key_compute, key_attention = split_rng(rng, 2)
    stage = compute_stage(compute.sublayers, run_state[0],
                          split_rng(key_compute, len(compute.sublayers)), length)
    headwise = None
    if has_attention:
        out = jax.eval_shape(lambda x_c: stage(x_c, weights[0], 0), x[:, :size])
        headwise_of = getattr(attention, "headwise", None)
        if out.dtype != acc.dtype or headwise_of is None or jax.tree.leaves(run_state[1]):
            return None
        headwise = headwise_of(x.shape[:2] + out.shape[2:], out.dtype, key_attention)
        if headwise is None:
            return None
    acc_in, x_ct, compute_ct, attention_ct = chunked_reverse_and_grad(
        stage, headwise, size, acc, x, ct_acc, ct_x, weights[0], weights[1])
    return (acc_in, x), ((ct_acc, x_ct), (compute_ct, attention_ct))


def reverse_chunk_size(compute: Layer, chunk_size: Any) -> int | None:
    """A half-residual's reverse chunk size from its ``chunk_size`` argument and the
    `revtrain.layers.Chunk` layers of its compute part (``compute.sublayers``): None where
    a compute layer is neither ``position_wise`` nor a one-input `Chunk`.

    Raises:
      ValueError: for a ``chunk_size`` that is not a positive int or None, or one that
        differs from a `Chunk`'s.
    """
    if chunk_size is not None:
        check_chunk_size(chunk_size, "ReversibleHalfResidual")
    sizes = {layer.chunk_size for layer in compute.sublayers if isinstance(layer, Chunk)}
    if chunk_size is not None and sizes - {chunk_size}:
        raise ValueError(f"ReversibleHalfResidual chunk_size={chunk_size} differs from the "
                         f"chunk size {sorted(sizes)} of a Chunk in its layers; use one size "
                         f"(the LMs take both from ff_chunk_size)")
    if chunk_size is None and len(sizes) == 1:
        chunk_size = sizes.pop()
    if chunk_size is None or not all(
            layer.position_wise or (isinstance(layer, Chunk) and layer.n_in == 1)
            for layer in compute.sublayers):
        return None
    return chunk_size


__all__ = ["chunked_half_residual_reverse", "chunked_reverse_and_grad", "compute_stage",
           "over_chunks", "reverse_chunk_size"]
