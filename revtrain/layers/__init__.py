"""revtrain.layers: Trax-style layers and combinators that pass data on a stack."""

from revtrain.layers.base import EMPTY, Fn, Layer, LayerError, PureLayer, ShapeDtype
from revtrain.layers.base import inputs_from_stack, outputs_onto_stack, signature_of
from revtrain.layers.combinators import (
    Add,
    Branch,
    Concatenate,
    Drop,
    Dup,
    Parallel,
    Residual,
    Select,
    Serial,
    Split,
    Swap,
    split_rng,
)

__all__ = [
    "EMPTY", "Fn", "Layer", "LayerError", "PureLayer", "ShapeDtype", "inputs_from_stack",
    "outputs_onto_stack", "signature_of",
    "Add", "Branch", "Concatenate", "Drop", "Dup", "Parallel", "Residual", "Select", "Serial",
    "Split", "Swap", "split_rng",
]
