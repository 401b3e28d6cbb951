"""Running a block trainer's step: one function, `run_step`, walks the plan.

Read this module with `revtrain.trainers.block.plan` (what the ops are),
`revtrain.trainers.block.contract` (what each op's program takes and gives) and
`revtrain.trainers.block.finishers` (what a backward op does with its gradient): together
they are the whole step. `run_step` hands each op to its kind's handler (`HANDLERS`, the
one place that tells the three op kinds apart), which asks a
`revtrain.trainers.block.stores.StepValues` for the op's values, calls its program through
a `revtrain.trainers.common.dispatch.Dispatcher`, reads the program's typed outputs by name
and hands the new values back. The `revtrain.trainers.common.dispatch.LiveDispatcher` runs
the programs and tells the observers; precompilation passes a recording one
(`revtrain.trainers.block.precompile.RecordingDispatcher`) and an abstract store, and the
same walk traces every program without running anything.

The step: every op runs a `revtrain.trainers.block.plan.Run` (a lone layer is a run of
one repetition; a scanned run is one op each way, `revtrain.trainers.block.scan_programs`),
and the store's values are keyed by it. Forward ops move the stack up (stashing block
inputs and ``keep_every`` copies); the loss op gives the final stack's cotangent; backward
ops move the stack and its cotangent down, each reconstructing its input from its output
or recomputing it from the stash, as its run says, and updating its layers at once. With
exact global-norm clipping a norm pass (the `NORM` finisher) first walks the backward ops
without updating, and its global norm scales every update; the handlers ask an op's
finisher which values to fetch, whether it consumes the stashes and how its results are
read, and never test it. What the ops hand on to each other is one `StepCarry`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from revtrain.layers.base import inputs_from_stack, outputs_onto_stack
from revtrain.trainers.block import donation
from revtrain.trainers.block.contract import (
    FboArgs,
    ForwardArgs,
    LayerStats,
    LossArgs,
    ReverseArgs,
    Shared,
)
from revtrain.trainers.block.plan import Op, OpKind, PlannedOp, Run
from revtrain.trainers.block.stores import StepValues
from revtrain.trainers.common.dispatch import Dispatcher


@dataclasses.dataclass(frozen=True)
class BlockStep:
    """A block trainer's step as a value, built once per trainer.

    Attributes:
      plan: the ops with their layers and programs (`revtrain.trainers.block.plan.build_plan`).
      indices: per flat layer, its index as a replicated int32 device scalar.
      max_norm: the replicated float32 ``clip_global_norm``, or None (no clipping).
      free_transients: release the batch, stashes, final activations and cotangents at
        the end of the step (``free_accelerators_on_step``).
      summarize: ``(each op's LayerStats, in flat-layer order) -> (LayerStats of
        [n_layers] vectors, whole-model gradient norm, whole-model weight norm)``
        (`summary_program`): one program per step whatever the depth, so the step's
        results are four arrays, not two per layer.
      sqrt_of_sum: ``(squared norms: scalars, or a scanned run's vector) -> sqrt(sum)``,
        the global gradient norm of the norm pass (clipping); likewise jitted once.
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


@dataclasses.dataclass
class StepCarry:
    """What the ops of one step hand on to each other (host-side references to device
    values; nothing here is read to the host), and so what a program that donates some
    of it must leave alone (`leave_alone`).

    Attributes:
      batch: the step's batch, the caller's arrays (never donated).
      stack: the stack between ops: the batch, then activations, then -- going down --
        the reconstructed (or unstashed) inputs of each layer.
      ct: the cotangents of ``stack``'s items, from the loss op on.
      final: the final activations as `StepValues.end_forward` handed them back, or None
        before the loss op.
      reread: ``final`` while a later pass reads it again (the norm pass's ops, whose
        finisher does not consume it), else None.
      kept: stashed block inputs and ``keep_every`` copies by first flat layer (a run's
        copies under its first layer), until the backward op that consumes them.
      kept_weights: the stashed batch weights (the batch's third item), or None.
      stats: each updated op's `LayerStats`, by first flat layer.
      squared_norms: the norm pass's squared gradient norms, in op order.
      loss: the loss op's float32 scalar, or None before it.
      global_norm: the norm pass's global gradient norm, or None without clipping.
      clip: ``(global_norm, max_norm)`` once the norm pass ended, else None.
    """

    batch: Any
    stack: Any
    ct: Any = None
    final: Any = None
    reread: Any = None
    kept: dict[int, Any] = dataclasses.field(default_factory=dict)
    kept_weights: Any = None
    stats: dict[int, LayerStats] = dataclasses.field(default_factory=dict)
    squared_norms: list[jax.Array] = dataclasses.field(default_factory=list)
    loss: jax.Array | None = None
    global_norm: jax.Array | None = None
    clip: tuple[jax.Array, jax.Array] | None = None

    def leave_alone(self, n_stack: int, n_ct: int) -> tuple:
        """What a call that donates the top ``n_stack`` stack items and ``n_ct``
        cotangents must leave alone: the items and cotangents below them, the stashes, the
        batch weights, the step's batch and the final activations a later pass rereads."""
        return (_as_items(self.stack)[n_stack:],
                () if self.ct is None else _as_items(self.ct)[n_ct:], self.kept,
                self.kept_weights, self.batch, self.reread)


class _Walk(NamedTuple):
    """What every handler reads and nothing changes during a step."""

    step: BlockStep
    store: StepValues
    dispatcher: Dispatcher
    inputs: StepInputs

    def begin(self, p: PlannedOp, position: int, c: StepCarry) -> Shared:
        """Marks the op's phase, lets the store prepare it; returns its `Shared`."""
        if p.phase is not None:
            self.dispatcher.phase(p.phase)
        self.store.prepare(position)
        return Shared(self.step.indices[p.op.layer], self.inputs.lr, c.clip)

    def values(self, op: Op, run: Run) -> Any:
        """The values the op's finisher takes: weights or (donated) params."""
        return op.finisher.values(self.store, run)

    def unstash(self, c: StepCarry, op: Op, key: int) -> Any:
        """The stash the op reads; consumed unless its finisher leaves it to a later pass."""
        return self.store.unstash(c.kept.pop(key) if op.finisher.consumes_kept
                                  else c.kept[key])

    def run(self, c: StepCarry, p: PlannedOp, args: Any, values: Any, shared: Shared,
            n_stack: int, n_ct: int = 0) -> Any:
        """Dispatches the op's program once what it donates is its own
        (`revtrain.trainers.block.donation.owned`): the op takes the top ``n_stack`` items of
        the stack and ``n_ct`` of the cotangents (its arity), and what the carry says such
        a call must leave alone (`StepCarry.leave_alone`) keeps its buffers (a donated one
        that any of it also holds is copied first, by a ``copy/<label>`` dispatch)."""
        # On abstract values precompiling sees every copy a step can make (a superset of
        # the donations); running, and planning (a dispatcher that accounts for the bytes,
        # ``exact_donation``), see the program's own.
        exact = getattr(self.dispatcher, "exact_donation", False) or any(
            isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(args))
        donated = (p.program.donated(args, values, shared) if exact
                   else donation.consumed_leaves(args))
        if any(donated):
            args = donation.owned(args, donated, c.leave_alone(n_stack, n_ct),
                                  lambda leaf: self.dispatcher.dispatch(
                                      f"copy/{p.op.label}", donation.copy, leaf))
        return self.dispatcher.dispatch(p.op.label, p.program, args, values, shared)

    def take(self, c: StepCarry, op: Op, run: Run, out: Any) -> None:
        """Reads the op's results as its finisher says (new params and stats, or a norm)."""
        op.finisher.take(out, run, self.store, c)


def _forward(w: _Walk, c: StepCarry, p: PlannedOp, position: int) -> None:
    """A run's forward op. A lone layer whose input is kept (`Run.from_stash`: a block's
    standard layer, a ``keep_every`` layer) stashes its whole input stack first; a scanned
    run's ``keep_every`` copies are stashed under its first layer."""
    run, (n_in, _) = p.op.run, p.arity
    shared = w.begin(p, position, c)
    if run.from_stash:
        c.kept[run.start] = w.store.stash(c.stack)
    x = inputs_from_stack(c.stack, n_in)
    if p.program is None:  # Reorders stack items only: no program.
        y, _ = p.layer.pure_fn(x, (), (), None)
        w.store.keep_state(run, w.store.state(run))
    else:
        out = w.run(c, p, ForwardArgs(x, w.store.state(run), w.inputs.rngs),
                    w.store.weights(run), shared, n_stack=n_in)
        y = out.y
        w.store.keep_state(run, out.new_state)
        if out.copies is not None:
            c.kept[run.start] = w.store.stash(out.copies)
    c.stack = outputs_onto_stack(y, c.stack, n_in)


def _loss(w: _Walk, c: StepCarry, p: PlannedOp, position: int) -> None:
    """The loss op: the final activations leave the forward pass (once), the norm pass's
    global norm (once it ran) sets the clipping of the updates that follow."""
    op, layer, run = p.op, p.layer, p.op.run
    c.final = w.store.end_forward(c.stack) if c.final is None else c.final
    c.reread = None if op.finisher.consumes_kept else c.final
    if c.squared_norms and c.global_norm is None:
        c.global_norm = w.dispatcher.call(w.step.sqrt_of_sum, tuple(c.squared_norms))
        c.clip = (c.global_norm, w.step.max_norm)
    shared = w.begin(p, position, c)
    c.stack = w.store.unstash(c.final)
    n_items = len(_as_items(c.stack))
    if n_items != layer.n_in:
        raise ValueError(f"the loss layer {layer.name} takes {layer.n_in} stack items but "
                         f"the model leaves {n_items}; make the loss layer consume the "
                         f"whole stack")
    batch_weights = None if c.kept_weights is None else w.store.unstash(c.kept_weights)
    args = LossArgs(c.stack, w.store.state(run), w.inputs.rngs, batch_weights)
    out = w.run(c, p, args, w.values(op, run), shared, n_stack=n_items)
    op.finisher.take_loss(out, run, w.store, c)
    c.ct = out.ct_x


def _backward(w: _Walk, c: StepCarry, p: PlannedOp, position: int) -> None:
    """A run's backward op: its input and the input's cotangent move down the stack, each
    layer's gradient goes to the op's finisher. Where the input comes from is the run's
    (`revtrain.trainers.block.contract`): a lone layer whose input stack was stashed
    (`Run.from_stash`) is recomputed from it, and the stash is the stack below; any other
    reconstructs its input from its output (a scanned run's kept layers from the copies
    its forward op stashed)."""
    op, run, (n_in, n_out) = p.op, p.op.run, p.arity
    shared = w.begin(p, position, c)
    kept = w.unstash(c, op, run.start) if run.kept else None
    ct_y, state = inputs_from_stack(c.ct, n_out), w.store.state(run)
    if run.from_stash:  # Its input, and the stack below it from here on.
        c.stack, n_stack = kept, n_in
        args = FboArgs(inputs_from_stack(kept, n_in), state, w.inputs.rngs, ct_y)
    else:
        n_stack = n_out
        args = ReverseArgs(inputs_from_stack(c.stack, n_out), ct_y, state,
                           w.store.new_state(run), w.inputs.rngs, kept)
    out = w.run(c, p, args, w.values(op, run), shared, n_stack=n_stack, n_ct=n_out)
    w.take(c, op, run, out)
    if isinstance(args, ReverseArgs):
        c.stack = outputs_onto_stack(out.x, c.stack, n_out)
    c.ct = outputs_onto_stack(out.ct_x, c.ct, n_out)


# The one place that tells op kinds apart: each kind's handler.
HANDLERS: dict[OpKind, Callable[[_Walk, StepCarry, PlannedOp, int], None]] = {
    OpKind.FORWARD: _forward,
    OpKind.LOSS: _loss,
    OpKind.BACKWARD: _backward,
}


def run_step(step: BlockStep, store: StepValues, dispatcher: Dispatcher,
             inputs: StepInputs) -> StepResult:
    """Runs ``step``'s plan once against ``store``; returns the loss and stats.

    Each op goes to its kind's handler (`HANDLERS`), which reads its values from the store,
    dispatches its program, reads the program's typed outputs
    (`revtrain.trainers.block.contract`) by name and hands the new values back.

    Raises:
      ValueError: for a final stack that does not match the loss layer's inputs (before any
        update), or whatever a program or the store raises.
    """
    store.begin_step()
    dispatcher.phase("step_start")
    c = StepCarry(inputs.stack, inputs.stack)
    # The batch weights wait like a block input (the loss op turns them into each device's
    # share of the global loss; a store may send the stack's arrays away meanwhile).
    if isinstance(c.stack, tuple) and len(c.stack) >= 3:
        c.kept_weights = store.stash(c.stack[2])
    walk = _Walk(step, store, dispatcher, inputs)
    for position, p in enumerate(step.plan):
        HANDLERS[p.op.kind](walk, c, p, position)
    layer_stats, gradients_norm, weights_norm = dispatcher.call(
        step.summarize, tuple(c.stats[i] for i in sorted(c.stats)))
    if step.free_transients:
        dispatcher.release((c.stack, c.ct, c.kept, c.final, c.kept_weights))
    store.finish_step()
    global_norm = gradients_norm if c.global_norm is None else c.global_norm
    return StepResult(c.loss, layer_stats, global_norm, weights_norm)


__all__ = ["HANDLERS", "BlockStep", "StepCarry", "StepInputs", "StepResult", "run_step",
           "summary_program"]
