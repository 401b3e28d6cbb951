"""The stacked layout of a scanned run's values: one array per leaf for all its repetitions.

A `revtrain.trainers.block.plan.Run` repeats a group of ``period`` layers ``repeats`` times; a
store that scans it (`revtrain.trainers.block.device_store.DeviceStore`) keeps, for each
position ``j`` of the group, the weights (and slots) of the ``repeats`` layers at that
position as one tree whose leaves are ``[repeats, *leaf]`` -- flat layer
``run.start + t * period + j`` is entry ``t`` -- and their per-device states as
``[devices, repeats, *leaf]`` (the device axis stays first, as on every per-device value).
A stacked weight or slot leaf is split as one layer's leaf is
(`revtrain.parallel.placement.Placement.stacked_weight_spec`: the repetition axis whole), so
with FSDP each scan iteration finds its layer's shards on every device and gathers only
those. The public values (``train_state``, checkpoints) keep one entry per flat layer;
the functions here convert between the two layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from revtrain.parallel import transfers
from revtrain.parallel.placement import Placement
from revtrain.trainers.block.plan import Run


def stacked_signature(layer_values: Any, repeats: int, placement: Placement) -> Any:
    """The ``jax.ShapeDtypeStruct`` tree (with shardings) of ``repeats`` layers' stacked
    weights or slots, from one layer's values (arrays or ``ShapeDtypeStruct`` s)."""
    def one(a):
        shape = (repeats, *np.shape(a))
        return jax.ShapeDtypeStruct(shape, a.dtype, sharding=NamedSharding(
            placement.mesh, placement.stacked_weight_spec(shape)))
    return jax.tree.map(one, layer_values)


def _write(buffer: jax.Array, value: jax.Array, t: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(buffer, value, t, 0)


_write_in_place = jax.jit(_write, donate_argnums=0)


class StackWriter:
    """Builds one position's stacked weights or slots layer by layer, in place.

    The buffers are allocated once (`stacked_signature`'s shapes and shardings) and each
    layer's values are put on the devices in their own layout and written into entry
    ``t`` by a program that donates the buffer, so the run's values exist once, plus
    one layer's, while a store restores them (not a second stacked copy).

    Args:
      placement: the trainer's placement.
      repeats: entries of the stack.
    """

    def __init__(self, placement: Placement, repeats: int):
        self._placement, self._repeats = placement, repeats
        self.buffers: Any = None

    def write(self, t: int, values: Any) -> None:
        """Writes one layer's values (host arrays or ``jax.Array`` s in any sharding) as
        entry ``t``."""
        placement = self._placement
        placed = transfers.put_values(values, placement.weight_shardings(values))
        if self.buffers is None:
            self.buffers = jax.tree.map(
                lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding),
                stacked_signature(placed, self._repeats, placement))
        index = jax.device_put(np.int32(t), placement.replicated)
        self.buffers = jax.tree.map(lambda b, v: _write_in_place(b, v, index),
                                    self.buffers, placed)


def stack_states(per_layer: Sequence[Any]) -> Any:
    """Host per-device states ``[devices, *leaf]`` of a position's layers (in repetition
    order) -> ``[devices, repeats, *leaf]``."""
    return jax.tree.map(lambda *leaves: np.stack(leaves, axis=1), *per_layer)


def entry(tree: Any, t: int, axis: int = 0) -> Any:
    """Entry ``t`` of host stacked values along ``axis`` (0 for weights and slots)."""
    return jax.tree.map(lambda a: np.take(a, t, axis=axis), tree)


class Unstacker:
    """Splits stacked device values into one tree per layer, each in its layer's own
    sharding (for a checkpoint of one entry per flat layer: `HeldValues.saved_values`).

    One compiled program per position and part, built on first use. The split values are
    new device buffers: while they live, the run's weights (or slots) are on the devices
    twice.
    """

    def __init__(self):
        self._programs: dict[Any, Any] = {}

    def __call__(self, key: Any, stacked: Any, shardings: Sequence[Any]) -> tuple:
        """``stacked`` -> ``len(shardings)`` trees, entry ``t`` in ``shardings[t]``."""
        program = self._programs.get(key)
        if program is None:
            n = len(shardings)
            program = self._programs[key] = jax.jit(
                lambda tree: tuple(jax.tree.map(lambda a, t=t: a[t], tree) for t in range(n)),
                out_shardings=tuple(shardings))
        return program(stacked)


def run_positions(runs: Sequence[Run]) -> dict[int, tuple[Run, int, int]]:
    """``{flat layer: (run, position j, repetition t)}`` for every layer of ``runs``."""
    return {i: (run, j, t) for run in runs for j in range(run.period)
            for t, i in enumerate(run.members(j))}


__all__ = ["StackWriter", "Unstacker", "entry", "run_positions", "stack_states",
           "stacked_signature"]
