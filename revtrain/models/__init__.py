"""revtrain.models: reference models, each a function returning a layer.

`ReversibleTransformerLM` (Reformer-style) and `TransformerLM` (its plain baseline) map
token ids ``int32[batch, length]`` to log-probabilities; `RevNet` classifies NHWC images.
"""

from revtrain.models.revnet import RevNet
from revtrain.models.transformer import ReversibleTransformerLM, TransformerLM

__all__ = ["RevNet", "ReversibleTransformerLM", "TransformerLM"]
