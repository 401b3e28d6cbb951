"""revtrain.layers.attention: causal self-attention layers and the kernels under them.

Every layer here takes Trax's ``attention_type`` signature, so a model takes any of them:

- `causal`: `CausalAttention`, exact, dense or blockwise (or cuDNN through ``jax.nn``);
- `dense`: dense causal attention and the head projections both layers share;
- `blockwise` (+ `blockwise_kernel`): exact attention in O(length) memory, online softmax
  over key blocks with a recomputing vjp;
- `ring`: the same blocks over a sequence split across the ``seq`` mesh axis;
- `lsh` (+ `lsh_chunks`, `lsh_rounds`, `lsh_hashing`): Reformer's shared-QK LSH attention;
- `rotary`: rotary position embeddings applied to queries and keys;
- `headwise`: attention as per-head stages (projections, a full-length core, output rows),
  so the half-residual's chunked reverse runs the core one head at a time.
"""

from revtrain.layers.attention.blockwise import blockwise_attention
from revtrain.layers.attention.causal import CausalAttention
from revtrain.layers.attention.dense import dot_product_attention, einsum_attention
from revtrain.layers.attention.lsh import LSHCausalAttention
from revtrain.layers.attention.ring import ring_attention
from revtrain.layers.attention.rotary import rotary_embedding

__all__ = [
    "CausalAttention", "LSHCausalAttention", "blockwise_attention", "dot_product_attention",
    "einsum_attention", "ring_attention", "rotary_embedding",
]
