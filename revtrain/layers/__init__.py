"""revtrain.layers: Trax-style layers and combinators that pass data on a stack.

- the contract: `layer` (`Layer`, `pure_fn`), `base` (the vocabulary gathered), `stack`
  (`inputs_from_stack` / `outputs_onto_stack`), `signatures` (shapes, `LayerError`),
  `structure_keys` (when two layers compute the same function);
- combinators: `combinators` (`Serial`, `Branch`, `Parallel`, `Residual`, ...), `scan`
  (runs of equal layers as one ``lax.scan``), `series_init` (those runs initialised by
  one vmapped init), `run_layout` (those runs' weights stacked, and back), `remat`
  (`Remat`, `RematSchedule`), `fn` (`Fn`, `PureLayer`);
- core layers: `core` (`Dense`, `Embedding`, `Dropout`, ...), `activations`,
  `normalization`, `conv`, `dropout_masks`, `position_tables`;
- reversibility: `reversible` (`ReversibleSwap`, `ReversibleHalfResidual`,
  `ReversibleSerial`), `blocks` (a model as reversible blocks), `position_chunks` (a
  half-residual's reverse over chunks of positions);
- `attention/`: causal, blockwise, ring and LSH attention; `sequence_parallel`: the length
  axis over the ``seq`` mesh axis;
- chunking and losses: `chunk` (`Chunk`, Reformer's chunked feed-forward), `metrics`
  (losses and metrics as layers), `chunked_loss`, `projected_loss`, `fused_head` (no full
  logits buffer).
"""

from revtrain.layers import sequence_parallel
from revtrain.layers.activations import Gelu, LogSoftmax, Relu, Sigmoid, Softmax, Tanh
from revtrain.layers.attention.blockwise import blockwise_attention
from revtrain.layers.attention.causal import CausalAttention
from revtrain.layers.attention.dense import dot_product_attention, einsum_attention
from revtrain.layers.attention.lsh import LSHCausalAttention
from revtrain.layers.attention.ring import ring_attention
from revtrain.layers.attention.rotary import rotary_embedding
from revtrain.layers.blocks import (
    Block,
    blocks_to_layers,
    extract_reversible_blocks,
    init_reversible_blocks,
    nest_flat_values,
    reconstruction_error,
)
from revtrain.layers.chunk import Chunk
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
from revtrain.layers.conv import AvgPool, Conv, MaxPool
from revtrain.layers.core import (
    Dense,
    Dropout,
    Embedding,
    Flatten,
    Mean,
    PositionalEncoding,
    ShiftRight,
)
from revtrain.layers.fn import Fn, PureLayer
from revtrain.layers.fused_head import FusedSerial, fuse_loss_heads
from revtrain.layers.layer import EMPTY, Layer
from revtrain.layers.metrics import (
    Accuracy,
    CrossEntropyLoss,
    L2Loss,
    WeightedCategoryCrossEntropy,
    weighted_mean,
)
from revtrain.layers.normalization import BatchNorm, LayerNorm
from revtrain.layers.projected_loss import ProjectedCrossEntropy
from revtrain.layers.remat import Remat, RematSchedule, checkpoint_policy
from revtrain.layers.reversible import (
    ReversibleHalfResidual,
    ReversibleLayer,
    ReversibleReshape,
    ReversibleSelect,
    ReversibleSerial,
    ReversibleSwap,
)
from revtrain.layers.sequence_parallel import (
    SEQ_AXIS,
    SequenceSharding,
    sequence_layout,
    sequence_sharded,
)
from revtrain.layers.signatures import LayerError, ShapeDtype, signature_of
from revtrain.layers.stack import inputs_from_stack, outputs_onto_stack

__all__ = [
    "EMPTY", "Fn", "Layer", "LayerError", "PureLayer", "ShapeDtype", "inputs_from_stack",
    "outputs_onto_stack", "signature_of",
    "Add", "Branch", "Concatenate", "Drop", "Dup", "Parallel", "Residual", "Select", "Serial",
    "Split", "Swap", "split_rng", "FusedSerial", "fuse_loss_heads",
    "Dense", "Dropout", "Embedding", "Flatten", "Gelu", "LogSoftmax", "Mean",
    "PositionalEncoding", "Relu", "ShiftRight", "Sigmoid", "Softmax", "Tanh",
    "Accuracy", "CrossEntropyLoss", "L2Loss", "ProjectedCrossEntropy",
    "WeightedCategoryCrossEntropy", "weighted_mean",
    "AvgPool", "BatchNorm", "CausalAttention", "Conv", "LSHCausalAttention", "LayerNorm", "MaxPool",
    "dot_product_attention", "einsum_attention", "blockwise_attention", "rotary_embedding",
    "ring_attention", "SEQ_AXIS", "SequenceSharding", "sequence_layout", "sequence_sharded",
    "sequence_parallel",
    "Chunk",
    "Remat",
    "RematSchedule",
    "checkpoint_policy",
    "ReversibleHalfResidual", "ReversibleLayer", "ReversibleReshape", "ReversibleSelect",
    "ReversibleSerial", "ReversibleSwap", "Block", "blocks_to_layers", "extract_reversible_blocks",
    "init_reversible_blocks", "nest_flat_values", "reconstruction_error",
]
