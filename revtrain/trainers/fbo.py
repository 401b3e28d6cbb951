"""Per-layer compiled functions of the block trainers: forward, fbo, reverse-and-fbo, loss.

An *fbo* (forward-backward-optimizer) function runs one layer's vjp, combines the weight
gradients across devices, applies the layer's optimizer update and returns the new weights,
new optimizer slots, the input cotangents and stats -- so the gradients of the whole model
are never held at once (Trax's ``ReversibleSerialTrainer`` idea). Every function here is
``jax.jit(jax.shard_map(...))`` over the ``batch`` mesh axis: per-device values (activations,
cotangents, layer state, rngs) have a leading device axis, weights and slots are replicated.

Combining across devices (the data-parallel invariance; see `loss_share`): the loss of a
step is the weighted mean over the *global* batch, ``sum_d W_d * L_d / sum_d W_d``, where
``L_d`` is device ``d``'s weighted-mean loss and ``W_d`` the total of its batch weights.
So the loss layer's cotangent on device ``d`` is its share ``W_d / sum W`` (not 1), every
cotangent flowing back carries that share, and the weight gradient is the *sum* over
devices of the per-device gradients (``psum``), never their mean. Weights enter each vjp
as explicitly per-device values (`varying`), so autodiff does not sum them behind our
back: inside ``shard_map`` the cotangent of a replicated input is already summed over the
mesh axis, and a ``pmean`` after it would multiply the gradient by the device count.

Cotangents of integer stack items (token ids, labels) carry no information; they are passed
as a float32 placeholder of shape ``[n_devices]`` and replaced by ``float0`` zeros inside.

`FnCache` compiles each kind of function once per *layer structure* (`Layer.structure_key`),
so identical layers of a deep model share one executable and nothing recompiles after the
first step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from revtrain.layers.base import Layer
from revtrain.trainers.devices import BATCH_AXIS

DEV = P(BATCH_AXIS)
REP = P()


def has_injectable_learning_rate(slots: Any) -> bool:
    """True when ``slots`` holds an ``optax.inject_hyperparams`` ``learning_rate``."""
    return bool(optax.tree_utils.tree_get_all_with_path(slots, "learning_rate"))


def learning_rate_of(slots: Any) -> float | None:
    """The ``learning_rate`` stored in optimizer slots, or None when there is none."""
    found = optax.tree_utils.tree_get_all_with_path(slots, "learning_rate")
    return float(np.asarray(found[0][1])) if found else None


def apply_optimizer(optimizer: optax.GradientTransformation, grads: Any, weights: Any,
                    slots: Any, learning_rate: jax.Array | None) -> tuple[Any, Any]:
    """One optimizer update; sets the injectable learning rate first when one is given."""
    if learning_rate is not None:
        old = optax.tree_utils.tree_get_all_with_path(slots, "learning_rate")[0][1]
        slots = optax.tree_utils.tree_set(slots, learning_rate=jnp.asarray(
            learning_rate, dtype=jnp.asarray(old).dtype))
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


def _wrap_key(key_data: jax.Array) -> jax.Array:
    return jax.random.wrap_key_data(key_data)


def _layer_stats(grads: Any, new_weights: Any) -> dict[str, jax.Array]:
    return {"gradients_l2": optax.tree.norm(grads),
            "weights_l2": optax.tree.norm(new_weights)}


def varying(tree: Any) -> Any:
    """Replicated values as per-device ones (``lax.pcast`` to varying over ``batch``).

    Differentiating with respect to the result gives each device's own gradient, which
    `combine_gradients` then sums; without the cast, autodiff sums it already.
    """
    return jax.lax.pcast(tree, BATCH_AXIS, to="varying")


def combine_gradients(per_device_grads: Any) -> Any:
    """The global gradient: the sum over devices of per-device gradients of the shares.

    Each device's gradient is of its share ``W_d / sum W`` of the global loss (see
    `loss_share`), so the sum is the gradient of the global weighted mean.
    """
    return jax.lax.psum(per_device_grads, BATCH_AXIS)


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


def _update(optimizer, ct_w, w, slots, lr) -> tuple[Any, Any, dict[str, jax.Array]]:
    grads = combine_gradients(ct_w)
    new_w, new_slots = apply_optimizer(optimizer, grads, w, slots, lr)
    return new_w, new_slots, _layer_stats(grads, new_w)


def make_forward(layer: Layer, mesh: Mesh) -> Callable:
    """``(x, w, state, rng) -> (y, new_state)`` for per-device ``x``, ``state``, ``rng``."""
    def body(x, w, state, rng):
        y, new_state = layer.pure_fn(_squeeze(x), w, _squeeze(state), _wrap_key(rng[0]))
        return _unsqueeze(y), _unsqueeze(new_state)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(DEV, REP, DEV, DEV),
                                 out_specs=(DEV, DEV)))


def make_fbo(layer: Layer, optimizer: optax.GradientTransformation, mesh: Mesh) -> Callable:
    """Standard layer: ``(x, w, state, rng, ct_y, slots, lr) -> (ct_x, new_w, new_slots,
    stats)``; recomputes the forward pass from the stored input ``x``."""
    def body(x, w, state, rng, ct_y, slots, lr):
        x, state, ct_y = _squeeze(x), _squeeze(state), _squeeze(ct_y)
        fn = lambda x_, w_: layer.pure_fn(x_, w_, state, _wrap_key(rng[0]))
        y, vjp_fn, _ = jax.vjp(fn, x, varying(w), has_aux=True)
        ct_x, ct_w = vjp_fn(_ct_for_outputs(y, ct_y))
        new_w, new_slots, stats = _update(optimizer, ct_w, w, slots, lr)
        return _unsqueeze(_placeholders(ct_x)), new_w, new_slots, stats
    return jax.jit(jax.shard_map(body, mesh=mesh,
                                 in_specs=(DEV, REP, DEV, DEV, DEV, REP, REP),
                                 out_specs=(DEV, REP, REP, REP)),
                   donate_argnums=(1, 5))


def make_reverse_and_fbo(layer: Layer, optimizer: optax.GradientTransformation,
                         mesh: Mesh) -> Callable:
    """Reversible layer: ``(y, ct_y, w, state, new_state, rng, slots, lr) -> (x, ct_x,
    new_w, new_slots, stats)``; reconstructs the input from the output (no stored x)."""
    def body(y, ct_y, w, state, new_state, rng, slots, lr):
        y, ct_y = _squeeze(y), _squeeze(ct_y)
        x, (ct_x, ct_w) = layer.reverse_and_grad(
            y, _ct_for_outputs(y, ct_y), varying(w), _squeeze(state), _squeeze(new_state),
            _wrap_key(rng[0]))
        new_w, new_slots, stats = _update(optimizer, ct_w, w, slots, lr)
        return _unsqueeze(x), _unsqueeze(_placeholders(ct_x)), new_w, new_slots, stats
    return jax.jit(jax.shard_map(body, mesh=mesh,
                                 in_specs=(DEV, DEV, REP, DEV, DEV, DEV, REP, REP),
                                 out_specs=(DEV, DEV, REP, REP, REP)),
                   donate_argnums=(2, 6))


def make_loss_fbo(layer: Layer, optimizer: optax.GradientTransformation,
                  mesh: Mesh) -> Callable:
    """Loss layer: ``(x, w, state, rng, weight_total, slots, lr) -> (loss, ct_x, new_w,
    new_slots, new_state, stats)``.

    ``weight_total`` is per device (``[n_devices]`` float32, the totals of each device's
    batch weights). The returned ``loss`` is the weighted mean over the global batch, and
    each device's loss cotangent is its `loss_share`, so every gradient downstream is of
    the global loss whatever the device count.
    """
    def body(x, w, state, rng, weight_total, slots, lr):
        x, state = _squeeze(x), _squeeze(state)
        fn = lambda x_, w_: layer.pure_fn(x_, w_, state, _wrap_key(rng[0]))
        loss, vjp_fn, new_state = jax.vjp(fn, x, varying(w), has_aux=True)
        check_scalar_loss(layer, loss)
        share = loss_share(weight_total[0])
        ct_x, ct_w = vjp_fn(share.astype(loss.dtype))
        new_w, new_slots, stats = _update(optimizer, ct_w, w, slots, lr)
        return (global_loss(share, loss), _unsqueeze(_placeholders(ct_x)), new_w, new_slots,
                _unsqueeze(new_state), stats)
    return jax.jit(jax.shard_map(body, mesh=mesh,
                                 in_specs=(DEV, REP, DEV, DEV, DEV, REP, REP),
                                 out_specs=(REP, DEV, REP, REP, DEV, REP)),
                   donate_argnums=(1, 5))


class FnCache:
    """Compiled per-layer functions, one per (kind, layer structure, optimizer).

    Two layers with equal `Layer.structure_key` compute the same function of their
    arguments, so they share one jitted function (and one executable per input shape).
    The cache belongs to one trainer (no module-level state).
    """

    _MAKERS = {"forward": make_forward, "fbo": make_fbo,
               "reverse_and_fbo": make_reverse_and_fbo, "loss_fbo": make_loss_fbo}

    def __init__(self, mesh: Mesh, optimizer: optax.GradientTransformation):
        self._mesh = mesh
        self._optimizer = optimizer
        self._fns: dict[Any, Callable] = {}
        self.n_built = 0

    def get(self, kind: str, layer: Layer) -> Callable:
        """Returns the jitted ``kind`` function for ``layer`` (built on first use)."""
        key = (kind, layer.structure_key)
        if key not in self._fns:
            maker = self._MAKERS[kind]
            args = (layer, self._mesh) if kind == "forward" else (
                layer, self._optimizer, self._mesh)
            self._fns[key] = maker(*args)
            self.n_built += 1
        return self._fns[key]
