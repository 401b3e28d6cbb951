"""Core vocabulary of revtrain layers, gathered from the modules that define it.

A layer is an object that holds weights and state but computes through one pure function,
``pure_fn(x, weights, state, rng) -> (y, new_state)``, which is jit-able and never reads
mutable attributes of the layer. Layers pass data on a *stack*, as in Trax: a layer with
``n_in`` inputs takes the top ``n_in`` items of the stack and puts its ``n_out`` outputs in
their place (see `inputs_from_stack` / `outputs_onto_stack`).

Vocabulary:

* ``Weights`` -- a pytree of arrays. A layer without weights has ``()`` (`EMPTY`). A layer
  with sublayers (a combinator) has exactly ``tuple(s.weights for s in sublayers)``.
* ``State`` -- a pytree of arrays that changes in the forward pass (e.g. BatchNorm moving
  averages); same conventions as weights.
* ``Stack`` -- one array (a stack of one item) or a tuple of arrays, top of stack first.
* ``ShapeDtype`` -- an abstract array (``jax.ShapeDtypeStruct``); an *input signature* is one
  ``ShapeDtype`` for ``n_in == 1`` or a tuple of them.

Where each concept lives:

* `revtrain.layers.layer` -- `Layer` (the contract, weights, state, rng, ``pure_fn``).
* `revtrain.layers.fn` -- `PureLayer` and `Fn`: weightless layers from functions.
* `revtrain.layers.stack` -- the stack helpers and `check_n_items`, the one arity check.
* `revtrain.layers.signatures` -- `ShapeDtype` signatures, dtypes, `LayerError`.
* `revtrain.layers.structure_keys` -- `Layer.structure_key`: when layers may share compiled code.

This module re-exports them, so ``from revtrain.layers.base import Layer`` keeps working.

References: Trax's ``trax.layers.base`` (the stack idiom and ``LayerError``), whose API
names revtrain keeps.
"""

from revtrain.layers.fn import Fn, PureLayer
from revtrain.layers.layer import EMPTY, Layer, State, Weights
from revtrain.layers.signatures import (
    LayerError,
    ShapeDtype,
    float_dtype,
    format_signature,
    signature_of,
)
from revtrain.layers.stack import Stack, check_n_items, inputs_from_stack, outputs_onto_stack

__all__ = [
    "EMPTY", "Fn", "Layer", "LayerError", "PureLayer", "ShapeDtype", "Stack", "State",
    "Weights", "check_n_items", "float_dtype", "format_signature", "inputs_from_stack",
    "outputs_onto_stack", "signature_of",
]
