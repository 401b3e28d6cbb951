"""Per-layer compiled functions of the block trainers: forward, fbo, reverse-and-fbo, loss.

An *fbo* (forward-backward-optimizer) function runs one layer's vjp, combines the weight
gradients across devices, applies the layer's optimizer update and returns the new weights,
new optimizer slots, the input cotangents and stats -- so the gradients of the whole model
are never held at once (Trax's ``ReversibleSerialTrainer`` idea). Every function here is
``jax.jit(jax.shard_map(...))`` over the ``batch`` mesh axis: per-device values (activations,
cotangents, layer state, rngs) have a leading device axis, weights and slots are replicated
(or, with ``fsdp``, sharded: see below).

Combining across devices (the data-parallel invariance; see `loss_share`): the loss of a
step is the weighted mean over the *global* batch, ``sum_d W_d * L_d / sum_d W_d``, where
``L_d`` is device ``d``'s weighted-mean loss and ``W_d`` the total of its batch weights.
So the loss layer's cotangent on device ``d`` is its share ``W_d / sum W`` (not 1), every
cotangent flowing back carries that share, and the weight gradient is the *sum* over
devices of the per-device gradients (``psum``), never their mean. Weights enter each vjp
as explicitly per-device values (`revtrain.trainers.fsdp.gather_weights`: a cast to
varying, or the FSDP all-gather), so autodiff does not sum them behind our
back: inside ``shard_map`` the cotangent of a replicated input is already summed over the
mesh axis, and a ``pmean`` after it would multiply the gradient by the device count.

Cotangents of integer stack items (token ids, labels) carry no information; they are passed
as a float32 placeholder of shape ``[n_devices]`` and replaced by ``float0`` zeros inside.

FSDP (``fsdp=True``): weights arrive in their stored shards, are gathered inside
``shard_map`` and their gradients reduce-scattered (`revtrain.trainers.fsdp`); the
optimizer update, clipping and the stats' norms run outside ``shard_map`` on global
arrays, so every optax transformation (elementwise or not) gives the same update as with
replicated weights.

Arguments are grouped (`revtrain.trainers.protocols`): ``dev`` (per-device values), the
layer's weights or donated `Params`, and ``rep`` (replicated values); the step's keys of
all layers travel as one ``[n_devices, n_layers, *key]`` array and each function picks its
layer's row by index. `FnCache` compiles each kind of function once per *layer structure*
(`Layer.structure_key`), so identical layers of a deep model share one executable and
nothing recompiles after the first step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from revtrain.layers.base import Layer
from revtrain.trainers import fsdp as fsdp_layout
from revtrain.trainers.devices import BATCH_AXIS, value_shardings
from revtrain.trainers.protocols import (
    FboFn,
    ForwardFn,
    LossFboFn,
    NormFn,
    Params,
    ReverseFboFn,
)

DEV, REP = fsdp_layout.DEV, fsdp_layout.REP


_INJECTED_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _is_injected(node: Any) -> bool:
    """An ``optax.inject_hyperparams`` state (optax has a stateless and a stateful one)."""
    return isinstance(node, _INJECTED_STATES)


def _settable(state: Any) -> bool:
    """A numeric ``learning_rate`` hyperparameter (not a schedule, which keeps a state)."""
    return "learning_rate" in state.hyperparams and (
        "learning_rate" not in getattr(state, "hyperparams_states", {}))


def _injected_states(slots: Any) -> list[Any]:
    return [node for node in jax.tree.leaves(slots, is_leaf=_is_injected)
            if _is_injected(node)]


def has_injectable_learning_rate(slots: Any) -> bool:
    """True when ``slots`` hold an ``optax.inject_hyperparams`` numeric ``learning_rate``.

    A learning rate given to ``inject_hyperparams`` as a schedule is not injectable: the
    schedule sets it at every update (its state lives in ``hyperparams_states``).
    """
    return any(_settable(state) for state in _injected_states(slots))


def learning_rate_of(slots: Any) -> float | None:
    """The current ``learning_rate`` held in optimizer slots, or None when there is none."""
    for state in _injected_states(slots):
        if "learning_rate" in state.hyperparams:
            rate = state.hyperparams["learning_rate"]
            if isinstance(rate, jax.Array):  # Replicated; maybe over several processes.
                rate = rate.addressable_shards[0].data
            return float(np.asarray(rate))
    return None


def apply_optimizer(optimizer: optax.GradientTransformation, grads: Any, weights: Any,
                    slots: Any, learning_rate: jax.Array | None) -> tuple[Any, Any]:
    """One optimizer update; sets the injectable learning rate first when one is given."""
    if learning_rate is not None:
        def with_rate(node):
            if not (_is_injected(node) and _settable(node)):
                return node
            old = node.hyperparams["learning_rate"]
            rate = jnp.asarray(learning_rate, dtype=jnp.asarray(old).dtype)
            return node._replace(hyperparams={**node.hyperparams, "learning_rate": rate})
        slots = jax.tree.map(with_rate, slots, is_leaf=_is_injected)
    updates, new_slots = optimizer.update(grads, slots, weights)
    return optax.apply_updates(weights, updates), new_slots


def check_scalar_loss(layer: Layer, loss: Any) -> None:
    """Raises ValueError unless ``loss`` is a scalar (checked while tracing)."""
    if not isinstance(loss, jax.Array) or loss.shape != ():
        shape = getattr(loss, "shape", type(loss).__name__)
        raise ValueError(f"the loss layer {layer.name} returned {shape}, not a scalar; end "
                         f"the model with a loss that averages over the batch (e.g. "
                         f"CrossEntropyLoss)")


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


def _layer_stats(grads: Any, new_weights: Any) -> dict[str, jax.Array]:
    return {"gradients_l2": optax.tree.norm(grads),
            "weights_l2": optax.tree.norm(new_weights)}


def loss_share(weight_total: jax.Array) -> jax.Array:
    """This device's share ``W_d / sum_d W_d`` of the global loss (0 when ``sum W`` is 0).

    Args:
      weight_total: float32 scalar, the total of this device's batch weights (from
        `revtrain.trainers.devices.weight_totals_by_device`).

    Returns:
      float32 scalar; ``share * L_d`` summed over devices is the loss over the global batch.
    """
    total = jax.lax.psum(weight_total, BATCH_AXIS)
    safe = jnp.where(total > 0, total, 1.0)
    return jnp.where(total > 0, weight_total / safe, 0.0).astype(jnp.float32)


def global_loss(share: jax.Array, loss: jax.Array) -> jax.Array:
    """``sum_d share_d * L_d``: the weighted-mean loss over the global batch."""
    return jax.lax.psum(share * loss.astype(jnp.float32), BATCH_AXIS)


def clip_by_given_global_norm(grads: Any, clip: tuple[jax.Array, jax.Array] | None) -> Any:
    """``optax.clip_by_global_norm``'s formula with the global norm given, not computed.

    A block trainer knows the norm of the *whole* model's gradient only from a first pass
    (`squared_norm` of every layer), so each layer's fbo gets it as an argument.

    Args:
      grads: one layer's gradient tree.
      clip: ``(global_norm, max_norm)`` float32 scalars, or None (no clipping).

    Returns:
      ``grads`` when ``global_norm < max_norm``, else ``grads / global_norm * max_norm``
      (leaf by leaf, as optax does).
    """
    if clip is None:
        return grads
    g_norm, max_norm = clip
    trigger = jnp.squeeze(g_norm < max_norm)
    return jax.tree.map(
        lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype))
                                 * max_norm.astype(t.dtype)), grads)


def squared_norm(grads: Any) -> jax.Array:
    """Squared L2 norm (float32) of one layer's global gradient (global arrays, outside
    ``shard_map``: for sharded leaves the partitioner sums the shards' squares once)."""
    return optax.tree.norm(grads, squared=True).astype(jnp.float32)


def _update(optimizer, grads, params: Params, rep, mesh: Mesh,
            fsdp: bool) -> tuple[Params, dict[str, jax.Array]]:
    """The optimizer update on global arrays; the new values keep the stored layout."""
    clipped = clip_by_given_global_norm(grads, rep.get("clip"))
    new_w, new_slots = apply_optimizer(optimizer, clipped, params.weights, params.slots,
                                       rep["lr"])
    new_params = jax.lax.with_sharding_constraint(
        Params(new_w, new_slots), value_shardings(params, mesh, fsdp))
    return new_params, _layer_stats(grads, new_w)


def _compile_fbo(body: Callable, mesh: Mesh, out_specs: tuple, fsdp: bool,
                 optimizer: optax.GradientTransformation, norm_only: bool,
                 place: int, norm_outs: slice) -> tuple[Callable, Callable]:
    """Jits ``body``'s gradients into an fbo: ``(*outs[:place], new_params,
    *outs[place:], stats)`` with ``params`` donated, or a `NormFn` ``(*outs[norm_outs],
    squared_norm)`` when ``norm_only``."""
    run, counted = fsdp_layout.gathering_shard_map(body, mesh, out_specs, fsdp, with_grads=True)
    if norm_only:
        def norm(dev, weights, rep):
            outs, grads = run(dev, weights, rep)
            return (*outs[norm_outs], squared_norm(grads))
        return jax.jit(norm), counted

    def fbo(dev, params, rep):
        outs, grads = run(dev, params.weights, rep)
        new_params, stats = _update(optimizer, grads, params, rep, mesh, fsdp)
        return (*outs[:place], new_params, *outs[place:], stats)
    return jax.jit(fbo, donate_argnames=("params",)), counted


def make_forward(layer: Layer, mesh: Mesh, fsdp: bool = False) -> tuple[ForwardFn, Callable]:
    """A `ForwardFn` for ``layer`` (and its trace-counted body)."""
    def body(dev, weights, rep):
        rng = _layer_key(dev["rngs"], rep["index"])
        y, new_state = layer.pure_fn(_squeeze(dev["x"]), weights, _squeeze(dev["state"]), rng)
        return _unsqueeze(y), _unsqueeze(new_state)
    run, counted = fsdp_layout.gathering_shard_map(body, mesh, (DEV, DEV), fsdp, with_grads=False)
    return jax.jit(run), counted


def _std_grads(layer: Layer, dev, weights, rep) -> tuple[tuple, Any]:
    """A standard layer's per-device ``((ct_x,), ct_w)``, recomputed from its stored input."""
    x, state, ct_y = _squeeze(dev["x"]), _squeeze(dev["state"]), _squeeze(dev["ct_y"])
    rng = _layer_key(dev["rngs"], rep["index"])
    fn = lambda x_, w_: layer.pure_fn(x_, w_, state, rng)
    y, vjp_fn, _ = jax.vjp(fn, x, weights, has_aux=True)
    ct_x, ct_w = vjp_fn(_ct_for_outputs(y, ct_y))
    return (_unsqueeze(_placeholders(ct_x)),), ct_w


def _reverse_grads(layer: Layer, dev, weights, rep) -> tuple[tuple, Any]:
    """A reversible layer's per-device ``((x, ct_x), ct_w)``, its input reconstructed."""
    y, ct_y = _squeeze(dev["y"]), _squeeze(dev["ct_y"])
    rng = _layer_key(dev["rngs"], rep["index"])
    x, (ct_x, ct_w) = layer.reverse_and_grad(
        y, _ct_for_outputs(y, ct_y), weights, _squeeze(dev["state"]),
        _squeeze(dev["new_state"]), rng)
    return (_unsqueeze(x), _unsqueeze(_placeholders(ct_x))), ct_w


def _loss_grads(layer: Layer, dev, weights, rep) -> tuple[tuple, Any]:
    """The loss layer's ``((global loss, ct_x, new_state), ct_w)``; see `make_loss_fbo`."""
    x, state = _squeeze(dev["x"]), _squeeze(dev["state"])
    rng = _layer_key(dev["rngs"], rep["index"])
    fn = lambda x_, w_: layer.pure_fn(x_, w_, state, rng)
    loss, vjp_fn, new_state = jax.vjp(fn, x, weights, has_aux=True)
    check_scalar_loss(layer, loss)
    share = loss_share(dev["weight_total"][0])
    ct_x, ct_w = vjp_fn(share.astype(loss.dtype))
    return (global_loss(share, loss), _unsqueeze(_placeholders(ct_x)),
            _unsqueeze(new_state)), ct_w


def make_fbo(layer: Layer, optimizer: optax.GradientTransformation, mesh: Mesh,
             norm_only: bool = False, fsdp: bool = False) -> tuple[FboFn | NormFn, Callable]:
    """An `FboFn` for a standard layer: recomputes the forward pass from the stored input
    (a `NormFn` giving ``(ct_x, squared_norm)`` when ``norm_only``)."""
    return _compile_fbo(lambda dev, w, rep: _std_grads(layer, dev, w, rep), mesh, (DEV,),
                        fsdp, optimizer, norm_only, place=1, norm_outs=slice(0, 1))


def make_reverse_and_fbo(layer: Layer, optimizer: optax.GradientTransformation, mesh: Mesh,
                         norm_only: bool = False,
                         fsdp: bool = False) -> tuple[ReverseFboFn | NormFn, Callable]:
    """A `ReverseFboFn`: reconstructs the input from the output (no stored input); a
    `NormFn` giving ``(x, ct_x, squared_norm)`` when ``norm_only``."""
    return _compile_fbo(lambda dev, w, rep: _reverse_grads(layer, dev, w, rep), mesh,
                        (DEV, DEV), fsdp, optimizer, norm_only, place=2,
                        norm_outs=slice(0, 2))


def make_loss_fbo(layer: Layer, optimizer: optax.GradientTransformation, mesh: Mesh,
                  norm_only: bool = False,
                  fsdp: bool = False) -> tuple[LossFboFn | NormFn, Callable]:
    """A `LossFboFn`: each device's loss cotangent is its `loss_share`, so every gradient
    downstream is of the loss over the global batch, whatever the device count. A
    `NormFn` giving ``(ct_x, squared_norm)`` when ``norm_only``."""
    return _compile_fbo(lambda dev, w, rep: _loss_grads(layer, dev, w, rep), mesh,
                        (REP, DEV, DEV), fsdp, optimizer, norm_only, place=2,
                        norm_outs=slice(1, 2))


FORWARD, LOSS, REVERSE, FBO = "forward", "loss", "reverse", "fbo"


class FnCache:
    """Compiled per-layer functions, one per (kind, layer structure, optimizer).

    Two layers with equal, non-None `Layer.structure_key` compute the same function of
    their arguments, so they share one jitted function (and one executable per input
    shape). A layer whose key is None (its identity cannot be proven, e.g. a class defined
    inside a function, or an ``Fn`` of a lambda) gets functions of its own: a cache key
    must cover everything the cached function depends on, or the cache must not share.
    The cache belongs to one trainer (no module-level state) and keeps the layers it
    keyed by identity alive, so their ids are never reused. With ``fsdp`` every function
    takes its weights sharded (`revtrain.trainers.fsdp.weight_specs`) and gives new
    weights and slots sharded.
    """

    _MAKERS = {FORWARD: make_forward, FBO: make_fbo, REVERSE: make_reverse_and_fbo,
               LOSS: make_loss_fbo}

    def __init__(self, mesh: Mesh, optimizer: optax.GradientTransformation,
                 fsdp: bool = False):
        self._mesh = mesh
        self._optimizer = optimizer
        self._fsdp = fsdp
        self._fns: dict[Any, tuple[Callable, Callable, Layer]] = {}

    def get(self, kind: str, layer: Layer, norm_only: bool = False) -> Callable:
        """Returns the jitted ``kind`` function for ``layer`` (built on first use); with
        ``norm_only`` its gradient-norm variant (`NormFn`; not for ``'forward'``)."""
        key = layer.structure_key
        key = (kind, norm_only, ("object", id(layer)) if key is None else key)
        if key not in self._fns:
            maker = self._MAKERS[kind]
            if kind == FORWARD:
                fn, counted = maker(layer, self._mesh, fsdp=self._fsdp)
            else:
                fn, counted = maker(layer, self._optimizer, self._mesh, norm_only=norm_only,
                                    fsdp=self._fsdp)
            self._fns[key] = (fn, counted, layer)
        return self._fns[key][0]

    @property
    def n_built(self) -> int:
        """How many distinct functions were built."""
        return len(self._fns)

    def trace_counts(self) -> dict[str, int]:
        """``{'kind/layer_name#k': times traced}`` for every built function."""
        return {f"{'norm_' if norm else ''}{kind}/{layer.name}#{k}":
                eqx.debug.get_num_traces(counted)
                for k, ((kind, norm, _), (_, counted, layer)) in enumerate(self._fns.items())}
