"""One builder and one cache for every program of a block step: a program runs a `Run`.

A run (`revtrain.trainers.block.plan.Run`) is ``period`` layers repeated ``repeats``
times. A lone layer is a run of one repetition of itself, whose program calls the layer's
body once on the layer's own values (below); a run of two or more repetitions runs as one
``lax.scan`` each way (`revtrain.trainers.block.scan_programs`). `make_program` is the one
builder; `ProgramCache` the one cache, keyed alike for both. The lowered text of a lone
layer's program is the per-layer program's that the block trainers ran before there was
one builder (`tests/trainers/block/test_programs.py` checks it, name for name).

An *fbo* (forward-backward-optimizer) program runs one layer's vjp, combines the weight
gradients across devices, applies the layer's optimizer update and returns the new weights,
new optimizer slots, the input cotangents and stats -- so the gradients of the whole model
are never held at once (Trax's ``ReversibleSerialTrainer`` idea). Every program is
``jax.jit(jax.shard_map(...))`` over the mesh: per-device values (activations, cotangents,
layer state, rngs) have a leading device axis (over every mesh axis), weights and slots are
replicated (or, with ``fsdp``, sharded: `revtrain.parallel.collectives`).

Every program is called as ``program(args, weights_or_params, shared)`` and returns a typed
output; the argument and output types are `revtrain.trainers.block.contract`, the
per-device bodies `revtrain.trainers.block.bodies`, shared with the scanned programs, and a
backward program ends as its op's finisher says (`revtrain.trainers.block.finishers`).
Every program donates what it consumes (`revtrain.trainers.block.donation.Program`: the
fields of `contract.CONSUMED`, and an updating program's `Params`), so pass-through items
come back in their own buffers.

Combining across devices (the data-parallel invariance; `revtrain.trainers.common.global_loss`):
the loss layer's cotangent on device ``d`` is its share ``W_d / sum W`` of the global batch
weights, every cotangent flowing back carries that share, and the weight gradient is the
*sum* over devices of the per-device gradients, never their mean. Weights enter each vjp as
explicitly per-device values (`revtrain.parallel.collectives.gather_weights`), so autodiff does
not sum them behind our back. Cotangents of integer stack items (token ids, labels) carry
no information; they are passed as a float32 placeholder and replaced by ``float0`` zeros.
The optimizer update, clipping and the stats' norms run outside ``shard_map`` on global
arrays, so every optax transformation gives the same update as with replicated weights.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import optax

from revtrain.layers.base import Layer
from revtrain.parallel import collectives as fsdp
from revtrain.parallel.collectives import DEV, REP
from revtrain.parallel.placement import Placement
from revtrain.trainers.block import bodies
from revtrain.trainers.block.contract import FboOut, ForwardOut, LossOut, ReverseOut, stack_of
from revtrain.trainers.block.donation import Program
from revtrain.trainers.block.finishers import UPDATE, Finisher
from revtrain.trainers.block.plan import Op, OpKind, Run
from revtrain.trainers.block.scan_programs import scan_program


def _grad_body(kind: OpKind, run: Run, placement: Placement) -> tuple[Callable, Any]:
    """A lone layer's gradient body and the shard_map out-specs of its typed outputs: the
    loss's, a recompute from the stash (`Run.from_stash`), or a reverse."""
    if kind == OpKind.LOSS:
        return (functools.partial(bodies.loss_grads, axes=placement.device_axes),
                LossOut(REP, DEV, None, DEV, None))
    if run.from_stash:
        return bodies.std_grads, FboOut(DEV, None, None)
    return bodies.reverse_grads, ReverseOut(DEV, DEV, None, None)


def _lone_program(kind: OpKind, layer: Layer, run: Run,
                  optimizer: optax.GradientTransformation, placement: Placement,
                  finisher: Finisher) -> tuple[Callable, Callable]:
    """A run of one repetition of ``layer``: its body called once on its own values."""
    if kind == OpKind.FORWARD:
        call, counted = fsdp.gathering_shard_map(
            lambda a, w, i: bodies.forward(layer, a, w, i), placement,
            ForwardOut(DEV, DEV, None), with_grads=False, stack=stack_of)
        return Program(lambda args, weights, shared: call(args, weights, shared.index),
                       donate_values=False), counted
    body, out_specs = _grad_body(kind, run, placement)
    call, counted = fsdp.gathering_shard_map(lambda a, w, i: body(layer, a, w, i), placement,
                                             out_specs, with_grads=True, stack=stack_of)

    def program(args, values, shared):
        out, grads = call(args, finisher.weights(values), shared.index)
        return finisher.finish(out, grads, values, shared, optimizer, placement)
    return Program(program, donate_values=finisher.donates_values), counted


def make_program(kind: OpKind, group: Sequence[Layer], run: Run,
                 optimizer: optax.GradientTransformation, placement: Placement,
                 finisher: Finisher = UPDATE) -> tuple[Callable, Callable]:
    """The jitted ``kind`` program of ``run`` (whose group is ``group``) and its
    trace-counted function.

    A run of one repetition calls its layer's body once
    (`revtrain.trainers.block.bodies`); a longer one scans
    (`revtrain.trainers.block.scan_programs.scan_program`, which says what its programs
    take). The program is a `revtrain.trainers.block.donation.Program`, called as
    ``program(args, values, shared)``, which donates the fields of ``args`` the op
    consumes (`revtrain.trainers.block.contract.CONSUMED`; the caller must hold no other
    reference to their buffers: `revtrain.trainers.block.donation.owned`) and returns, by
    kind (`revtrain.trainers.block.contract`):

    * ``FORWARD``: a `ForwardOut` (``values`` the weights, not donated); donates ``x``,
      whose buffers ``y`` reuses (a pass-through item leaves in its own).
    * ``BACKWARD``, ``LOSS``: what ``finisher`` (`revtrain.trainers.block.finishers`)
      makes of the body's output and gradient: with `UPDATE` an `FboOut` (a layer
      recomputed from its stash, `Run.from_stash`), `ReverseOut` (one reconstructed from
      its output) or `LossOut` (``values`` the layer's `Params`, donated: ``new_params``
      reuses their buffers), with `NORM` a `NormOut` (``values`` the weights, not
      donated; nothing is updated). Either donates ``ct_y`` (`FboArgs`) or ``y`` and
      ``ct_y`` (`ReverseArgs`), which the input and its cotangent reuse (``LOSS``
      consumes nothing else: its ``x`` is the first backward op's ``y``).

    Raises:
      ValueError: for a run of one repetition of several layers (a scan needs two
        repetitions, a lone program one layer).
    """
    if run.repeats >= 2:
        return scan_program(kind, group, run, optimizer, placement, finisher)
    if run.period != 1 or len(group) != 1:
        raise ValueError(f"{run} of {len(group)} layers is neither one layer nor two or "
                         f"more repetitions; split it into lone layers")
    return _lone_program(kind, group[0], run, optimizer, placement, finisher)


def _structure(layer: Layer) -> Any:
    key = layer.structure_key
    return ("object", id(layer)) if key is None else key


class ProgramCache:
    """Compiled programs, one per (kind, finisher, group structure, period, repeats, kept
    offsets the program depends on): layers, runs of equal groups, repetitions and copies
    share them (the first layer is an argument, ``Shared.index``).

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
        run = op.run
        # A lone layer's forward and loss programs do not depend on whether its input is kept.
        kept = run.kept if run.repeats > 1 or op.kind == OpKind.BACKWARD else ()
        key = (op.kind, op.finisher, tuple(map(_structure, group)), run.period, run.repeats,
               kept)
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


__all__ = ["ProgramCache", "make_program"]
