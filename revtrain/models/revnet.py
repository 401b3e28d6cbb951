"""RevNet: an image classifier built from reversible residual convolution blocks.

References:
  Gomez et al., "The Reversible Residual Network: Backpropagation Without Storing
  Activations", NeurIPS 2017: the channels are split into two streams, each block computes
  ``y1 = x1 + F(x2); y2 = x2 + G(y1)`` with pre-activation (BatchNorm, ReLU, conv) residual
  functions, and the stages are joined by non-reversible downsampling layers.
"""

from __future__ import annotations

from collections.abc import Sequence

from revtrain.layers import (
    Concatenate,
    Dense,
    Layer,
    LogSoftmax,
    Mean,
    Relu,
    ReversibleHalfResidual,
    ReversibleSerial,
    ReversibleSwap,
    Serial,
    Split,
)
from revtrain.layers.conv import Conv
from revtrain.layers.normalization import BatchNorm


def _residual_function(channels: int, mode: str) -> list[Layer]:
    """RevNet's basic residual function: two (BatchNorm, ReLU, 3x3 conv) units."""
    return [BatchNorm(mode=mode), Relu(), Conv(channels, (3, 3), padding="SAME"),
            BatchNorm(mode=mode), Relu(), Conv(channels, (3, 3), padding="SAME")]


def _reversible_block(channels: int, mode: str) -> list[Layer]:
    return [ReversibleHalfResidual(*_residual_function(channels, mode)), ReversibleSwap(),
            ReversibleHalfResidual(*_residual_function(channels, mode)), ReversibleSwap()]


def _check_widths(widths: Sequence[int], n_blocks_per_stage: Sequence[int]) -> None:
    if len(widths) != len(n_blocks_per_stage) or not widths:
        raise ValueError(f"RevNet needs one width per stage: widths={tuple(widths)} and "
                         f"n_blocks_per_stage={tuple(n_blocks_per_stage)} must be non-empty "
                         f"and of equal length")
    if any(n < 0 for n in n_blocks_per_stage):
        raise ValueError(f"RevNet n_blocks_per_stage={tuple(n_blocks_per_stage)} must be >= 0")
    odd = [w for w in widths if w % 2 or w < 2]
    if odd:
        raise ValueError(f"RevNet widths {tuple(widths)} include {odd}, which cannot be split "
                         f"into two equal streams; use even widths")


def RevNet(n_classes: int = 10, widths: Sequence[int] = (16, 32, 64),
           n_blocks_per_stage: Sequence[int] = (2, 2, 2), mode: str = "train") -> Layer:
    """A RevNet classifier: ``float32[batch, height, width, channels]`` -> log-probs.

    Layers: a 3x3 ``Conv(widths[0])`` stem; per stage ``s`` a non-reversible downsampling
    ``BatchNorm, Relu, Conv(widths[s], 3x3, stride 2)`` (not for the first stage), then
    ``Split`` of the channels into two streams of ``widths[s] // 2``, a `ReversibleSerial`
    of ``n_blocks_per_stage[s]`` blocks (two half-residuals of ``[BatchNorm, Relu, Conv,
    BatchNorm, Relu, Conv]`` with swaps), and ``Concatenate``; the head is ``BatchNorm,
    Relu``, global mean pooling over height and width, ``Dense(n_classes), LogSoftmax``.
    BatchNorm statistics reduce over ``(batch, height, width)``.

    Args:
      n_classes: number of classes; the output's last axis.
      widths: channels per stage; even numbers (two streams of half each).
      n_blocks_per_stage: reversible blocks per stage, one entry per width.
      mode: ``'train'`` (BatchNorm uses batch statistics and updates its moving averages)
        or ``'eval'``/``'predict'`` (moving averages).

    Returns:
      A `Serial`: ``float32[batch, height, width, c] -> float32[batch, n_classes]``.

    Raises:
      ValueError: when a width is odd, a block count negative, or the two sequences
        differ in length.
    """
    _check_widths(widths, n_blocks_per_stage)
    layers: list[Layer] = [Conv(widths[0], (3, 3), padding="SAME")]
    for stage, (width, n_blocks) in enumerate(zip(widths, n_blocks_per_stage, strict=True)):
        if stage > 0:
            layers += [BatchNorm(mode=mode), Relu(),
                       Conv(width, (3, 3), strides=(2, 2), padding="SAME")]
        blocks = [_reversible_block(width // 2, mode) for _ in range(n_blocks)]
        layers += [Split(2, axis=-1), ReversibleSerial(blocks), Concatenate(axis=-1)]
    layers += [BatchNorm(mode=mode), Relu(), Mean(axis=(1, 2)), Dense(n_classes),
               LogSoftmax()]
    model = Serial(layers, name="RevNet")
    model.n_classes = n_classes  # Read by the training loop to check the targets.
    return model
