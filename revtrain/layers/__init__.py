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
from revtrain.layers.core import (
    Dense,
    Dropout,
    Embedding,
    Flatten,
    Gelu,
    LogSoftmax,
    Mean,
    PositionalEncoding,
    Relu,
    ShiftRight,
    Sigmoid,
    Softmax,
    Tanh,
)
from revtrain.layers.metrics import (
    Accuracy,
    CrossEntropyLoss,
    L2Loss,
    WeightedCategoryCrossEntropy,
    weighted_mean,
)

from revtrain.layers.reversible import (
    ReversibleHalfResidual,
    ReversibleLayer,
    ReversibleReshape,
    ReversibleSelect,
    ReversibleSerial,
    ReversibleSwap,
)
from revtrain.layers.blocks import (
    blocks_to_layers,
    extract_reversible_blocks,
    init_reversible_blocks,
    reconstruction_error,
)

__all__ = [
    "EMPTY", "Fn", "Layer", "LayerError", "PureLayer", "ShapeDtype", "inputs_from_stack",
    "outputs_onto_stack", "signature_of",
    "Add", "Branch", "Concatenate", "Drop", "Dup", "Parallel", "Residual", "Select", "Serial",
    "Split", "Swap", "split_rng",
    "Dense", "Dropout", "Embedding", "Flatten", "Gelu", "LogSoftmax", "Mean",
    "PositionalEncoding", "Relu", "ShiftRight", "Sigmoid", "Softmax", "Tanh",
    "Accuracy", "CrossEntropyLoss", "L2Loss", "WeightedCategoryCrossEntropy", "weighted_mean",
"ReversibleHalfResidual", "ReversibleLayer", "ReversibleReshape", "ReversibleSelect",
    "ReversibleSerial", "ReversibleSwap", "blocks_to_layers", "extract_reversible_blocks",
    "init_reversible_blocks", "reconstruction_error",
]
