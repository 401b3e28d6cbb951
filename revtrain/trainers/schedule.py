"""The schedule of a block trainer's step: a list of ops built once, at construction.

For the flat layers ``[std_0, *rev_0, std_1, *rev_1, ..., loss]`` one step is: a
``forward`` op for every layer but the loss, in order (the first op of each block stashes
the block's input stack, and so does every ``keep_every``-th reversible layer's); one
``loss`` op (the loss layer's fbo); then, block by block in reverse, a ``reverse`` op
(reverse-and-fbo) for each reversible layer from the last to the first -- an ``fbo`` op
instead for a reversible layer whose input was stashed -- and an ``fbo`` op for the block's
standard layer (which unstashes the block input).

With exact global-norm clipping the loss and backward ops run twice: first as
``norm_only`` ops that compute each layer's squared gradient norm and update nothing, then
as the usual ops, which scale each layer's gradient by the global clipping factor.
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
      label: what observers see, e.g. ``'forward/layer3'``, ``'backward/layer3'``,
        ``'norm/backward/layer3'``.
      starts_block: True for the forward op of a block's standard layer (stash first).
      keep_point: True for the forward op of a reversible layer whose input is stashed
        (every ``keep_every``-th of a block) and for its ``fbo`` op, which recomputes the
        layer from that exact copy instead of reversing it.
      norm_only: True for the ops of the gradient-norm pass (exact global-norm clipping):
        they compute the layer's squared gradient norm and update nothing.
    """

    kind: str
    layer: int
    block: int
    label: str
    starts_block: bool = False
    keep_point: bool = False
    norm_only: bool = False


def _is_keep_point(position: int, keep_every: int | None) -> bool:
    return keep_every is not None and position > 0 and position % keep_every == 0


def build_schedule(block_sizes: Sequence[int], keep_every: int | None = None,
                   clip_global_norm: bool = False) -> tuple[Op, ...]:
    """The ops of one step for blocks of ``block_sizes[b]`` reversible layers each.

    Args:
      block_sizes: the number of reversible layers of each block; the flat layers are
        ``sum(1 + n for n in block_sizes) + 1`` (the last is the loss layer).
      keep_every: stash the input of reversible layer ``p`` of a block (counting from 0)
        when ``p > 0`` and ``p % keep_every == 0``; None keeps only block inputs.
      clip_global_norm: prepend the ``norm_only`` pass (loss and backward ops) to the
        update pass.

    Returns:
      A tuple of `Op`: forward ops, the loss op, then the backward ops (twice, the first
      time ``norm_only``, when ``clip_global_norm``).

    Raises:
      ValueError: for ``keep_every < 1``.
    """
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every={keep_every} must be >= 1 or None")
    forward, backward, i = [], [], 0
    for b, n_rev in enumerate(block_sizes):
        forward.append(Op(FORWARD, i, b, f"forward/layer{i}", starts_block=True))
        block_backward = []
        for p in range(n_rev):
            j, keep = i + 1 + p, _is_keep_point(p, keep_every)
            forward.append(Op(FORWARD, j, b, f"forward/layer{j}", keep_point=keep))
            block_backward.insert(0, Op(FBO if keep else REVERSE, j, b, f"backward/layer{j}",
                                        keep_point=keep))
        backward = block_backward + [Op(FBO, i, b, f"backward/layer{i}")] + backward
        i += 1 + n_rev
    update = [Op(LOSS, i, -1, f"loss/layer{i}")] + backward
    norm = [op._replace(norm_only=True, label=f"norm/{op.label}") for op in update]
    return tuple(forward + (norm if clip_global_norm else []) + update)
