"""The abstract ledger: one training step's peak device bytes, accounted without running.

`revtrain.memory.MemoryLedger` measures a real step: at each dispatch, the arrays live on
the device plus the dispatched program's temporaries and its outputs not aliased to
donated inputs (XLA's ``memory_analysis``). `AbstractLedger` gives the same sum for a step
walked on abstract values (a trainer's ``walk_abstract``), so nothing of model size is
allocated:

* each program is lowered and compiled for the devices it will run on -- the executable a
  step would run, whose buffer assignment gives its temporaries, outputs and aliasing;
* what a program returns becomes a tracked abstract value (`LiveValues`), alive while the
  step holds a Python reference to it, as a device buffer is (the executor drops what a
  donating call consumed, as it does with arrays);
* the trainer's own values are counted where the trainer keeps them: ``resident`` (every
  layer's weights, slots and state for `Trainer` and `ReversibleSerialTrainer`; a window
  of ops' for `MemoryEfficientTrainer`, `revtrain.trainers.block.precompile`).

Each row splits the bytes in use while a program runs into ``resident`` (the trainer's
values), ``transient`` (the step's tracked values: batch, stack, cotangents, stashes, new
states), ``temp`` (the program's temporaries) and ``outputs`` (its non-aliased outputs).
Like the ledger it ignores allocator fragmentation and runtime buffers outside ``temp``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from revtrain.parallel.placement import Placement
from revtrain.parallel.transfers import abstract_device_bytes
from revtrain.planning.cost import Work
from revtrain.trainers.block.precompile import placed_arguments
from revtrain.trainers.common.protocols import ResidentBytes


class _Live(jax.ShapeDtypeStruct):
    """A tracked abstract value: weakly referenced and, like a buffer, equal only to
    itself (two values of one shape are two buffers)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__


def _plain(tree: Any) -> Any:
    """``tree`` with its tracked leaves (and arrays) as plain `jax.ShapeDtypeStruct` s."""
    def plain(a):
        if isinstance(a, _Live | jax.Array):  # A small real argument (an index) too.
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding,
                                        weak_type=a.weak_type)
        return a
    return jax.tree.map(plain, tree)


class LiveValues:
    """The abstract values a walked step holds, by identity (weak references).

    `track` turns a tree's leaves into tracked values; `bytes` sums the per-device bytes
    of those still referenced anywhere; `drop` forgets some (values a program consumed,
    or released ones).
    """

    def __init__(self):
        self._live: weakref.WeakSet[_Live] = weakref.WeakSet()

    def track(self, tree: Any) -> Any:
        def tracked(a):
            if not isinstance(a, jax.ShapeDtypeStruct):
                return a  # None, or a host value.
            live = _Live(a.shape, a.dtype, sharding=a.sharding, weak_type=a.weak_type)
            self._live.add(live)
            return live
        return jax.tree.map(tracked, tree)

    def drop(self, tree: Any) -> None:
        for leaf in jax.tree.leaves(tree):
            if isinstance(leaf, _Live):
                self._live.discard(leaf)

    def bytes(self) -> int:
        return abstract_device_bytes(list(self._live))


class LedgerRow(NamedTuple):
    """The bytes one device holds while one program runs (or at a phase boundary).

    Attributes:
      label: the dispatch's label (e.g. ``'fbo layer 3'``, ``'train_step'``).
      resident: the trainer's weights, slots and state on the device (`ResidentBytes`).
      transient: the step's other live values (batch, activations, cotangents, stashes).
      temp: the program's temporaries (``memory_analysis().temp_size_in_bytes``).
      outputs: its outputs not aliased to donated inputs.
    """

    label: str
    resident: ResidentBytes
    transient: int
    temp: int
    outputs: int

    @property
    def total(self) -> int:
        return sum(self.resident) + self.transient + self.temp + self.outputs


class _Program(NamedTuple):
    temp: int
    outputs: int
    out_info: Any
    work: Work


class AbstractLedger:
    """A dispatcher (`revtrain.trainers.common.dispatch.Dispatcher`) that compiles each
    program of an abstract step and accounts for the bytes in use at each dispatch.

    Args:
      placement: the trainer's placement (arguments without a sharding get the one their
        position has: per device for an op's first argument, else replicated).
      resident: ``() -> ResidentBytes``, the trainer's bytes on the device now (an
        attribute: the caller may set it once the store is built).
      cost: ``jaxpr -> Work``, the per-device work of one call of a program with that
        jaxpr (`revtrain.planning.cost.jaxpr_work`), or None.

    Attributes:
      rows: one `LedgerRow` per dispatch and phase, in order.
      values: the `LiveValues` the walk holds (a store's device copies go here too).
      work: the summed `revtrain.planning.cost.Work` of the dispatched programs.
      n_dispatches: programs dispatched in the step.
      n_programs: distinct programs compiled.
      compile_s: wall seconds spent lowering and compiling.
      exact_donation: True: the block executor donates here what the programs donate (a
        recording dispatcher gets a superset, to compile every copy a step can make).
    """

    exact_donation = True

    def __init__(self, placement: Placement, resident: Callable[[], ResidentBytes],
                 cost: Callable[[Any], Work] | None = None):
        self.rows: list[LedgerRow] = []
        self.values = LiveValues()
        self.work = Work()
        self.n_dispatches = 0
        self.compile_s = 0.0
        self.resident = resident
        self._cost = cost
        self._placement = placement
        self._programs: dict[Any, _Program] = {}

    @property
    def n_programs(self) -> int:
        return len(self._programs)

    @property
    def peak(self) -> LedgerRow:
        """The row with the most bytes (a ``'start'`` row of zeros before any)."""
        start = LedgerRow("start", ResidentBytes(), 0, 0, 0)
        return max(self.rows, key=lambda row: row.total, default=start)

    def _program(self, fn: Callable, args: tuple) -> _Program:
        leaves, treedef = jax.tree.flatten(args)
        key = (id(fn), treedef, tuple(
            (a.shape, str(a.dtype), a.sharding, a.weak_type)
            if isinstance(a, jax.ShapeDtypeStruct) else a for a in leaves))
        if key not in self._programs:
            start = time.perf_counter()
            traced = fn.trace(*args)  # Traced once: the work is counted on its jaxpr.
            work = Work() if self._cost is None else self._cost(traced.jaxpr)
            compiled = traced.lower().compile()
            self.compile_s += time.perf_counter() - start
            stats = compiled.memory_analysis()
            alias = getattr(stats, "alias_size_in_bytes", 0)
            self._programs[key] = _Program(int(stats.temp_size_in_bytes),
                                           int(max(stats.output_size_in_bytes - alias, 0)),
                                           compiled.out_info, work)
        return self._programs[key]

    def _dispatch(self, label: str, fn: Callable, args: tuple, grouped: bool) -> Any:
        plain = placed_arguments(_plain(args), self._placement, grouped)
        program = self._program(fn, plain)
        self.rows.append(LedgerRow(label, self.resident(), self.values.bytes(),
                                   program.temp, program.outputs))
        self.work += program.work
        self.n_dispatches += 1
        out = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                          sharding=a.sharding),
                           program.out_info)
        return self.values.track(out)

    def dispatch(self, label: str, program: Callable, *args: Any) -> Any:
        return self._dispatch(label, program, args, grouped=True)

    def call(self, fn: Callable, *args: Any) -> Any:
        return self._dispatch(getattr(fn, "__name__", "call"), fn, args, grouped=False)

    def phase(self, label: str) -> None:
        self.rows.append(LedgerRow(label, self.resident(), self.values.bytes(), 0, 0))

    def release(self, tree: Any) -> None:
        self.values.drop(tree)


__all__ = ["AbstractLedger", "LedgerRow", "LiveValues", "ResidentBytes"]
