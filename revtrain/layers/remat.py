"""`Remat`: a layer whose activations are recomputed in the backward pass (``jax.checkpoint``).

Under ``jax.grad`` a `Remat` layer keeps only its inputs for the backward pass and runs its
sublayer's forward computation again there, so the activations inside the sublayer are not
stored between the two passes. Wrapping each block of a deep model in `Remat` is the
rematerialisation baseline a JAX user reaches for before reversible layers: stored
activations drop to one block input per block (still growing with depth) for the cost of a
second forward pass.

References: ``jax.checkpoint`` (also ``jax.remat``) and its ``policy`` argument
(``jax.checkpoint_policies``); Chen et al., "Training Deep Nets with Sublinear Memory Cost",
2016 (gradient checkpointing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from revtrain.layers.layer import Layer
from revtrain.layers.stack import check_per_sublayer


class Remat(Layer):
    """Computes ``layer`` under ``jax.checkpoint``: same values and gradients, less memory.

    ``Remat(layer)`` has ``layer``'s ``n_in``/``n_out``; its weights and state are the
    1-tuples ``(layer.weights,)`` and ``(layer.state,)`` (it is a combinator with one
    sublayer). The rng is passed to ``layer`` unchanged (not split), so ``Remat(layer)``
    computes exactly what ``layer`` computes with the same rng, dropout included.

    `Remat` is not a `ReversibleLayer`, even around one: it is meant for trainers that
    differentiate the whole model (`revtrain.trainers.Trainer`).

    The saving is measured by ``benchmarks/memory_vs_depth.py`` (its "Trainer + remat"
    rows, docs/benchmarks.md): the peak stays well below `Trainer`'s, but it still grows
    with depth, since one input per wrapped layer is stored.

    Args:
      layer: the layer whose forward pass is recomputed in the backward pass.
      policy: optional ``jax.checkpoint`` policy deciding which intermediate values may be
        saved after all, e.g. ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``;
        None (the default) saves nothing but the inputs.
      name: the layer's name; default ``'Remat'``.

    Raises:
      TypeError: when ``layer`` is not a `Layer`.
    """

    def __init__(self, layer: Layer, policy: Callable[..., bool] | None = None,
                 name: str | None = None):
        if not isinstance(layer, Layer):
            raise TypeError(f"Remat wraps a Layer; got {type(layer).__name__}: {layer!r}")
        super().__init__(n_in=layer.n_in, n_out=layer.n_out, name=name or "Remat",
                         sublayers=(layer,))
        self._policy = policy

    def forward_with_state(self, x: Any, weights: Any, state: Any,
                           rng: jax.Array | None) -> tuple[Any, Any]:
        (layer,) = self.sublayers
        check_per_sublayer(self, weights=weights, state=state)
        (layer_weights,), (layer_state,) = weights, state
        remat_fn = jax.checkpoint(layer.pure_fn, policy=self._policy)
        y, new_state = remat_fn(x, layer_weights, layer_state, rng)
        return y, (new_state,)

    def init_weights_and_state(self, input_signature: Any,
                               rng: jax.Array) -> tuple[Any, Any]:
        (layer,) = self.sublayers
        weights, state = layer.init(input_signature, rng=rng)
        return (weights,), (state,)


__all__ = ["Remat"]
