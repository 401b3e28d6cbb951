"""Running a block trainer's step: one function, `run_step`, walks the plan.

Read this module with `revtrain.trainers.plan` (what the ops are) and
`revtrain.trainers.programs` (what each op's program computes): together they are the
whole step. `run_step` asks a `revtrain.trainers.protocols.ParamStore` for each op's values
and hands the new ones back, and sends every call through a `Dispatcher`: the
`LiveDispatcher` runs the programs and tells the observers; precompilation passes a
recording one (`revtrain.trainers.precompile.RecordingDispatcher`) and an abstract store,
and the same walk traces every program without running anything.

The step: forward ops move the stack up (stashing block inputs and ``keep_every`` copies);
the loss op gives the final stack's cotangent; backward ops move the stack and its
cotangent down, each reconstructing (``REVERSE``) or recomputing (``FBO``) its layer's
input and updating the layer at once. A scanned run of layers
(`revtrain.trainers.plan.Run`) is one op each way, its values one stacked key of the store
(`revtrain.trainers.scan_programs`). With exact global-norm clipping a norm-only pass
first walks the backward ops without updating, and its global norm scales every update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import equinox as eqx
import jax
import jax.numpy as jnp

from revtrain.layers.base import inputs_from_stack, outputs_onto_stack
from revtrain.trainers.inflight import InflightLimit
from revtrain.trainers.plan import Op, OpKind, PlannedOp
from revtrain.trainers.programs import (
    FboArgs,
    ForwardArgs,
    LayerStats,
    LossArgs,
    ReverseArgs,
    Shared,
)
from revtrain.trainers.protocols import Observer
from revtrain.trainers.scan_programs import ScanReverseArgs
from revtrain.trainers.stores import ParamStore
from revtrain.trainers.transfers import delete_arrays


class Dispatcher(Protocol):
    """How `run_step` calls programs.

    ``dispatch(op, program, *args)`` calls one op's program and returns its outputs;
    ``call(fn, *args)`` a small helper program of the step (the global norm), replicated
    arguments only; ``phase(label)`` marks a phase boundary (``'step_start'``,
    ``'loss_start'``, ``'backward_start'``); ``release(tree)`` frees the step's transient
    buffers when the trainer frees accelerators on every step.
    """

    def dispatch(self, op: Op, program: Callable, *args: Any) -> Any: ...

    def call(self, fn: Callable, *args: Any) -> Any: ...

    def phase(self, label: str) -> None: ...

    def release(self, tree: Any) -> None: ...


class LiveDispatcher:
    """Runs the programs: tells observers of each dispatch and phase, and bounds the
    programs in flight on a multi-device CPU mesh (`InflightLimit`).

    Args:
      observers: returns the trainer's current observers.
      inflight: the trainer's `InflightLimit`.
    """

    def __init__(self, observers: Callable[[], Sequence[Observer]], inflight: InflightLimit):
        self._observers, self._inflight = observers, inflight

    def dispatch(self, op: Op, program: Callable, *args: Any) -> Any:
        for observer in self._observers():
            on_dispatch = getattr(observer, "on_dispatch", None)
            if on_dispatch is not None:
                on_dispatch(op.label, program, args)
        self._inflight.admit(op.label, program, args)
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


@dataclasses.dataclass(frozen=True)
class BlockStep:
    """A block trainer's step as a value, built once per trainer.

    Attributes:
      plan: the ops with their layers and programs (`revtrain.trainers.plan.build_plan`).
      indices: per flat layer, its index as a replicated int32 device scalar.
      max_norm: the replicated float32 ``clip_global_norm``, or None (no clipping).
      free_transients: release the batch, stashes, final activations and cotangents at
        the end of the step (``free_accelerators_on_step``).
      summarize: ``(each op's LayerStats, in flat-layer order) -> (LayerStats of
        [n_layers] vectors, whole-model gradient norm, whole-model weight norm)``
        (`summary_program`): one program per step whatever the depth, so the step's
        results are four arrays, not two per layer.
      sqrt_of_sum: ``(squared norms: scalars, or a scanned run's vector) -> sqrt(sum)``,
        the global gradient norm of the norm-only pass (clipping); likewise jitted once.
    """

    plan: tuple[PlannedOp, ...]
    indices: tuple[jax.Array, ...]
    max_norm: jax.Array | None
    free_transients: bool
    summarize: Callable[[tuple[LayerStats, ...]], tuple[LayerStats, jax.Array, jax.Array]]
    sqrt_of_sum: Callable[[tuple[jax.Array, ...]], jax.Array]


class StepInputs(NamedTuple):
    """What one step is given, on the devices.

    Attributes:
      stack: the per-device batch ``(inputs, targets, weights, ...)``.
      rngs: uint32 key data ``[devices, n_layers, *key]``.
      lr: the replicated float32 learning rate to inject, or None.
    """

    stack: Any
    rngs: jax.Array
    lr: jax.Array | None


class StepResult(NamedTuple):
    """What a step gives back (device values; nothing is read to the host).

    Attributes:
      loss: float32 scalar, the weighted mean loss over the global batch.
      layer_stats: a `LayerStats` of float32 ``[n_layers]`` vectors: entry ``i`` is flat
        layer ``i``'s gradient norm (before clipping) and new weight norm.
      gradients_l2: float32 scalar, the L2 norm of the whole model's gradient (before
        clipping).
      weights_l2: float32 scalar, the L2 norm of the whole model's new weights.
    """

    loss: jax.Array
    layer_stats: LayerStats
    gradients_l2: jax.Array
    weights_l2: jax.Array


def _vector(parts: Sequence[jax.Array]) -> jax.Array:
    return jnp.concatenate([jnp.reshape(p, (-1,)) for p in parts])


def _summarize(pieces: tuple[LayerStats, ...]) -> tuple[LayerStats, jax.Array, jax.Array]:
    per_layer = LayerStats(*(_vector(parts) for parts in zip(*pieces, strict=True)))
    return (per_layer, *(jnp.sqrt(jnp.sum(v ** 2)) for v in per_layer))


def _sqrt_of_sum(squares: tuple[jax.Array, ...]) -> jax.Array:
    return jnp.sqrt(jnp.sum(_vector(squares)))


def summary_program(squared: bool) -> tuple[Callable, Callable]:
    """A jitted `BlockStep.sqrt_of_sum` (``squared``) or `BlockStep.summarize` and its
    trace-counted body."""
    counted = eqx.debug.assert_max_traces(_sqrt_of_sum if squared else _summarize,
                                          max_traces=None)
    return jax.jit(counted), counted


def _as_items(stack: Any) -> tuple:
    return tuple(stack) if isinstance(stack, tuple) else (stack,)


def _loss_input(p: PlannedOp, store: ParamStore, stack: Any) -> Any:
    stack = store.unstash(stack)
    n_items = len(_as_items(stack))
    if n_items != p.layer.n_in:
        raise ValueError(f"the loss layer {p.layer.name} takes {p.layer.n_in} stack items but "
                         f"the model leaves {n_items}; make the loss layer consume the "
                         f"whole stack")
    return stack


def _scan_forward(p: PlannedOp, store: ParamStore, dispatcher: Dispatcher, stack: Any,
                  inputs: StepInputs, shared: Shared, kept: dict[int, Any]) -> Any:
    """A run's forward scan; its ``keep_every`` copies are stashed under its first layer."""
    run = p.op.run
    args = ForwardArgs(inputs_from_stack(stack, run.n_items), store.state(run), inputs.rngs)
    y, new_state, copies = dispatcher.dispatch(p.op, p.program, args, store.weights(run),
                                               shared)
    store.keep_state(run, new_state)
    if copies is not None:
        kept[run.start] = store.stash(copies)
    return outputs_onto_stack(y, stack, run.n_items)


def _unshared(carry: Any, held: Any) -> Any:
    """``carry`` with each array that ``held`` or an earlier leaf of ``carry`` also holds
    replaced by a copy, so that donating ``carry`` deletes nothing still in use (a layer's
    gradient can hand back one cotangent for two stack items, a pass-through the same array
    as an item below it)."""
    seen = {id(leaf) for leaf in jax.tree.leaves(held)}

    def own(leaf):
        if isinstance(leaf, jax.Array) and id(leaf) in seen:
            leaf = jnp.copy(leaf)
        seen.add(id(leaf))
        return leaf
    return jax.tree.map(own, carry)


def _scan_reverse(p: PlannedOp, store: ParamStore, dispatcher: Dispatcher, stack: Any,
                  ct: Any, inputs: StepInputs, shared: Shared, kept: dict[int, Any],
                  kept_weights: Any, stats: dict[int, LayerStats],
                  squared_norms: list) -> tuple[Any, Any]:
    """A run's reverse scan (every layer updated, or norm-only); returns (stack, ct).

    The updating scan donates its carry (the run's output items and their cotangents): the
    stack and cotangents below the run, the stashes and the batch weights keep theirs."""
    op, run = p.op, p.op.run
    copies = None
    if run.kept:
        copies = store.unstash(kept[run.start] if op.norm_only else kept.pop(run.start))
    n = run.n_items
    carry = (inputs_from_stack(stack, n), inputs_from_stack(ct, n))
    args = ScanReverseArgs(store.state(run), store.new_state(run), inputs.rngs, copies)
    if op.norm_only:
        x, ct_x, squares = dispatcher.dispatch(op, p.program, carry, args,
                                               store.weights(run), shared)
        squared_norms.append(squares)
    else:
        held = (_as_items(stack)[n:], _as_items(ct)[n:], kept, kept_weights, copies)
        x, ct_x, new_params, run_stats = dispatcher.dispatch(
            op, p.program, _unshared(carry, held), args, store.params(run), shared)
        store.keep_params(run, new_params)
        stats[run.start] = run_stats
    return outputs_onto_stack(x, stack, n), outputs_onto_stack(ct_x, ct, n)


def run_step(step: BlockStep, store: ParamStore, dispatcher: Dispatcher,
             inputs: StepInputs) -> StepResult:
    """Runs ``step``'s plan once against ``store``; returns the loss and stats.

    Raises:
      ValueError: for a final stack that does not match the loss layer's inputs (before any
        update), or whatever a program or the store raises.
    """
    store.begin_step()
    dispatcher.phase("step_start")
    stack, ct, final, clip = inputs.stack, None, None, None
    kept: dict[int, Any] = {}
    # The batch weights wait like a block input (the loss op turns them into each device's
    # share of the global loss; a store may send the stack's arrays away meanwhile).
    has_weights = isinstance(stack, tuple) and len(stack) >= 3
    kept_weights = store.stash(stack[2]) if has_weights else None
    stats: dict[int, LayerStats] = {}  # By first flat layer: one layer's, or a run's.
    squared_norms: list[jax.Array] = []
    loss = global_norm = None
    for position, p in enumerate(step.plan):
        op, layer, i = p.op, p.layer, p.op.layer
        if op.kind == OpKind.LOSS:
            final = store.end_forward(stack) if final is None else final
            stack = final
            if not op.norm_only and squared_norms:
                global_norm = dispatcher.call(step.sqrt_of_sum, tuple(squared_norms))
                clip = (global_norm, step.max_norm)
        if p.phase is not None:
            dispatcher.phase(p.phase)
        store.prepare(position)
        shared = Shared(step.indices[i], inputs.lr, clip)
        if op.kind == OpKind.SCAN_FORWARD:
            stack = _scan_forward(p, store, dispatcher, stack, inputs, shared, kept)
            continue
        if op.kind == OpKind.SCAN_REVERSE:
            stack, ct = _scan_reverse(p, store, dispatcher, stack, ct, inputs, shared, kept,
                                      kept_weights, stats, squared_norms)
            continue
        if op.kind == OpKind.FORWARD:
            if op.starts_block or op.keep_point:
                kept[i] = store.stash(stack)
            if p.program is None:  # Reorders stack items only: no program.
                y, _ = layer.pure_fn(inputs_from_stack(stack, layer.n_in), (), (), None)
                store.keep_state(i, store.state(i))
            else:
                args = ForwardArgs(inputs_from_stack(stack, layer.n_in), store.state(i),
                                   inputs.rngs)
                y, new_state = dispatcher.dispatch(op, p.program, args, store.weights(i),
                                                   shared)
                store.keep_state(i, new_state)
            stack = outputs_onto_stack(y, stack, layer.n_in)
            continue
        if op.kind == OpKind.FBO:
            stack = store.unstash(kept[i] if op.norm_only else kept.pop(i))
        if op.kind == OpKind.LOSS:
            stack = _loss_input(p, store, stack)
            args = LossArgs(stack, store.state(i), inputs.rngs,
                            store.unstash(kept_weights) if has_weights else None)
        elif op.kind == OpKind.FBO:
            args = FboArgs(inputs_from_stack(stack, layer.n_in), store.state(i), inputs.rngs,
                           inputs_from_stack(ct, layer.n_out))
        else:
            args = ReverseArgs(inputs_from_stack(stack, layer.n_out),
                               inputs_from_stack(ct, layer.n_out), store.state(i),
                               store.new_state(i), inputs.rngs)
        if op.norm_only:
            *outs, squared_norm = dispatcher.dispatch(op, p.program, args, store.weights(i),
                                                      shared)
            squared_norms.append(squared_norm)
        else:
            outs = list(dispatcher.dispatch(op, p.program, args, store.params(i), shared))
            stats[i] = outs.pop()
            store.keep_params(i, outs.pop(2 if op.kind != OpKind.FBO else 1))
        if op.kind == OpKind.LOSS:
            if op.norm_only:
                (ct,) = outs
            else:
                loss, ct, new_state = outs
                store.keep_state(i, new_state)
        elif op.kind == OpKind.FBO:
            ct = outputs_onto_stack(outs[0], ct, layer.n_out)
        else:
            x, ct_x = outs
            stack = outputs_onto_stack(x, stack, layer.n_out)
            ct = outputs_onto_stack(ct_x, ct, layer.n_out)
    layer_stats, gradients_norm, weights_norm = dispatcher.call(
        step.summarize, tuple(stats[i] for i in sorted(stats)))
    if global_norm is None:
        global_norm = gradients_norm
    if step.free_transients:
        dispatcher.release((stack, ct, kept, final, kept_weights))
    store.finish_step()
    return StepResult(loss, layer_stats, global_norm, weights_norm)


__all__ = ["BlockStep", "Dispatcher", "LiveDispatcher", "StepInputs", "StepResult",
           "run_step", "summary_program"]
