"""Splitting a global batch over devices: the device reshape and each device's share of the
batch weights.

A batch is a tuple ``(inputs, targets, weights, ...)`` of arrays with a leading batch axis;
device ``d`` of ``n`` gets rows ``[d * batch // n, (d + 1) * batch // n)``. Every trainer
splits batches with these functions, so they cannot disagree about which rows a device gets.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revtrain.batch_checks import check_divisible


def check_split(batch: int | None, n_devices: int) -> None:
    """`revtrain.batch_checks.check_divisible` for a batch of ``batch`` rows (None: a
    leaf without a leading axis, which never splits).

    Raises:
      ValueError: when ``batch`` is None, 0, or not a multiple of ``n_devices``; names
        both numbers.
    """
    check_divisible(0 if batch is None else batch, n_devices)


def reshape_by_device(x: Any, n_devices: int) -> Any:
    """Reshapes each leaf ``[batch, ...]`` to ``[n_devices, batch // n_devices, ...]``.

    Args:
      x: a pytree of arrays (numpy or jax) with a leading batch axis.
      n_devices: number of devices.

    Raises:
      ValueError: when the batch is empty, when leaves disagree on the batch size, or when
        it is not divisible by ``n_devices`` (names both numbers).
    """
    leaves = [a if hasattr(a, "reshape") else np.asarray(a) for a in jax.tree.leaves(x)]
    sizes = sorted({a.shape[0] if a.ndim else None for a in leaves}, key=str)
    if len(sizes) > 1:
        raise ValueError(f"batch items have different batch sizes {sizes}; give every item "
                         f"(inputs, targets, weights) the same leading batch axis")
    batch = sizes[0] if sizes else None
    check_split(batch, n_devices)

    def reshape(a):
        a = a if hasattr(a, "reshape") else np.asarray(a)
        return a.reshape((n_devices, batch // n_devices) + tuple(a.shape[1:]))
    return jax.tree.map(reshape, x)


def for_n_devices(x: Any, n_devices: int) -> Any:
    """Broadcasts each leaf to a leading device axis: ``[...] -> [n_devices, ...]``."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n_devices,) + np.shape(a)), x)



def split_sequence(x: Any, n_seq: int, layout: np.ndarray) -> Any:
    """Splits the length axis of per-device leaves over ``n_seq`` more devices.

    Each leaf ``[shards, rows, length, ...]`` (numpy or jax) is permuted along its length
    axis by ``layout`` (a permutation of ``range(length)``, e.g.
    `revtrain.layers.sequence_parallel.sequence_layout`), cut into ``n_seq`` contiguous
    blocks, and returned as ``[shards * n_seq, rows, length // n_seq, ...]``: row ``b *
    n_seq + s`` is block ``s`` of shard ``b`` (the row-major order of a ``(data, fsdp,
    seq)`` mesh's devices).

    Raises:
      ValueError: for a leaf without a length axis or whose length ``n_seq`` does not
        divide, or a ``layout`` of another length.
    """
    layout = np.asarray(layout)
    identity = np.array_equal(layout, np.arange(layout.size))

    def split(a):
        a = a if hasattr(a, "reshape") else np.asarray(a)
        if a.ndim < 3 or a.shape[2] % n_seq or a.shape[2] != layout.size:
            raise ValueError(f"a per-device leaf of shape {a.shape} has no length axis "
                             f"of {layout.size} positions divisible by n_seq={n_seq}")
        if not identity:
            a = a[:, :, layout]
        shards, rows, length = a.shape[:3]
        a = a.reshape((shards, rows, n_seq, length // n_seq) + tuple(a.shape[3:]))
        a = a.swapaxes(1, 2)
        return a.reshape((shards * n_seq, rows, length // n_seq) + tuple(a.shape[4:]))
    return jax.tree.map(split, x)


def device_weight_total(weights: Any | None, axis_name: str | tuple[str, ...]) -> jax.Array:
    """Inside ``shard_map``: the total of this device's batch weights, float32 scalar.

    ``weights`` is the device's slice of the batch's third item (per-position loss weights,
    Trax's 0/1 padding mask): integer and boolean weights are summed exactly (int32), float
    ones in float32 (for fractional weights an ulp from a float64 sum on the host; 0/1
    masks are exact up to 2**24 positions per device). For a batch without weights (None)
    the total is 1: every device has the same number of rows (and positions), so each
    device's share of the loss
    (`revtrain.trainers.common.global_loss.loss_share`) is ``1 / devices`` either way, whatever
    the stack holds. ``axis_name`` is the mesh axis, or axes, the batch is split over (the
    total varies over them: `revtrain.parallel.placement.Placement.device_axes`).
    """
    if weights is None:
        return jax.lax.pcast(jnp.float32(1.0), axis_name, to="varying")
    if jnp.issubdtype(weights.dtype, jnp.integer) or weights.dtype == jnp.bool_:
        return jnp.sum(weights, dtype=jnp.int32).astype(jnp.float32)
    return jnp.sum(weights, dtype=jnp.float32)


__all__ = ["check_split", "device_weight_total", "for_n_devices", "reshape_by_device",
           "split_sequence"]
