"""A lone layer's programs (a run of one repetition): forward, fbo, reverse-and-fbo, loss.

An *fbo* (forward-backward-optimizer) program runs one layer's vjp, combines the weight
gradients across devices, applies the layer's optimizer update and returns the new weights,
new optimizer slots, the input cotangents and stats -- so the gradients of the whole model
are never held at once (Trax's ``ReversibleSerialTrainer`` idea). Every program here is
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
A lone layer is a run of one repetition: `revtrain.trainers.block.programs` builds its
programs here and caches them with the scanned runs' (`programs.ProgramCache`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import optax

from revtrain.layers.base import Layer
from revtrain.parallel import collectives as fsdp
from revtrain.parallel.collectives import DEV, REP
from revtrain.parallel.placement import Placement
from revtrain.trainers.block import bodies
from revtrain.trainers.block.contract import FboOut, ForwardOut, LossOut, ReverseOut, stack_of
from revtrain.trainers.block.donation import Program
from revtrain.trainers.block.finishers import UPDATE, Finisher
from revtrain.trainers.block.plan import OpKind

# Per kind: the per-device body and the shard_map out-specs of its typed outputs.
_GRAD_BODIES = {
    OpKind.FBO: (bodies.std_grads, FboOut(DEV, None, None)),
    OpKind.REVERSE: (bodies.reverse_grads, ReverseOut(DEV, DEV, None, None)),
    OpKind.LOSS: (bodies.loss_grads, LossOut(REP, DEV, None, DEV, None)),
}


def layer_program(kind: OpKind, layer: Layer, optimizer: optax.GradientTransformation,
                 placement: Placement,
                 finisher: Finisher = UPDATE) -> tuple[Callable, Callable]:
    """The jitted ``kind`` program of ``layer`` and its trace-counted body.

    Returns ``(program, counted)``: a `revtrain.trainers.block.donation.Program`, called as
    ``program(args, values, shared)``, which donates the fields of ``args`` the kind
    consumes (`revtrain.trainers.block.contract.CONSUMED`; the caller must hold no other
    reference to their buffers: `revtrain.trainers.block.donation.owned`) and returns, by
    kind (`revtrain.trainers.block.contract`):

    * ``FORWARD``: a `ForwardOut` (``values`` the weights, not donated); donates ``x``,
      whose buffers ``y`` reuses (a pass-through item leaves in its own).
    * ``FBO``, ``REVERSE``, ``LOSS``: what ``finisher`` (`revtrain.trainers.block.finishers`)
      makes of the body's output and gradient: with `UPDATE` an `FboOut`, `ReverseOut` or
      `LossOut` (``values`` the layer's `Params`, donated: ``new_params`` reuses their
      buffers), with `NORM` a `NormOut` (``values`` the weights, not donated; nothing is
      updated). Either donates ``ct_y`` (``FBO``) or ``y`` and ``ct_y`` (``REVERSE``),
      which the input and its cotangent reuse (``LOSS`` consumes nothing else: its ``x``
      is the first backward op's ``y``).
    """
    if kind == OpKind.FORWARD:
        run, counted = fsdp.gathering_shard_map(
            lambda a, w, i: bodies.forward(layer, a, w, i), placement,
            ForwardOut(DEV, DEV, None), with_grads=False, stack=stack_of)
        return Program(lambda args, weights, shared: run(args, weights, shared.index),
                       donate_values=False), counted
    body, out_specs = _GRAD_BODIES[kind]
    if kind == OpKind.LOSS:
        body = functools.partial(body, axes=placement.device_axes)
    run, counted = fsdp.gathering_shard_map(lambda a, w, i: body(layer, a, w, i), placement,
                                            out_specs, with_grads=True, stack=stack_of)

    def program(args, values, shared):
        out, grads = run(args, finisher.weights(values), shared.index)
        return finisher.finish(out, grads, values, shared, optimizer, placement)
    return Program(program, donate_values=finisher.donates_values), counted


__all__ = ["layer_program"]
