"""The loss over the global batch: each device's share of it, and the sum of the shares.

Device ``d``'s loss ``L_d`` is the weighted mean over its rows (and, on a mesh with a
``seq`` axis, its positions); weighted by ``W_d / sum W``
(its share of the global batch weights) and summed over devices it is the weighted mean
over the global batch, ``sum(w * loss) / sum(w)``, whatever the device or process count.
Every trainer's loss and loss cotangent come from these functions (the invariance).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from revtrain.layers.base import Layer
from revtrain.parallel.placement import BATCH_AXIS


def check_scalar_loss(layer: Layer, loss: Any) -> None:
    """Raises ValueError unless ``loss`` is a scalar (checked while tracing)."""
    if not isinstance(loss, jax.Array) or loss.shape != ():
        shape = getattr(loss, "shape", type(loss).__name__)
        raise ValueError(f"the loss layer {layer.name} returned {shape}, not a scalar; end "
                         f"the model with a loss that averages over the batch (e.g. "
                         f"CrossEntropyLoss)")


def loss_share(weight_total: jax.Array,
               axes: str | tuple[str, ...] = BATCH_AXIS) -> jax.Array:
    """This device's share ``W_d / sum_d W_d`` of the global loss (0 when ``sum W`` is 0).

    Args:
      weight_total: float32 scalar, the total of this device's batch weights (from
        `revtrain.parallel.batches.device_weight_total`).
      axes: the mesh axes the sums run over: every axis that splits the batch's rows or
        positions (`revtrain.parallel.placement.Placement.device_axes`).

    Returns:
      float32 scalar; ``share * L_d`` summed over devices is the loss over the global batch.
    """
    total = jax.lax.psum(weight_total, axes)
    safe = jnp.where(total > 0, total, 1.0)
    return jnp.where(total > 0, weight_total / safe, 0.0).astype(jnp.float32)


def global_loss(share: jax.Array, loss: jax.Array,
                axes: str | tuple[str, ...] = BATCH_AXIS) -> jax.Array:
    """``sum_d share_d * L_d`` over the mesh ``axes``: the weighted-mean loss over the
    global batch."""
    return jax.lax.psum(share * loss.astype(jnp.float32), axes)



__all__ = ["check_scalar_loss", "global_loss", "loss_share"]
