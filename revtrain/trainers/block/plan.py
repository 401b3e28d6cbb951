"""The plan of a block trainer's step: its ops, in order, each with the program it runs.

For the flat layers ``[std_0, *rev_0, std_1, *rev_1, ..., loss]`` one step is: a
``FORWARD`` op for every layer but the loss, in order (the first op of each block stashes
the block's input stack, and so does every ``keep_every``-th reversible layer's); one
``LOSS`` op (the loss layer's fbo); then, block by block in reverse, a ``REVERSE`` op
(reverse-and-fbo) for each reversible layer from the last to the first -- an ``FBO`` op
instead for a reversible layer whose input was stashed -- and an ``FBO`` op for the block's
standard layer (which unstashes the block input).

A `Run` of consecutive reversible layers of equal structure (a group of ``period`` layers
repeated ``repeats`` times; `revtrain.trainers.block.scan_programs.find_runs`) is one
``SCAN_FORWARD`` op and one ``SCAN_REVERSE`` op instead of one op per layer: each runs the
whole run as one ``lax.scan`` (`revtrain.trainers.block.scan_programs`), so the number of ops of
a step does not grow with depth. Its ``keep_every`` copies are the scan's: the forward op
stashes them all at once, the reverse op recomputes those layers from them.

Each backward op carries its finisher (`revtrain.trainers.block.finishers`): what it does
with its layer's gradient. With exact global-norm clipping the loss and backward ops run
twice: first with the `NORM` finisher, which computes each layer's squared gradient norm
and updates nothing, then with `UPDATE`, which scales each layer's gradient by the global
clipping factor.

`build_schedule` gives the ops alone (stores look ahead in them to prefetch:
`revtrain.trainers.block.host_store.HostStore`); `build_plan` pairs each op with its layer, its
compiled program (`revtrain.trainers.block.programs.ProgramCache`) and the phase it
starts. The plan is built once per trainer; `revtrain.trainers.block.executor.run_step` runs it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from revtrain.layers.base import Layer
from revtrain.layers.blocks import is_keep_point
from revtrain.layers.reversible import ReversibleSelect
from revtrain.trainers.block.finishers import NORM, UPDATE, Finisher


class OpKind(enum.StrEnum):
    """What an op runs (a string enum: ``OpKind.FORWARD == 'forward'``)."""

    FORWARD = "forward"  # The layer's forward pass.
    LOSS = "loss"  # The loss layer's fbo.
    REVERSE = "reverse"  # A reversible layer's reverse-and-fbo (input reconstructed).
    FBO = "fbo"  # A layer's fbo, recomputed from its stashed input.
    SCAN_FORWARD = "scan_forward"  # A run's forward passes, one lax.scan.
    SCAN_REVERSE = "scan_reverse"  # A run's reverse-and-fbos (and kept-copy fbos), one scan.


class Run(NamedTuple):
    """Consecutive reversible layers of one block run as one scan: ``period`` layers (the
    group) repeated ``repeats`` times, each repetition of the same structure, shapes and
    dtypes as the first (`revtrain.layers.scan`'s rule).

    Attributes:
      start: the first flat layer of the run.
      period: layers in the group.
      repeats: repetitions of the group (>= 2).
      n_items: stack items the group takes and leaves (the scan's carry); the items
        below them pass through untouched.
      kept: offsets from ``start`` of the layers whose input is kept (``keep_every``),
        filled in by `build_schedule`; the scan's ``k``-th copy is the input of layer
        ``start + kept[k]``.
    """

    start: int
    period: int
    repeats: int
    n_items: int
    kept: tuple[int, ...] = ()

    @property
    def stop(self) -> int:
        """One past the last flat layer of the run."""
        return self.start + self.period * self.repeats

    @property
    def layers(self) -> range:
        """The flat layers of the run, in order."""
        return range(self.start, self.stop)

    def members(self, j: int) -> range:
        """The flat layers at position ``j`` of the group, one per repetition."""
        return range(self.start + j, self.stop, self.period)


def windows(runs: Sequence[Run], window: int) -> tuple[Run, ...]:
    """``runs`` cut into runs of at most ``window`` repetitions of their group, in order.

    A store that brings each scanned run's values to the devices whole
    (`revtrain.trainers.block.host_store.HostStore`) holds one window at a time instead of the
    run. A last piece of a single repetition is no run (a scan needs two): its layers run
    one program each.

    Args:
      runs: from `revtrain.trainers.block.scan_programs.find_runs`.
      window: repetitions per piece, >= 2.

    Raises:
      ValueError: for ``window < 2``.
    """
    if window < 2:
        raise ValueError(f"window={window} must be >= 2 repetitions (a scan of one "
                         f"repetition is one program per layer: use no window)")
    pieces = []
    for run in runs:
        for first in range(0, run.repeats, window):
            repeats = min(window, run.repeats - first)
            if repeats >= 2:
                pieces.append(run._replace(start=run.start + first * run.period,
                                           repeats=repeats))
    return tuple(pieces)


class Op(NamedTuple):
    """One op of a step.

    Attributes:
      kind: an `OpKind`.
      layer: the flat layer index.
      block: the block index (``-1`` for the loss).
      label: what observers see, e.g. ``'forward/layer3'``, ``'backward/layer3'``,
        ``'norm/backward/layer3'``.
      starts_block: True for the forward op of a block's standard layer (stash first).
      keep_point: True for the forward op of a reversible layer whose input is stashed
        (every ``keep_every``-th of a block) and for its ``FBO`` op, which recomputes the
        layer from that exact copy instead of reversing it.
      finisher: what a backward op does with its layer's gradient: `UPDATE` (the
        optimizer step), or `NORM` for the ops of the gradient-norm pass (exact
        global-norm clipping), which compute its squared norm and update nothing; forward
        ops carry `UPDATE` and never ask it.
      run: the `Run` of a ``SCAN_FORWARD`` or ``SCAN_REVERSE`` op (``layer`` is its
        first layer), else None.
    """

    kind: OpKind
    layer: int
    block: int
    label: str
    starts_block: bool = False
    keep_point: bool = False
    finisher: Finisher = UPDATE
    run: Run | None = None


def _runs_by_start(runs: Sequence[Run], block_sizes: Sequence[int]) -> dict[int, Run]:
    """``{start: run}`` after checking each run lies inside one block's reversible layers
    and no two overlap."""
    spans, i = [], 0
    for n_rev in block_sizes:
        spans.append((i + 1, i + 1 + n_rev))
        i += 1 + n_rev
    by_start, taken = {}, set()
    for run in runs:
        if run.repeats < 2 or run.period < 1 or not any(
                a <= run.start and run.stop <= b for a, b in spans):
            raise ValueError(f"{run} is not two or more repetitions inside one block's "
                             f"reversible layers {spans}; pass runs from find_runs")
        if taken & set(run.layers):
            raise ValueError(f"{run} overlaps another run; pass runs from find_runs")
        taken |= set(run.layers)
        by_start[run.start] = run
    return by_start


def _run_label(run: Run) -> str:
    return f"layers{run.start}-{run.stop - 1}"


def build_schedule(block_sizes: Sequence[int], keep_every: int | None = None,
                   clip_global_norm: bool = False, runs: Sequence[Run] = ()) -> tuple[Op, ...]:
    """The ops of one step for blocks of ``block_sizes[b]`` reversible layers each.

    Args:
      block_sizes: the number of reversible layers of each block; the flat layers are
        ``sum(1 + n for n in block_sizes) + 1`` (the last is the loss layer).
      keep_every: stash the input of reversible layer ``p`` of a block (counting from 0)
        when ``p > 0`` and ``p % keep_every == 0``; None keeps only block inputs.
      clip_global_norm: prepend the norm pass (loss and backward ops with the `NORM`
        finisher) to the update pass.
      runs: `Run` s of reversible layers to scan (``kept`` is filled in here): each is one
        ``SCAN_FORWARD`` and one ``SCAN_REVERSE`` op instead of an op per layer.

    Returns:
      A tuple of `Op`: forward ops, the loss op, then the backward ops (twice, the first
      time with the `NORM` finisher, when ``clip_global_norm``).

    Raises:
      ValueError: for ``keep_every < 1``, or a run that is not inside one block's
        reversible layers or overlaps another.
    """
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every={keep_every} must be >= 1 or None")
    by_start = _runs_by_start(runs, block_sizes)
    forward, backward, i = [], [], 0
    for b, n_rev in enumerate(block_sizes):
        forward.append(Op(OpKind.FORWARD, i, b, f"forward/layer{i}", starts_block=True))
        block_backward, p = [], 0
        while p < n_rev:
            j = i + 1 + p
            run = by_start.get(j)
            if run is not None:
                n = run.stop - run.start
                run = run._replace(kept=tuple(
                    q for q in range(n) if is_keep_point(p + q, keep_every)))
                forward.append(Op(OpKind.SCAN_FORWARD, j, b, f"forward/{_run_label(run)}",
                                  run=run))
                block_backward.insert(0, Op(OpKind.SCAN_REVERSE, j, b,
                                            f"backward/{_run_label(run)}", run=run))
                p += n
                continue
            keep = is_keep_point(p, keep_every)
            forward.append(Op(OpKind.FORWARD, j, b, f"forward/layer{j}", keep_point=keep))
            kind = OpKind.FBO if keep else OpKind.REVERSE
            block_backward.insert(0, Op(kind, j, b, f"backward/layer{j}", keep_point=keep))
            p += 1
        backward = block_backward + [Op(OpKind.FBO, i, b, f"backward/layer{i}")] + backward
        i += 1 + n_rev
    update = [Op(OpKind.LOSS, i, -1, f"loss/layer{i}")] + backward
    norm = [op._replace(finisher=NORM, label=f"{NORM.label}{op.label}") for op in update]
    return tuple(forward + (norm if clip_global_norm else []) + update)


def runs_of(schedule: Sequence[Op]) -> tuple[Run, ...]:
    """The runs ``schedule`` scans (``kept`` filled in), in order, each once."""
    return tuple(dict.fromkeys(op.run for op in schedule if op.run is not None))


class PlannedOp(NamedTuple):
    """An op of the plan: what runs, on which layer, and where a phase begins.

    Attributes:
      op: the `Op`.
      layer: the flat layer it runs (``layers[op.layer]``; a scan op's first layer).
      program: its compiled function, or None for a forward op that only reorders stack
        items (a `ReversibleSelect`: no weights, no state, no rng), which the executor
        does on the arrays without dispatching anything.
      phase: the observer phase that begins with this op (``'loss_start'``,
        ``'backward_start'``) or None.
    """

    op: Op
    layer: Layer
    program: Callable[..., Any] | None
    phase: str | None


def reorders_only(op: Op, layer: Layer) -> bool:
    """A forward op that only permutes stack items: run on the host, no program."""
    return op.kind == OpKind.FORWARD and isinstance(layer, ReversibleSelect)


def build_plan(layers: Sequence[Layer], schedule: Sequence[Op],
               program: Callable[[Op, Layer], Callable[..., Any]]) -> tuple[PlannedOp, ...]:
    """Pairs every op of ``schedule`` with its layer, program and phase.

    Args:
      layers: the flat layers.
      schedule: from `build_schedule`.
      program: ``(op, layer) -> compiled function`` (e.g. ``ProgramCache.get``; for a scan
        op, ``layer`` is its run's first layer and ``op.run`` says which layers it runs).

    Returns:
      One `PlannedOp` per op, in order; the first ``LOSS`` op starts ``'loss_start'``
      and the op after it ``'backward_start'``.
    """
    loss_at = next(k for k, op in enumerate(schedule) if op.kind == OpKind.LOSS)
    phases = {loss_at: "loss_start", loss_at + 1: "backward_start"}
    return tuple(
        PlannedOp(op, layers[op.layer],
                  None if reorders_only(op, layers[op.layer]) else program(op, layers[op.layer]),
                  phases.get(k))
        for k, op in enumerate(schedule))


__all__ = ["Op", "OpKind", "PlannedOp", "Run", "build_plan", "build_schedule", "reorders_only",
           "runs_of", "windows"]
