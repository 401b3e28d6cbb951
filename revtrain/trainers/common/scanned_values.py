"""`Trainer`'s values with each scanned run stacked: one leaf per run for the optimizer too.

`revtrain.layers.scan.run_in_series` already runs each run of equal layers as one
``lax.scan``, but from per-layer weights: the gradient comes back per layer, and the
optimizer update, the norms and the sharding constraints of a step were one copy per
layer (at depth 32 they were most of the compiled program). `ScannedValues` keeps the
weights and the optimizer slots in the stacked layout of `revtrain.layers.run_layout`
while they are in memory, so a step's program holds one copy of everything per run. The
public values (``train_state``, checkpoints, `Trainer.restore`) keep one entry per layer:
stacked only in memory, the same tree on disk.

Stacking changes which leaves the optimizer sees (one ``[repeats, *leaf]`` leaf per run
position instead of ``repeats`` leaves): element-wise transformations (Adam, SGD,
momentum, weight decay) compute bitwise what they compute per layer, and global ones
(``clip_by_global_norm``) agree to float rounding (the sum of squares is ordered
differently). A transformation whose state has another shape per stacked leaf (factored
second moments, as ``optax.adafactor``) is detected and runs unstacked; one that depends
on per-leaf norms with per-leaf-shaped state (LARS, LAMB's trust ratio) needs
``Trainer(scan_layers=False)`` to keep its per-layer meaning.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from absl import logging

from revtrain.layers.layer import Layer
from revtrain.layers.run_layout import RunLayout, map_params
from revtrain.layers.scan import StackedRun
from revtrain.parallel.placement import Placement


class ScannedValues:
    """Converts a model's weights and optimizer slots between the public per-layer layout
    and the stacked one held in memory.

    Args:
      model: the trainer's model (with its loss).
      weights: its per-layer weights (arrays or ``ShapeDtypeStruct`` s).
      state: its per-layer state.
      optimizer: the trainer's optax transformation.
      scan: False keeps everything per layer (every conversion is the identity).
    """

    def __init__(self, model: Layer, weights: Any, state: Any,
                 optimizer: optax.GradientTransformation, scan: bool = True):
        layout = RunLayout.of(model, weights, state) if scan else None
        self._weights = jax.tree.map(_shape_dtype, weights)
        self._stacked = None
        if layout is not None and not _stacking_agrees(optimizer, layout, self._weights):
            logging.info("the optimizer does not update stacked layers as it updates each "
                         "layer (a per-leaf norm or shape); the trainer keeps its weights "
                         "per layer")
            layout = None
        self._stacked = None if layout is None else jax.eval_shape(layout.stack, self._weights)
        self._layout = layout

    @property
    def stacked(self) -> bool:
        """Whether any run is held stacked."""
        return self._layout is not None

    def held_weights(self, weights: Any) -> Any:
        """Per-layer weights -> the held layout (traceable; arrays of any kind)."""
        return weights if self._layout is None else self._layout.stack(weights)

    def public_weights(self, held: Any) -> Any:
        """The held layout -> per-layer weights (traceable; numpy or jax arrays)."""
        return held if self._layout is None else self._layout.unstack(held)

    def held_slots(self, slots: Any) -> Any:
        """Per-layer optimizer state -> the held layout."""
        if self._layout is None:
            return slots
        return map_params(slots, self._weights, self._layout.stack)

    def public_slots(self, held: Any) -> Any:
        """The held optimizer state -> per-layer."""
        if self._layout is None:
            return held
        return map_params(held, self._stacked, self._layout.unstack)

    def shardings(self, placement: Placement, held: Any) -> Any:
        """Per-leaf ``NamedSharding`` of held weights or slots: a layer's own
        (`Placement.weight_spec`) behind a whole repetition axis on stacked leaves, as the
        block trainers store their runs (`Placement.stacked_weight_spec`)."""
        def sharding(x):
            if isinstance(x, StackedRun):
                return placement.stacked_weight_shardings(x)
            return placement.weight_shardings(x)
        return jax.tree.map(sharding, held, is_leaf=lambda x: isinstance(x, StackedRun))


def _stacking_agrees(optimizer: optax.GradientTransformation, layout: RunLayout,
                     weights: Any) -> bool:
    """Whether two updates of ``optimizer`` on stacked runs equal (to float rounding) its
    updates on the same layers one by one, probed on a cut model (every run two
    repetitions long: `RunLayout.truncated`) with random weights and gradients, so the
    probe costs the same at every depth. Per-leaf norms (LAMB, LARS, adafactor's
    update clipping and parameter scale) differ between layers and fail it."""
    small, small_layout = layout.truncated(weights)
    rs = np.random.RandomState(0)
    params, *grads = (jax.tree.map(lambda a: rs.standard_normal(a.shape).astype(a.dtype),
                                   small) for _ in range(3))

    def two_updates(params, grads, stack):
        """The sum of the two updates (not the new weights: a small update, as LARS's,
        would hide below the tolerance in them)."""
        convert = small_layout.stack if stack else (lambda tree: tree)
        params, state = convert(params), optimizer.init(convert(params))
        total = jax.tree.map(jax.numpy.zeros_like, params)
        for g in grads:
            updates, state = optimizer.update(convert(g), state, params)
            params = optax.apply_updates(params, updates)
            total = jax.tree.map(jax.numpy.add, total, updates)
        return small_layout.unstack(total) if stack else total

    try:  # One small program (per-op dispatch of both would cost more than compiling).
        per_layer, stacked = jax.jit(lambda p, g: tuple(two_updates(p, g, stack)
                                                        for stack in (False, True)))(
            params, grads)
        return all(np.allclose(a, b, rtol=1e-4, atol=0.0) for a, b in zip(
            jax.tree.leaves(per_layer), jax.tree.leaves(stacked), strict=True))
    except Exception:  # noqa: BLE001 -- e.g. labels or masks given per layer: keep them.
        return False


def _shape_dtype(a: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(a), jax.numpy.result_type(a))


__all__ = ["ScannedValues"]
