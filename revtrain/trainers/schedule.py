"""The schedule of a block trainer's step: a list of ops built once, at construction.

For the flat layers ``[std_0, *rev_0, std_1, *rev_1, ..., loss]`` one step is: a
``forward`` op for every layer but the loss, in order (the first op of each block stashes
the block's input stack); one ``loss`` op (the loss layer's fbo); then, block by block in
reverse, a ``reverse`` op (reverse-and-fbo) for each reversible layer from the last to the
first, and an ``fbo`` op for the block's standard layer (which unstashes the block input).
Stores look ahead in the same list to prefetch (`revtrain.trainers.stores.HostStore`), so
nothing keeps the step's position by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from revtrain.trainers.fbo import FBO, FORWARD, LOSS, REVERSE


class Op(NamedTuple):
    """One op of a step.

    Attributes:
      kind: ``'forward'``, ``'loss'``, ``'reverse'`` or ``'fbo'``.
      layer: the flat layer index.
      block: the block index (``-1`` for the loss).
      label: what observers see, e.g. ``'forward/layer3'``, ``'backward/layer3'``.
      starts_block: True for the forward op of a block's standard layer (stash first).
    """

    kind: str
    layer: int
    block: int
    label: str
    starts_block: bool = False


def build_schedule(block_sizes: Sequence[int]) -> tuple[Op, ...]:
    """The ops of one step for blocks of ``block_sizes[b]`` reversible layers each.

    Args:
      block_sizes: the number of reversible layers of each block; the flat layers are
        ``sum(1 + n for n in block_sizes) + 1`` (the last is the loss layer).

    Returns:
      A tuple of `Op`: forward ops, the loss op, then the backward ops.
    """
    forward, backward, i = [], [], 0
    for b, n_rev in enumerate(block_sizes):
        forward.append(Op(FORWARD, i, b, f"forward/layer{i}", starts_block=True))
        forward += [Op(FORWARD, j, b, f"forward/layer{j}") for j in range(i + 1, i + 1 + n_rev)]
        block_backward = [Op(REVERSE, j, b, f"backward/layer{j}")
                          for j in range(i + n_rev, i, -1)]
        backward = block_backward + [Op(FBO, i, b, f"backward/layer{i}")] + backward
        i += 1 + n_rev
    return tuple(forward + [Op(LOSS, i, -1, f"loss/layer{i}")] + backward)
