"""The plan of a block trainer's step: its ops, in order, each with the program it runs.

Every op runs a `Run`: ``period`` layers repeated ``repeats`` times. A lone layer is a run
of one repetition of itself; consecutive reversible layers of equal structure
(`revtrain.trainers.block.scan_programs.find_runs`) are one run of two or more, which
runs as one ``lax.scan`` each way (`revtrain.trainers.block.scan_programs`), so the number
of ops of a step does not grow with depth. Three kinds of op run them:

* ``FORWARD``, for every run but the loss, in order;
* ``LOSS``, the loss layer's fbo;
* ``BACKWARD``, block by block in reverse, for each run from the last to the first: its
  input and the input's cotangent, and its gradient handed to the op's finisher.

Where a backward op's input comes from is its run's ``kept``: the offsets of the layers
whose input the forward pass kept. A lone layer whose input is kept -- every block's
standard layer (the block's input) and every ``keep_every``-th reversible layer -- has its
whole input stack stashed before its forward op, and its backward op recomputes the layer
from that stash (`Run.from_stash`); any other layer's backward op reconstructs its input
from its output (RevNet), a scanned run's kept layers excepted, which recompute from the
copies its forward scan kept.

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
from revtrain.layers.scan import serial_arity
from revtrain.trainers.block.finishers import NORM, UPDATE, Finisher


class OpKind(enum.StrEnum):
    """What an op runs (a string enum: ``OpKind.FORWARD == 'forward'``)."""

    FORWARD = "forward"  # A run's forward pass (a lone layer's, or one lax.scan).
    LOSS = "loss"  # The loss layer's fbo.
    BACKWARD = "backward"  # A run's input and its cotangent, each gradient to the finisher.


class Run(NamedTuple):
    """What an op runs: ``period`` layers (the group) repeated ``repeats`` times. A lone
    layer is a run of one repetition of itself (``Run(i, 1, 1)``); a run of two or more
    repetitions is consecutive reversible layers of one block, each repetition of the same
    structure, shapes and dtypes as the first (`revtrain.layers.scan`'s rule), run as one
    scan.

    Attributes:
      start: the first flat layer of the run.
      period: layers in the group.
      repeats: repetitions of the group (>= 1).
      n_items: stack items a scanned group takes and leaves (the scan's carry; the items
        below them pass through untouched); 0 for a lone layer, whose arity is its own.
      kept: offsets from ``start`` of the layers whose input is kept (block inputs and
        ``keep_every``), filled in by `build_schedule`; a scan's ``k``-th copy is the
        input of layer ``start + kept[k]``.
    """

    start: int
    period: int
    repeats: int
    n_items: int = 0
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

    @property
    def from_stash(self) -> bool:
        """A lone layer whose input is kept: its whole input stack is stashed before its
        forward op and its backward op recomputes the layer from it (a scanned run keeps
        copies of its kept layers' inputs instead, which its own programs take)."""
        return self.repeats == 1 and bool(self.kept)


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
      run: the `Run` it runs (a lone layer's: ``Run(i, 1, 1)``), ``kept`` filled in.
      block: the block index (``-1`` for the loss).
      label: what observers see, e.g. ``'forward/layer3'``, ``'backward/layer3'``,
        ``'norm/backward/layer3'``, ``'forward/layers2-5'``.
      finisher: what a backward op does with its layer's gradient: `UPDATE` (the
        optimizer step), or `NORM` for the ops of the gradient-norm pass (exact
        global-norm clipping), which compute its squared norm and update nothing; forward
        ops carry `UPDATE` and never ask it.
    """

    kind: OpKind
    run: Run
    block: int
    label: str
    finisher: Finisher = UPDATE

    @property
    def layer(self) -> int:
        """The run's first flat layer."""
        return self.run.start


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
      runs: `Run` s of two or more repetitions of reversible layers to scan (``kept`` is
        filled in here): each is one ``FORWARD`` and one ``BACKWARD`` op; every other
        layer is a run of one.

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
        block_ops = [_ops(Run(i, 1, 1, 0, kept=(0,)), b)]  # The block input, stashed.
        p = 0
        while p < n_rev:
            run = by_start.get(i + 1 + p, Run(i + 1 + p, 1, 1, 0))
            n = run.stop - run.start
            run = run._replace(kept=tuple(
                q for q in range(n) if is_keep_point(p + q, keep_every)))
            block_ops.append(_ops(run, b))
            p += n
        forward += [f for f, _ in block_ops]
        backward = [g for _, g in reversed(block_ops)] + backward
        i += 1 + n_rev
    update = [Op(OpKind.LOSS, Run(i, 1, 1, 0), -1, f"loss/layer{i}")] + backward
    norm = [op._replace(finisher=NORM, label=f"{NORM.label}{op.label}") for op in update]
    return tuple(forward + (norm if clip_global_norm else []) + update)


def _ops(run: Run, block: int) -> tuple[Op, Op]:
    """The forward and backward op of ``run`` in ``block``."""
    name = f"layer{run.start}" if run.repeats == 1 else f"layers{run.start}-{run.stop - 1}"
    return (Op(OpKind.FORWARD, run, block, f"forward/{name}"),
            Op(OpKind.BACKWARD, run, block, f"backward/{name}"))


def runs_of(schedule: Sequence[Op]) -> tuple[Run, ...]:
    """The runs ``schedule`` scans (two or more repetitions, ``kept`` filled in), in order,
    each once."""
    return tuple(dict.fromkeys(op.run for op in schedule if op.run.repeats > 1))


class PlannedOp(NamedTuple):
    """An op of the plan: what runs, on which layer, and where a phase begins.

    Attributes:
      op: the `Op`.
      layer: the flat layer it runs (``layers[op.layer]``; a scanned run's first layer).
      program: its compiled function, or None for a forward op that only reorders stack
        items (a `ReversibleSelect`: no weights, no state, no rng), which the executor
        does on the arrays without dispatching anything.
      phase: the observer phase that begins with this op (``'loss_start'``,
        ``'backward_start'``) or None.
      arity: ``(n_in, n_out)``, the stack items the run takes and leaves
        (`revtrain.layers.scan.serial_arity` of its layers).
    """

    op: Op
    layer: Layer
    program: Callable[..., Any] | None
    phase: str | None
    arity: tuple[int, int]


def reorders_only(op: Op, layer: Layer) -> bool:
    """A lone layer's forward op that only permutes stack items: run on the host, no
    program."""
    return (op.kind == OpKind.FORWARD and op.run.repeats == 1
            and isinstance(layer, ReversibleSelect))


def build_plan(layers: Sequence[Layer], schedule: Sequence[Op],
               program: Callable[[Op, Layer], Callable[..., Any]]) -> tuple[PlannedOp, ...]:
    """Pairs every op of ``schedule`` with its layer, program and phase.

    Args:
      layers: the flat layers.
      schedule: from `build_schedule`.
      program: ``(op, layer) -> compiled function`` (``layer`` is its run's first layer
        and ``op.run`` says which layers it runs).

    Returns:
      One `PlannedOp` per op, in order; the first ``LOSS`` op starts ``'loss_start'``
      and the op after it ``'backward_start'``.
    """
    loss_at = next(k for k, op in enumerate(schedule) if op.kind == OpKind.LOSS)
    phases = {loss_at: "loss_start", loss_at + 1: "backward_start"}
    return tuple(
        PlannedOp(op, layers[op.layer],
                  None if reorders_only(op, layers[op.layer]) else program(op, layers[op.layer]),
                  phases.get(k), serial_arity(layers[op.run.start:op.run.stop]))
        for k, op in enumerate(schedule))


__all__ = ["Op", "OpKind", "PlannedOp", "Run", "build_plan", "build_schedule", "reorders_only",
           "runs_of", "windows"]
