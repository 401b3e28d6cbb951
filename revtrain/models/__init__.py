"""revtrain.models: reference models, each a function returning a layer.

- `transformer`: `ReversibleTransformerLM` (Reformer-style) and `TransformerLM` (its plain
  baseline), token ids ``int32[batch, length]`` to log-probabilities;
- `revnet`: `RevNet`, which classifies NHWC images.
"""

from revtrain.models.revnet import RevNet
from revtrain.models.transformer import ReversibleTransformerLM, TransformerLM

__all__ = ["RevNet", "ReversibleTransformerLM", "TransformerLM"]
