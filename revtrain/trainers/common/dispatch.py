"""How a trainer calls its compiled programs, and the one place observers are told.

Every trainer -- `Trainer`'s one program per step and a block trainer's plan of per-layer
or scanned programs alike -- calls its programs through a `Dispatcher`, which announces
each dispatch and each phase (``'step_start'``, ``'loss_start'``, ``'backward_start'``,
``'step_end'``) to the trainer's observers (`revtrain.trainers.common.protocols.Observer`: the
memory ledger of `revtrain.memory`, benchmarks). The `LiveDispatcher` runs the programs;
precompilation swaps in one that only traces
(`revtrain.trainers.block.precompile.RecordingDispatcher`), so the same walk of a step
serves both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from revtrain.parallel.inflight import InflightLimit
from revtrain.parallel.transfers import delete_arrays
from revtrain.trainers.common.protocols import Observer


class Dispatcher(Protocol):
    """How a trainer's step calls programs.

    ``dispatch(label, program, *args)`` calls one compiled program (``label`` is what
    observers see, e.g. ``'train_step'`` or ``'backward/layer3'``) and returns its
    outputs; ``call(fn, *args)`` a small helper program of the step (the stats summary,
    the global norm), replicated arguments only; ``phase(label)`` marks a phase boundary;
    ``release(tree)`` frees the step's transient buffers when the trainer frees
    accelerators on every step.
    """

    def dispatch(self, label: str, program: Callable, *args: Any) -> Any: ...

    def call(self, fn: Callable, *args: Any) -> Any: ...

    def phase(self, label: str) -> None: ...

    def release(self, tree: Any) -> None: ...


class LiveDispatcher:
    """Runs the programs: tells observers of each dispatch (just before it) and phase; on a
    multi-device CPU mesh, checks that a program's collectives fit XLA's client threads
    before it first runs (`InflightLimit.admit`) and bounds the programs in flight
    (`InflightLimit.note`).

    Args:
      observers: returns the trainer's current observers (read at every call, so an
        observer appended later is told too).
      inflight: the trainer's `InflightLimit`.
    """

    def __init__(self, observers: Callable[[], Sequence[Observer]], inflight: InflightLimit):
        self._observers, self._inflight = observers, inflight

    def dispatch(self, label: str, program: Callable, *args: Any) -> Any:
        for observer in self._observers():
            on_dispatch = getattr(observer, "on_dispatch", None)
            if on_dispatch is not None:
                on_dispatch(label, program, args)
        self._inflight.admit(label, program, args)
        outputs = program(*args)
        self._inflight.note(outputs)
        return outputs

    def call(self, fn: Callable, *args: Any) -> Any:
        return fn(*args)

    def phase(self, label: str) -> None:
        for observer in self._observers():
            on_phase = getattr(observer, "on_phase", None)
            if on_phase is not None:
                on_phase(label)

    def release(self, tree: Any) -> None:
        delete_arrays(tree)


__all__ = ["Dispatcher", "LiveDispatcher"]
