"""The compiled per-layer programs of the block trainers: forward, fbo, reverse-and-fbo, loss.

An *fbo* (forward-backward-optimizer) program runs one layer's vjp, combines the weight
gradients across devices, applies the layer's optimizer update and returns the new weights,
new optimizer slots, the input cotangents and stats -- so the gradients of the whole model
are never held at once (Trax's ``ReversibleSerialTrainer`` idea). Every program here is
``jax.jit(jax.shard_map(...))`` over the mesh: per-device values (activations, cotangents,
layer state, rngs) have a leading device axis (over every mesh axis), weights and slots are
replicated (or, with ``fsdp``, sharded: `revtrain.parallel.collectives`).

Every program is called as ``program(args, weights_or_params, shared)``: ``args`` one of
the per-device argument types below (`ForwardArgs`, `FboArgs`, `ReverseArgs`, `LossArgs`),
the layer's weights (forward and norm-only programs) or its `Params` (donated: the update
reuses their buffers), and `Shared`, the replicated scalars.

Combining across devices (the data-parallel invariance; `revtrain.trainers.global_loss`):
the loss layer's cotangent on device ``d`` is its share ``W_d / sum W`` of the global batch
weights, every cotangent flowing back carries that share, and the weight gradient is the
*sum* over devices of the per-device gradients, never their mean. Weights enter each vjp as
explicitly per-device values (`revtrain.parallel.collectives.gather_weights`), so autodiff does
not sum them behind our back. Cotangents of integer stack items (token ids, labels) carry
no information; they are passed as a float32 placeholder and replaced by ``float0`` zeros.

The optimizer update, clipping and the stats' norms run outside ``shard_map`` on global
arrays, so every optax transformation gives the same update as with replicated weights.
Programs are shared between layers of one structure (`ProgramCache`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from revtrain.layers.base import Layer
from revtrain.parallel import collectives as fsdp
from revtrain.parallel.batches import device_weight_total
from revtrain.parallel.collectives import DEV, REP
from revtrain.parallel.placement import Placement
from revtrain.trainers.block.plan import Op, OpKind
from revtrain.trainers.global_loss import check_scalar_loss, global_loss, loss_share
from revtrain.trainers.protocols import Params
from revtrain.trainers.updates import apply_optimizer, clip_by_given_global_norm, squared_norm


class ForwardArgs(NamedTuple):
    """Per-device arguments of a forward program (leading device axis on every leaf).

    Attributes:
      x: the layer's input stack items.
      state: the layer's state.
      rngs: uint32 key data ``[devices, n_layers, *key]`` of the step
        (`revtrain.parallel.rngs.StepKeys`).
    """

    x: Any
    state: Any
    rngs: jax.Array


class FboArgs(NamedTuple):
    """A standard layer's fbo (recomputed from its stashed input ``x``): `ForwardArgs`
    plus ``ct_y``, the cotangent of the layer's outputs."""

    x: Any
    state: Any
    rngs: jax.Array
    ct_y: Any


class ReverseArgs(NamedTuple):
    """A reversible layer's reverse-and-fbo: its outputs ``y`` (from which the input is
    reconstructed), their cotangent ``ct_y``, the state before (``state``) and after
    (``new_state``) its forward pass, and the step's ``rngs``."""

    y: Any
    ct_y: Any
    state: Any
    new_state: Any
    rngs: jax.Array


class LossArgs(NamedTuple):
    """The loss layer's fbo: the final stack ``x``, ``state``, ``rngs`` and
    ``batch_weights``, the batch's third item (per-position loss weights) or None for a
    batch without weights (every device's share is then equal)."""

    x: Any
    state: Any
    rngs: jax.Array
    batch_weights: Any


class Shared(NamedTuple):
    """Replicated scalars of a program call.

    Attributes:
      index: int32, the flat layer index (selects the layer's key from ``rngs``).
      lr: float32 learning rate to inject, or None.
      clip: None, or float32 ``(global_norm, max_norm)``: the gradient is scaled as
        ``optax.clip_by_global_norm`` would scale the whole model's before the update.
    """

    index: jax.Array
    lr: jax.Array | None = None
    clip: tuple[jax.Array, jax.Array] | None = None


class LayerStats(NamedTuple):
    """Norms of one layer's update, float32 scalars (of global arrays)."""

    gradients_l2: jax.Array
    weights_l2: jax.Array


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


# Per-device bodies: ``(args, whole weights, index) -> (outputs, per-device ct_w)``.

def _forward(layer: Layer, args: ForwardArgs, weights, index) -> tuple:
    y, new_state = layer.pure_fn(_squeeze(args.x), weights, _squeeze(args.state),
                                 _layer_key(args.rngs, index))
    return _unsqueeze(y), _unsqueeze(new_state)


def _std_grads(layer: Layer, args: FboArgs, weights, index) -> tuple[tuple, Any]:
    """A standard layer's ``((ct_x,), ct_w)``, recomputed from its stashed input."""
    state, rng = _squeeze(args.state), _layer_key(args.rngs, index)
    fn = lambda x_, w_: layer.pure_fn(x_, w_, state, rng)
    y, vjp_fn, _ = jax.vjp(fn, _squeeze(args.x), weights, has_aux=True)
    ct_x, ct_w = vjp_fn(_ct_for_outputs(y, _squeeze(args.ct_y)))
    return (_unsqueeze(_placeholders(ct_x)),), ct_w


def _reverse_grads(layer: Layer, args: ReverseArgs, weights, index) -> tuple[tuple, Any]:
    """A reversible layer's ``((x, ct_x), ct_w)``, its input reconstructed."""
    y = _squeeze(args.y)
    x, (ct_x, ct_w) = layer.reverse_and_grad(
        y, _ct_for_outputs(y, _squeeze(args.ct_y)), weights, _squeeze(args.state),
        _squeeze(args.new_state), _layer_key(args.rngs, index))
    return (_unsqueeze(x), _unsqueeze(_placeholders(ct_x))), ct_w


def _loss_grads(layer: Layer, args: LossArgs, weights, index, *,
                axes: tuple[str, ...]) -> tuple[tuple, Any]:
    """The loss layer's ``((global loss, ct_x, new_state), ct_w)``, the loss combined over
    the mesh ``axes`` (`Placement.device_axes`)."""
    x, state = _squeeze(args.x), _squeeze(args.state)
    fn = lambda x_, w_: layer.pure_fn(x_, w_, state, _layer_key(args.rngs, index))
    loss, vjp_fn, new_state = jax.vjp(fn, x, weights, has_aux=True)
    check_scalar_loss(layer, loss)
    weights_item = None if args.batch_weights is None else _squeeze(args.batch_weights)
    share = loss_share(device_weight_total(weights_item, axes), axes)
    ct_x, ct_w = vjp_fn(share.astype(loss.dtype))
    return (global_loss(share, loss, axes), _unsqueeze(_placeholders(ct_x)),
            _unsqueeze(new_state)), ct_w


# Per kind: (body, out_specs of its outputs, where new params go among them, norm outputs).
_GRAD_KINDS = {OpKind.FBO: (_std_grads, (DEV,), 1, slice(0, 1)),
               OpKind.REVERSE: (_reverse_grads, (DEV, DEV), 2, slice(0, 2)),
               OpKind.LOSS: (_loss_grads, (REP, DEV, DEV), 2, slice(1, 2))}


def _update(optimizer, grads, params: Params, shared: Shared,
            placement: Placement) -> tuple[Params, LayerStats]:
    """The optimizer update on global arrays; the new values keep the stored layout."""
    clipped = clip_by_given_global_norm(grads, shared.clip)
    new_w, new_slots = apply_optimizer(optimizer, clipped, params.weights, params.slots,
                                       shared.lr)
    new_params = jax.lax.with_sharding_constraint(Params(new_w, new_slots),
                                                  placement.weight_shardings(params))
    return new_params, LayerStats(optax.tree.norm(grads), optax.tree.norm(new_w))


def make_program(kind: OpKind, layer: Layer, optimizer: optax.GradientTransformation,
                 placement: Placement, norm_only: bool = False) -> tuple[Callable, Callable]:
    """The jitted ``kind`` program of ``layer`` and its trace-counted body.

    Returns ``(program, counted)``; the program's outputs by kind:

    * ``FORWARD``: ``(y, new_state)``.
    * ``FBO``: ``(ct_x, new_params, stats)``; ``REVERSE``: ``(x, ct_x, new_params,
      stats)``; ``LOSS``: ``(loss, ct_x, new_params, new_state, stats)`` -- ``params``
      donated, ``stats`` a `LayerStats`, ``loss`` the weighted mean over the global batch.
    * ``norm_only`` (not for ``FORWARD``): the outputs that move the pass on (``(ct_x,)``,
      ``(x, ct_x)``, ``(ct_x,)``) and the float32 squared norm of the layer's global
      gradient; takes the weights (not donated) and updates nothing.
    """
    if kind == OpKind.FORWARD:
        run, counted = fsdp.gathering_shard_map(
            lambda a, w, i: _forward(layer, a, w, i), placement, (DEV, DEV), with_grads=False)
        return jax.jit(lambda args, weights, shared: run(args, weights, shared.index)), counted
    body, out_specs, place, norm_outs = _GRAD_KINDS[kind]
    if kind == OpKind.LOSS:
        body = functools.partial(body, axes=placement.device_axes)
    run, counted = fsdp.gathering_shard_map(lambda a, w, i: body(layer, a, w, i), placement,
                                            out_specs, with_grads=True)
    if norm_only:
        def norm(args, weights, shared):
            outs, grads = run(args, weights, shared.index)
            return (*outs[norm_outs], squared_norm(grads))
        return jax.jit(norm), counted

    def fbo(args, params, shared):
        outs, grads = run(args, params.weights, shared.index)
        new_params, stats = _update(optimizer, grads, params, shared, placement)
        return (*outs[:place], new_params, *outs[place:], stats)
    return jax.jit(fbo, donate_argnames=("params",)), counted


class ProgramCache:
    """Compiled per-layer programs, one per (kind, norm_only, layer structure).

    Two layers with equal, non-None `Layer.structure_key` compute the same function of
    their arguments, so they share one jitted program (and one executable per input
    shape). A layer whose key is None (its identity cannot be proven, e.g. a class defined
    inside a function, or an ``Fn`` of a lambda) gets programs of its own: a cache key
    must cover everything the cached function depends on, or the cache must not share.
    The optimizer and the placement are the trainer's, fixed for the cache's life (one
    cache per trainer, no module-level state); the cache keeps the layers it keyed by
    identity alive, so their ids are never reused.
    """

    def __init__(self, placement: Placement, optimizer: optax.GradientTransformation):
        self._placement = placement
        self._optimizer = optimizer
        self._programs: dict[Any, tuple[Callable, Callable, Layer]] = {}

    def get(self, op: Op, layer: Layer) -> Callable:
        """The program of ``op`` (its kind and ``norm_only``) for ``layer``, built once."""
        key = layer.structure_key
        key = (op.kind, op.norm_only, ("object", id(layer)) if key is None else key)
        if key not in self._programs:
            program, counted = make_program(op.kind, layer, self._optimizer, self._placement,
                                            norm_only=op.norm_only)
            self._programs[key] = (program, counted, layer)
        return self._programs[key][0]

    @property
    def n_built(self) -> int:
        """How many distinct programs were built."""
        return len(self._programs)

    def trace_counts(self) -> dict[str, int]:
        """``{'kind/layer_name#k': times traced}`` for every built program."""
        return {f"{'norm_' if norm else ''}{kind}/{layer.name}#{k}":
                eqx.debug.get_num_traces(counted)
                for k, ((kind, norm, _), (_, counted, layer)) in enumerate(self._programs.items())}


__all__ = ["FboArgs", "ForwardArgs", "LayerStats", "LossArgs", "ProgramCache", "ReverseArgs",
           "Shared", "make_program"]
