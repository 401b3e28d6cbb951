"""Compiling a block trainer's per-layer programs ahead of the first step.

A block trainer's first step would trace and compile each distinct per-layer program (one
per kind and layer structure, `revtrain.trainers.block.programs.ProgramCache`) the first
time the plan reaches it, one after another. `BlockTrainer.precompile` instead runs the step once
*abstractly* -- the same executor (`revtrain.trainers.block.executor.run_step`) on
`jax.ShapeDtypeStruct` values carrying the shardings the real values have, with an
`AbstractStore` and a `RecordingDispatcher` that calls ``jax.eval_shape`` -- which traces
each program once and gives the exact abstract arguments of every call; then
`revtrain.trainers.block.compiling.compile_all` lowers and compiles the distinct
``(program, arguments)`` pairs, side by side in a thread pool when JAX's persistent
compilation cache is off, one after another when it is on
(`revtrain.trainers.block.compiling.compile_workers` says why).
``jit(...).lower(...).compile()`` fills the same in-process caches a call fills, so the
step that follows calls the already compiled executables: nothing is traced or compiled
again (the trainers' ``trace_counts`` and a "no compile in the first step" test check it).

JAX's persistent compilation cache (`revtrain.training.use_compilation_cache`, on by
default in ``revtrain-train``) serves these compilations too: a second process with the
same model, batch shape and device count loads the executables from disk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from revtrain.parallel.placement import Placement
from revtrain.parallel.transfers import abstract_device_bytes
from revtrain.trainers.block import stacked
from revtrain.trainers.block.plan import OpKind, Run
from revtrain.trainers.common.base import abstract_batch
from revtrain.trainers.common.protocols import Params, ResidentBytes, TrainState


class CompileTimes(NamedTuple):
    """Where the time of a first step went, in seconds (wall clock).

    Attributes:
      trace_s: tracing every distinct per-layer function (the abstract walk).
      compile_s: lowering and compiling them all (`revtrain.trainers.block.compiling`).
      run_s: running the first step itself once everything was compiled (until its
        loss was ready); NaN until a step ran.
      n_programs: how many distinct programs were compiled.
    """

    trace_s: float
    compile_s: float
    run_s: float
    n_programs: int


def _sds(tree: Any, sharding: Any, lead: tuple[int, ...] = ()) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(lead + tuple(np.shape(a)),
                                                       a.dtype, sharding=sharding), tree)


class AbstractStore:
    """A `revtrain.trainers.block.stores.StepValues` of abstract values (no buffers): what
    the executor reads of a store, and nothing else (it holds no values to read back).

    Weights and slots are `jax.ShapeDtypeStruct` trees in the stores' sharding
    (`Placement.weight_shardings`: replicated, or FSDP-sharded), states
    per device (``[devices of the mesh, ...]``), as the real stores hand them to the
    compiled functions; new states are kept so that reverse ops see them; updates are
    dropped (their shapes do not change). Stashing is the identity.

    Values are keyed by `Run`, as in `revtrain.trainers.block.device_store.DeviceStore`:
    a lone layer's are its own, the layers of each scanned run one stacked entry
    (`revtrain.trainers.block.stacked`).

    Args:
      placement: the trainer's placement.
      signature: the trainer's `TrainState` of shapes and dtypes (one entry per layer).
      runs: the runs the trainer's plan scans.
    """

    def __init__(self, placement: Placement, signature: TrainState,
                 runs: Sequence[Run] = ()):
        def placed(tree):
            return jax.tree.map(lambda a, sharding: jax.ShapeDtypeStruct(
                np.shape(a), a.dtype, sharding=sharding), tree,
                placement.weight_shardings(tree))

        rows = (placement.n_global_devices,)
        in_runs = {i for run in runs for i in run.layers}
        lone = [i for i in range(len(signature.weights)) if i not in in_runs]
        # Keyed by each run's first layer: a lone layer's own values, a run's stacked.
        self._weights = {i: placed(signature.weights[i]) for i in lone}
        self._slots = {i: placed(signature.slots[i]) for i in lone}
        self._states = {i: _sds(signature.state[i], placement.per_device, rows) for i in lone}
        for run in runs:
            first = [run.start + j for j in range(run.period)]
            self._weights[run.start] = tuple(stacked.stacked_signature(
                signature.weights[i], run.repeats, placement) for i in first)
            self._slots[run.start] = tuple(stacked.stacked_signature(
                signature.slots[i], run.repeats, placement) for i in first)
            self._states[run.start] = tuple(jax.tree.map(
                lambda a, n=run.repeats: jax.ShapeDtypeStruct((*rows, n, *np.shape(a)), a.dtype,
                                               sharding=placement.per_device),
                signature.state[i]) for i in first)
        self._new_states: dict[int, Any] = {}

    def begin_step(self) -> None:
        pass

    def prepare(self, position: int) -> None:
        pass

    def weights(self, run: Run) -> Any:
        return self._weights[run.start]

    def params(self, run: Run) -> Params:
        return Params(self._weights[run.start], self._slots[run.start])

    def keep_params(self, run: Run, params: Params) -> None:
        pass

    def state(self, run: Run) -> Any:
        return self._states[run.start]

    def new_state(self, run: Run) -> Any:
        return self._new_states[run.start]

    def keep_state(self, run: Run, new_state: Any) -> None:
        self._new_states[run.start] = new_state

    def stash(self, stack: Any) -> Any:
        return stack

    def unstash(self, kept: Any) -> Any:
        return kept

    def end_forward(self, stack: Any) -> Any:
        return stack

    def finish_step(self) -> None:
        pass


class CountedStore(AbstractStore):
    """An `AbstractStore` that counts the bytes of its values, for the memory planner
    (`revtrain.planning`): `resident_bytes` is what stays on the device throughout --
    here every value, as a `revtrain.trainers.block.device_store.DeviceStore` keeps them.
    """

    def value_bytes(self, key: int, with_slots: bool = True,
                    with_state: bool = True) -> ResidentBytes:
        """Bytes one device holds of a lone layer's (or a run's, by its first layer)
        weights, slots and state."""
        return ResidentBytes(abstract_device_bytes(self._weights[key]),
                             abstract_device_bytes(self._slots[key]) if with_slots else 0,
                             abstract_device_bytes(self._states[key]) if with_state else 0)

    def all_bytes(self) -> ResidentBytes:
        """Bytes one device would hold of every layer's weights, slots and state, each
        run's once (stacked)."""
        return ResidentBytes.total(self.value_bytes(key) for key in self._weights)

    def resident_bytes(self) -> ResidentBytes:
        """`all_bytes`: what a `revtrain.trainers.block.device_store.DeviceStore` keeps on
        the device throughout."""
        return self.all_bytes()


class RecordingDispatcher:
    """A `revtrain.trainers.common.dispatch.Dispatcher` that runs nothing: it records each call
    and returns ``jax.eval_shape`` of it.

    ``jax.eval_shape`` gives outputs without shardings; the real outputs of the programs
    have those of their ``out_specs``, so each abstract argument without one gets the
    sharding its position has: per device for an op's first argument (its per-device
    arguments), replicated for the others and for every argument of `call`.

    Attributes:
      calls: ``{key: (program, abstract args)}``, one entry per distinct call.
      every_copy: True: the executor donates every consumed leaf here (a superset of a
        step's donations), so that every copy a step can make is recorded and compiled.
    """

    every_copy = True

    def __init__(self, placement: Placement):
        self.calls: dict[Any, tuple[Callable, tuple]] = {}
        self._placement = placement

    def _record(self, fn: Callable, args: tuple, grouped: bool) -> Any:
        args = placed_arguments(args, self._placement, grouped)
        leaves, treedef = jax.tree.flatten(args)
        key = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                    if isinstance(a, jax.Array) else a for a in leaves)
        self.calls.setdefault((id(fn), treedef, key), (fn, args))
        return jax.eval_shape(fn, *args)

    def dispatch(self, label: str, program: Callable, *args: Any) -> Any:
        del label
        return self._record(program, args, grouped=True)

    def call(self, fn: Callable, *args: Any) -> Any:
        return self._record(fn, args, grouped=False)

    def phase(self, label: str) -> None:
        del label

    def release(self, tree: Any) -> None:
        del tree


class AbstractHostStore(CountedStore):
    """A `CountedStore` whose values live in host memory except a window of ops', as a
    `revtrain.trainers.block.host_store.HostStore` keeps them: `resident_bytes` counts the
    weights (and, for a backward op that updates, the slots) of the current op and the
    next ``n_async_layers`` ops; an op's new weights and slots stay on the devices until
    the next op is prepared (their copy back lands then); states, stashes and the final
    activations wait on the host, and each read of them is a new device copy, made by
    ``fresh`` (the planner's, which accounts for it while the step holds it).

    Args:
      placement: the trainer's placement.
      signature: the trainer's `TrainState` of shapes and dtypes (one entry per layer).
      runs: the runs the trainer's plan scans.
      schedule: the trainer's ops (`revtrain.trainers.block.plan.Op`).
      n_async_layers: the ops prefetched ahead of the current one.
      free_accelerators_on_step: whether the final activations leave the devices.
      device: what holds the step's device values: ``track(tree) -> tree`` gives a new
        device copy of abstract values, ``drop(tree)`` frees one (the planner's
        `revtrain.planning.ledger.LiveValues`); None: nothing is accounted.
    """

    def __init__(self, placement: Placement, signature: TrainState, runs: Sequence[Run],
                 schedule: Sequence[Any], n_async_layers: int,
                 free_accelerators_on_step: bool, device: Any = None):
        super().__init__(placement, signature, runs)
        self._schedule = tuple(schedule)
        self._n_async = n_async_layers
        self._free = free_accelerators_on_step
        self._device = _Untracked() if device is None else device
        self._window: dict[Any, ResidentBytes] = {}
        self._pending: list[Any] = []

    def resident_bytes(self) -> ResidentBytes:
        return ResidentBytes.total(self._window.values())

    def prepare(self, position: int) -> None:
        for params in self._pending:  # The last op's new values landed on the host.
            self._device.drop(params)
        self._pending = []
        window = self._schedule[position:position + 1 + self._n_async]
        wanted = {op.layer for op in window}
        self._window = {k: v for k, v in self._window.items() if k in wanted}
        for op in window:
            with_slots = op.kind != OpKind.FORWARD and op.finisher.donates_values
            held = self._window.get(op.layer, ResidentBytes())
            self._window[op.layer] = ResidentBytes(*map(max, held, self.value_bytes(
                op.layer, with_slots=with_slots, with_state=False)))

    def keep_params(self, run: Run, params: Params) -> None:
        self._window.pop(run.start, None)  # Donated.
        self._pending.append(params)

    def state(self, run: Run) -> Any:
        return self._device.track(super().state(run))

    def new_state(self, run: Run) -> Any:
        return self._device.track(super().new_state(run))

    def keep_state(self, run: Run, new_state: Any) -> None:
        super().keep_state(run, _Host(new_state).tree)  # Copied home; the device copy freed.
        self._device.drop(new_state)

    def stash(self, stack: Any) -> Any:
        return _Host(stack)

    def unstash(self, kept: Any) -> Any:
        return self._device.track(kept.tree) if isinstance(kept, _Host) else kept

    def end_forward(self, stack: Any) -> Any:
        if not self._free:
            return stack
        self._window = {}
        self._device.drop(stack)
        return _Host(stack)

    def finish_step(self) -> None:
        if self._free:
            self.prepare(len(self._schedule))


class _Untracked:
    """Device values nobody accounts for (`AbstractHostStore` without a planner)."""

    @staticmethod
    def track(tree: Any) -> Any:
        return tree

    @staticmethod
    def drop(tree: Any) -> None:
        del tree


class _Host:
    """Values waiting in host memory (no device bytes): plain shapes, read back by
    ``unstash`` as a new device copy."""

    def __init__(self, tree: Any):
        self.tree = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=a.sharding, weak_type=a.weak_type), tree)


def placed_arguments(args: tuple, placement: Placement, grouped: bool) -> tuple:
    """``args`` with each abstract leaf that has no sharding given the one its position
    has: per device for an op's first argument (``grouped``: its per-device arguments),
    replicated for the others and for every argument of a plain call."""
    return tuple(_with_sharding(arg, placement.per_device if grouped and k == 0
                                else placement.replicated) for k, arg in enumerate(args))


def _with_sharding(tree: Any, sharding: Any) -> Any:
    def put(a):
        if isinstance(a, jax.ShapeDtypeStruct) and a.sharding is None:
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding,
                                        weak_type=a.weak_type)
        return a
    return jax.tree.map(put, tree)


__all__ = ["AbstractHostStore", "AbstractStore", "CompileTimes", "CountedStore",
           "RecordingDispatcher",
           "abstract_batch", "placed_arguments"]
