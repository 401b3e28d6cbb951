"""A tiny reversible LM built from revtrain.layers, for fast loop and CLI tests."""
from revtrain import layers as tl


def tiny_reversible_lm(vocab_size: int = 16, d_model: int = 8, dropout: float = 0.1,
                       mode: str = "train") -> tl.Layer:
    """Embedding -> 2 reversible half-residual pairs (Dense + Dropout) -> Dense logits."""
    def half():
        return tl.ReversibleHalfResidual(tl.Dense(d_model), tl.Relu(),
                                         tl.Dropout(dropout, mode=mode))

    return tl.Serial(
        tl.Embedding(vocab_size, d_model), tl.Dup(),
        tl.ReversibleSerial(half(), tl.ReversibleSwap(), half(), tl.ReversibleSwap()),
        tl.Concatenate(), tl.Dense(vocab_size))
