"""The optimizer update of a layer (or a whole model) and what feeds it: the injected
learning rate (`revtrain.trainers.common.learning_rate`) and clipping by a given global gradient
norm.

`Trainer` and the block trainers' programs update through `apply_optimizer`, so the
learning-rate override (``one_step(..., learning_rate=...)``) and clipping behave the same
in every trainer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from revtrain.trainers.common.learning_rate import inject_learning_rate


def apply_optimizer(optimizer: optax.GradientTransformation, grads: Any, weights: Any,
                    slots: Any, learning_rate: jax.Array | None) -> tuple[Any, Any]:
    """One optimizer update; sets the injectable learning rate first when one is given
    (`revtrain.trainers.common.learning_rate.inject_learning_rate`)."""
    slots = inject_learning_rate(slots, learning_rate)
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



__all__ = ["apply_optimizer", "clip_by_given_global_norm", "squared_norm"]
