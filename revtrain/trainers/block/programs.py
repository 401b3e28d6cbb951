"""One builder and one cache for every program of a block step: a program runs a `Run`.

A scanned run (`revtrain.trainers.block.plan.Run`: ``period`` layers repeated
``repeats >= 2`` times) runs as one ``lax.scan`` each way
(`revtrain.trainers.block.scan_programs`); a lone layer is a run of one repetition of
itself (`lone`), whose program calls the layer's body once on the layer's own values
(`revtrain.trainers.block.layer_programs`), so its lowered text is today's per-layer
program's (`tests/trainers/block/test_programs.py` checks it, name for name). `make_program`
is the one builder; `ProgramCache` the one cache, keyed alike for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import optax

from revtrain.layers.base import Layer
from revtrain.parallel.placement import Placement
from revtrain.trainers.block.finishers import UPDATE, Finisher
from revtrain.trainers.block.layer_programs import layer_program
from revtrain.trainers.block.plan import Op, OpKind, Run
from revtrain.trainers.block.scan_programs import scan_program


def lone(op: Op) -> Run:
    """The run ``op`` runs: its scanned run, or one repetition of its lone layer."""
    return Run(op.layer, 1, 1, 0) if op.run is None else op.run


def make_program(kind: OpKind, group: Sequence[Layer], run: Run,
                 optimizer: optax.GradientTransformation, placement: Placement,
                 finisher: Finisher = UPDATE) -> tuple[Callable, Callable]:
    """The jitted ``kind`` program of ``run`` (whose group is ``group``) and its
    trace-counted function: a run of one repetition calls its layer's body once
    (`revtrain.trainers.block.layer_programs.layer_program`), a longer one scans
    (`revtrain.trainers.block.scan_programs.scan_program`); see those for the arguments,
    outputs and donation of each kind.

    Raises:
      ValueError: for a run of one repetition of several layers (a scan needs two
        repetitions, a lone program one layer), or a kind the run's length does not run.
    """
    if run.repeats >= 2:
        return scan_program(kind, group, run, optimizer, placement, finisher)
    if run.period != 1 or len(group) != 1:
        raise ValueError(f"{run} of {len(group)} layers is neither one layer nor two or "
                         f"more repetitions; split it into lone layers")
    return layer_program(kind, group[0], optimizer, placement, finisher)


def _structure(layer: Layer) -> Any:
    key = layer.structure_key
    return ("object", id(layer)) if key is None else key


class ProgramCache:
    """Compiled programs, one per (kind, finisher, group structure, period, repeats, kept
    offsets): layers, runs of equal groups, repetitions and copies share them (the first
    layer is an argument, ``Shared.index``).

    Two layers with equal, non-None `Layer.structure_key` compute the same function of
    their arguments, so they share programs; a layer whose key is None (its identity
    cannot be proven: a class defined inside a function, an ``Fn`` of a lambda) gets
    programs of its own: a cache key must cover everything the cached function depends
    on, or the cache must not share. The cache keeps the layers it keyed by identity
    alive, so their ids are never reused.

    Args:
      placement: the trainer's placement.
      optimizer: the per-layer transformation (the first layer's: ``optimizer_fn`` must
        return equivalent ones on every call).
    """

    def __init__(self, placement: Placement, optimizer: optax.GradientTransformation):
        self._placement, self._optimizer = placement, optimizer
        self._programs: dict[Any, tuple[Callable, Callable, str, tuple]] = {}

    def get(self, op: Op, group: Sequence[Layer]) -> Callable:
        """The program of ``op`` whose run's group (a lone layer: itself) is ``group``,
        built once."""
        run = lone(op)
        key = (op.kind, op.finisher, tuple(map(_structure, group)), run.period, run.repeats,
               run.kept)
        if key not in self._programs:
            program, counted = make_program(op.kind, group, run, self._optimizer,
                                            self._placement, finisher=op.finisher)
            name = f"{op.finisher.trace_prefix}{op.kind}/{group[0].name}"
            if run.repeats > 1:
                name = f"{name}x{run.period}x{run.repeats}"
            self._programs[key] = (program, counted, name, tuple(group))
        return self._programs[key][0]

    @property
    def n_built(self) -> int:
        """How many distinct programs were built."""
        return len(self._programs)

    def trace_counts(self) -> dict[str, int]:
        """``{'kind/layer_name#k'` (a scan's ``'kind/layer_name x period x repeats#k'``):
        times traced}`` for every built program."""
        return {f"{name}#{k}": eqx.debug.get_num_traces(counted)
                for k, (_, counted, name, _) in enumerate(self._programs.values())}


__all__ = ["ProgramCache", "lone", "make_program"]
