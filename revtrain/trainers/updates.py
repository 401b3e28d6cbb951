"""The optimizer update of a layer (or a whole model) and what feeds it: the injectable
learning rate and clipping by a given global gradient norm.

`Trainer` and the block trainers' programs update through `apply_optimizer`, so the
learning-rate override (``one_step(..., learning_rate=...)``) and clipping behave the same
in every trainer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

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



__all__ = ["apply_optimizer", "clip_by_given_global_norm", "has_injectable_learning_rate",
           "learning_rate_of", "squared_norm"]
