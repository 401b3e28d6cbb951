"""The per-device bodies of a block step's programs, and indexing of stacked values.

The bodies (`forward`, `std_grads`, `reverse_grads`, `loss_grads`) run inside
``shard_map`` on one device's values (`revtrain.parallel.collectives.gathering_shard_map`);
a lone layer's program and a scanned run's call them (`revtrain.trainers.block.programs`,
`revtrain.trainers.block.scan_programs`), so one layer computes the same thing alone and
inside a scan. Each takes its op's typed arguments
(`revtrain.trainers.block.contract`) and returns its outputs typed, the fields that only
the update fills (``new_params``, ``stats``) None, and the per-device weight cotangent
beside them. `update` is the optimizer step on global arrays, after the bodies (the update
finisher's: `revtrain.trainers.block.finishers`). `at` and `put` read and write entry
``t`` of stacked values inside a scanned program.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from revtrain.layers.base import Layer
from revtrain.parallel.batches import device_weight_total
from revtrain.parallel.placement import Placement
from revtrain.trainers.block.contract import (
    FboArgs,
    FboOut,
    ForwardArgs,
    ForwardOut,
    LayerStats,
    LossArgs,
    LossOut,
    ReverseArgs,
    ReverseOut,
    Shared,
)
from revtrain.trainers.common.global_loss import check_scalar_loss, global_loss, loss_share
from revtrain.trainers.common.protocols import Params
from revtrain.trainers.common.updates import apply_optimizer, clip_by_given_global_norm


def at(tree: Any, t: jax.Array, axis: int = 0) -> Any:
    """Entry ``t`` along ``axis`` of every leaf of stacked ``tree`` (traced ``t``)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, t, axis, keepdims=False),
                        tree)


def put(tree: Any, new: Any, t: jax.Array) -> Any:
    """Stacked ``tree`` with entry ``t`` (leading axis) of every leaf replaced by ``new``'s."""
    return jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, t, 0),
                        tree, new)


def _squeeze(tree: Any) -> Any:
    return jax.tree.map(lambda a: a[0], tree)


def _unsqueeze(tree: Any) -> Any:
    return jax.tree.map(lambda a: a[None], tree)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.complexfloating)


def _ct_for_outputs(y: Any, ct: Any) -> Any:
    """Cotangents for vjp: the given ones for float outputs, float0 zeros for the rest."""
    if isinstance(y, tuple):
        return tuple(_ct_for_outputs(a, c) for a, c in zip(y, ct, strict=True))
    if _is_float(y):
        return ct.astype(y.dtype)
    return np.zeros(y.shape, dtype=jax.dtypes.float0)


def _placeholders(ct: Any) -> Any:
    """Replaces float0 cotangents by float32 scalars, so they can leave a shard_map."""
    if isinstance(ct, tuple):
        return tuple(_placeholders(c) for c in ct)
    if ct.dtype == jax.dtypes.float0:
        return jnp.zeros((), jnp.float32)
    return ct


def _layer_key(rngs: jax.Array, index: jax.Array) -> jax.Array:
    """This device's key of flat layer ``index`` from ``[1, n_layers, *key]`` key data."""
    return jax.random.wrap_key_data(rngs[0, index])


# Per-device bodies: ``(layer, args, whole weights, index) -> outputs`` (forward) or
# ``-> (outputs, per-device weight cotangent)``, on one device's block of every argument.

def forward(layer: Layer, args: ForwardArgs, weights: Any, index: jax.Array) -> ForwardOut:
    """One layer's forward pass on this device: `ForwardOut` ``(y, new_state)``."""
    y, new_state = layer.pure_fn(_squeeze(args.x), weights, _squeeze(args.state),
                                 _layer_key(args.rngs, index))
    return ForwardOut(_unsqueeze(y), _unsqueeze(new_state))


def std_grads(layer: Layer, args: FboArgs, weights: Any,
              index: jax.Array) -> tuple[FboOut, Any]:
    """A standard layer's input cotangent and weight gradient, recomputed from its stashed
    input."""
    state, rng = _squeeze(args.state), _layer_key(args.rngs, index)
    fn = lambda x_, w_: layer.pure_fn(x_, w_, state, rng)
    y, vjp_fn, _ = jax.vjp(fn, _squeeze(args.x), weights, has_aux=True)
    ct_x, ct_w = vjp_fn(_ct_for_outputs(y, _squeeze(args.ct_y)))
    return FboOut(_unsqueeze(_placeholders(ct_x)), None, None), ct_w


def reverse_grads(layer: Layer, args: ReverseArgs, weights: Any,
                  index: jax.Array) -> tuple[ReverseOut, Any]:
    """A reversible layer's reconstructed input, its cotangent and the weight gradient
    (`revtrain.layers.reversible.ReversibleLayer.reverse_and_grad`)."""
    y = _squeeze(args.y)
    x, (ct_x, ct_w) = layer.reverse_and_grad(
        y, _ct_for_outputs(y, _squeeze(args.ct_y)), weights, _squeeze(args.state),
        _squeeze(args.new_state), _layer_key(args.rngs, index))
    return ReverseOut(_unsqueeze(x), _unsqueeze(_placeholders(ct_x)), None, None), ct_w


def loss_grads(layer: Layer, args: LossArgs, weights: Any, index: jax.Array, *,
               axes: tuple[str, ...]) -> tuple[LossOut, Any]:
    """The loss layer's global loss, final-stack cotangent, new state and weight gradient,
    the loss combined over the mesh ``axes`` (`Placement.device_axes`): each device's
    cotangent is its share ``W_d / sum W`` of the global batch weights
    (`revtrain.trainers.common.global_loss`)."""
    x, state = _squeeze(args.x), _squeeze(args.state)
    fn = lambda x_, w_: layer.pure_fn(x_, w_, state, _layer_key(args.rngs, index))
    loss, vjp_fn, new_state = jax.vjp(fn, x, weights, has_aux=True)
    check_scalar_loss(layer, loss)
    weights_item = None if args.batch_weights is None else _squeeze(args.batch_weights)
    share = loss_share(device_weight_total(weights_item, axes), axes)
    ct_x, ct_w = vjp_fn(share.astype(loss.dtype))
    out = LossOut(global_loss(share, loss, axes), _unsqueeze(_placeholders(ct_x)), None,
                  _unsqueeze(new_state), None)
    return out, ct_w


def update(optimizer: optax.GradientTransformation, grads: Any, params: Params,
           shared: Shared, placement: Placement) -> tuple[Params, LayerStats]:
    """One layer's optimizer update on global arrays: ``(new params, stats)``.

    The gradient is clipped by the given global norm first (``shared.clip``), the learning
    rate injected (``shared.lr``); the new values keep the stored layout
    (`Placement.weight_shardings`). ``stats`` holds the norms of the gradient (before
    clipping) and of the new weights.
    """
    clipped = clip_by_given_global_norm(grads, shared.clip)
    new_w, new_slots = apply_optimizer(optimizer, clipped, params.weights, params.slots,
                                       shared.lr)
    new_params = jax.lax.with_sharding_constraint(Params(new_w, new_slots),
                                                  placement.weight_shardings(params))
    return new_params, LayerStats(optax.tree.norm(grads), optax.tree.norm(new_w))


__all__ = ["at", "forward", "loss_grads", "put", "reverse_grads", "std_grads", "update"]
