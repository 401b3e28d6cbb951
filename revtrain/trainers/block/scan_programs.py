"""A run of equal reversible layers as two compiled programs: a forward scan and a
reverse-and-fbo scan with every layer's own optimizer update inside.

A reversible model repeats one group of layers (a `ReversibleTransformerLM` block: two
half-residuals and two swaps). `find_runs` finds, in each block, the consecutive
repetitions that provably compute the same function -- `revtrain.layers.scan`'s rule for
`Serial`: equal non-None `Layer.structure_key` s and equal weight and state signatures --
and the plan runs each as one ``FORWARD`` and one ``BACKWARD`` op
(`revtrain.trainers.block.plan.Run`), so the number of programs a step dispatches does not grow
with depth (the scan-over-layers technique of flax ``nn.scan`` and MaxText, applied to
the reverse pass too).

Each program is ``jax.jit`` of a ``lax.scan`` over the run's repetitions on global arrays;
its body runs the group's layers one by one, each through the per-layer body of
`revtrain.trainers.block.bodies` inside its own ``shard_map``
(`revtrain.parallel.collectives.gathering_shard_map`: with FSDP each layer all-gathers only its
own shards), so per layer everything is what its own program computes:

* forward: the layer's key is ``rngs[d, start + t * period + j]`` (``split(rng, n)[i]``),
  its state entry ``t`` of the stacked states; the carry is the run's top ``n_items``
  stack items, so one layer's activations are live (reversible layers keep none);
  ``keep_every`` copies are written into one ``[devices, n_kept, ...]`` buffer per carry
  item;
* reverse: the carry is named (`_ReverseCarry`: the stack items, their cotangents and
  what the op's finisher carries -- with `UPDATE` the stacked weights and slots, with
  `NORM` nothing), all donated (the norm finisher's program donates the items and
  cotangents only); the loop runs in their buffers, and the reconstructed items and their
  cotangents leave in them. Each layer reconstructs its input (``reverse_and_grad``) --
  or, at a kept position, recomputes from its copy, as a lone layer does from its stash
  -- and hands its gradient to the finisher (`revtrain.trainers.block.finishers`):
  `UPDATE` applies *its own* optimizer update (`revtrain.trainers.block.bodies.update` on
  global arrays: the learning rate injected, per-layer clipping inside the optimizer,
  exact global-norm clipping by the given norm) to entry ``t`` of the stacked weights and
  slots, updated in place (``dynamic_update_slice`` on the donated carry: the run's
  values exist once);
  `NORM` (exact global-norm clipping) gives each layer's squared gradient norm and
  updates nothing.

Results per flat layer (stats, squared norms) leave as one vector per kind over the run's
layers, in the order the per-layer ops would give them, so the number of a program's
outputs does not grow with depth either. A group whose carry changes type from one
repetition to the next (checked by abstract evaluation when the program is traced) is run
unrolled in the same program: the results are the same, only the compile time grows with
depth.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import jaxpr_as_fun

from revtrain.layers.base import Layer, inputs_from_stack, outputs_onto_stack
from revtrain.layers.reversible import ReversibleSelect
from revtrain.layers.scan import MIN_REPEATS, layer_signature, plan_runs, serial_arity
from revtrain.parallel import collectives as fsdp
from revtrain.parallel.placement import Placement
from revtrain.trainers.block import bodies
from revtrain.trainers.block.contract import (
    FboArgs,
    FboOut,
    ForwardArgs,
    ForwardOut,
    ReverseArgs,
    ReverseOut,
    Shared,
    stack_of,
)
from revtrain.trainers.block.donation import Program
from revtrain.trainers.block.finishers import UPDATE, Finisher
from revtrain.trainers.block.plan import OpKind, Run
from revtrain.trainers.block.turns import in_turn, reverse_in_turn
from revtrain.trainers.common.protocols import Params


def find_runs(layers: Sequence[Layer], block_sizes: Sequence[int]) -> tuple[Run, ...]:
    """The runs of equal reversible layers in each block, to scan.

    Args:
      layers: the flat layers ``[std_0, *rev_0, std_1, ...]`` (initialised).
      block_sizes: reversible layers per block.

    Returns:
      One `Run` per group of ``period <= revtrain.layers.scan.MAX_PERIOD`` layers repeated
      at least ``MIN_REPEATS`` times (`revtrain.layers.scan.plan_runs`) whose layers take
      and leave the same number of stack items.
    """
    runs, i = [], 0
    for n_rev in block_sizes:
        revs = list(layers[i + 1:i + 1 + n_rev])
        signatures = [layer_signature(layer, layer.weights, layer.state) for layer in revs]
        for start, period, repeats in plan_runs(signatures):
            n_in, n_out = serial_arity(revs[start:start + period])
            if repeats >= MIN_REPEATS and n_in == n_out > 0:
                runs.append(Run(i + 1 + start, period, repeats, n_in))
        i += 1 + n_rev
    return tuple(runs)


def _same_types(a: Any, b: Any) -> bool:
    def kind(x):
        x = jax.typeof(x) if not isinstance(x, jax.ShapeDtypeStruct) else x
        return tuple(x.shape), x.dtype, x.weak_type
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and [kind(x) for x in jax.tree.leaves(a)] == [kind(x) for x in jax.tree.leaves(b)])


def traced_once(fn: Callable, *args: Any) -> tuple[Callable, Any]:
    """``fn`` traced once on ``args``: ``(replay, output shapes)``, where ``replay(*args)``
    (arguments of the same types) re-emits the recorded operations without running
    ``fn``'s Python again -- the same program, at the price of walking a jaxpr.

    A scan body would otherwise be traced once to check its carry's types and once by
    ``lax.scan``, and a layer's reverse once to count its random draws and once to run
    (each trace of a reversible LSH layer's reverse-and-grad: about a second on CPU).
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    run, out_tree = jaxpr_as_fun(closed), jax.tree.structure(out_shape)
    return lambda *a: jax.tree.unflatten(out_tree, run(*jax.tree.leaves(a))), out_shape


def _loop(body: Callable, carry: Any, length: int, reverse: bool) -> tuple[Any, Any]:
    """``lax.scan(body, carry, arange(length))`` when the body keeps the carry's types;
    otherwise the same iterations unrolled (ys stacked the same way). The body is traced
    once to check (`traced_once`), and the scan replays that trace."""
    steps = jnp.arange(length, dtype=jnp.int32)
    replay, out_shape = traced_once(body, carry, steps[0])
    if _same_types(out_shape[0], carry):
        return jax.lax.scan(replay, carry, steps, reverse=reverse)
    ys = [None] * length
    for t in (reversed(range(length)) if reverse else range(length)):
        carry, ys[t] = body(carry, steps[t])
    return carry, jax.tree.map(lambda *leaves: jnp.stack(leaves), *ys)


class _KeptTable:
    """Where the ``keep_every`` copies of a run go: per group position ``j``, whether the
    input of repetition ``t``'s layer is kept, and in which slot of the copies."""

    def __init__(self, run: Run):
        offsets = np.arange(run.repeats * run.period).reshape(run.repeats, run.period)
        self.keep = np.isin(offsets, run.kept)
        slot = {q: k for k, q in enumerate(run.kept)}
        self.slot = np.vectorize(lambda q: slot.get(int(q), 0))(offsets).astype(np.int32)
        self.n = len(run.kept)

    def any(self, j: int) -> bool:
        return bool(self.keep[:, j].any())

    def all(self, j: int) -> bool:
        return bool(self.keep[:, j].all())

    def write(self, copies: Any, x: Any, j: int, t: jax.Array) -> Any:
        """``copies`` with the carry ``x`` written at repetition ``t``'s slot when kept."""
        slot = jnp.asarray(self.slot[:, j])[t]
        keep = jnp.asarray(self.keep[:, j])[t]

        def one(buffer, item):
            old = jax.lax.dynamic_index_in_dim(buffer, slot, 1, keepdims=False)
            new = item if self.all(j) else jnp.where(keep, item, old)
            return jax.lax.dynamic_update_index_in_dim(buffer, new, slot, 1)
        return jax.tree.map(one, copies, x)

    def read(self, copies: Any, j: int, t: jax.Array) -> Any:
        return bodies.at(copies, jnp.asarray(self.slot[:, j])[t], axis=1)

    def buffers(self, x: Any) -> Any:
        return jax.tree.map(lambda a: jnp.zeros((a.shape[0], self.n, *a.shape[1:]), a.dtype),
                            x)


def _forward_program(group: Sequence[Layer], run: Run, placement: Placement) -> Callable:
    dev = placement.per_device.spec
    forwards = [None if isinstance(layer, ReversibleSelect) else fsdp.gathering_shard_map(
        lambda a, w, i, layer=layer: bodies.forward(layer, a, w, i), placement,
        ForwardOut(dev, dev, None), with_grads=False, stack=stack_of)[0] for layer in group]
    table = _KeptTable(run)

    def scan_forward(args: ForwardArgs, weights: tuple, shared: Shared) -> tuple:
        def body(carry, t):
            x, copies = carry
            new_states = []
            for j, (layer, forward) in enumerate(zip(group, forwards, strict=True)):
                if table.any(j):
                    copies = table.write(copies, x, j, t)
                state = bodies.at(args.state[j], t, axis=1)
                x_j = inputs_from_stack(x, layer.n_in)
                if forward is None:  # Reorders stack items only (no weights, state, rng).
                    y, new_state = layer.pure_fn(x_j, (), (), None)[0], state
                else:
                    out = in_turn(
                        lambda x_j, state, w, i, forward=forward: forward(
                            ForwardArgs(x_j, state, args.rngs), w, i),
                        t, x_j, state, bodies.at(weights[j], t), shared.index + t * run.period + j)
                    y, new_state = out.y, out.new_state
                x = outputs_onto_stack(y, x, layer.n_in)
                new_states.append(new_state)
            return (x, copies), tuple(new_states)

        copies = table.buffers(args.x) if table.n else None
        (x, copies), new_states = _loop(body, (args.x, copies), run.repeats, reverse=False)
        new_states = jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), new_states)
        return jax.lax.with_sharding_constraint(ForwardOut(x, new_states, copies),
                                                placement.per_device)
    return scan_forward


class _ReverseCarry(NamedTuple):
    """The reverse scan's carry: the stack items ``y`` (each layer's input once it ran),
    their cotangents ``ct``, and what the finisher carries of the run's values
    (`revtrain.trainers.block.finishers.Finisher.carried`: the stacked `Params`, updated
    in place, or None)."""

    y: Any
    ct: Any
    params: Params | None


class _ReverseScan:
    """A run's reverse scan: per repetition, last to first, each layer of the group
    reconstructs its input (or recomputes from its kept copy) and its gradient goes to
    the op's finisher (`revtrain.trainers.block.finishers`)."""

    def __init__(self, group: Sequence[Layer], run: Run,
                 optimizer: optax.GradientTransformation, placement: Placement,
                 finisher: Finisher):
        self.group, self.run, self.finisher = group, run, finisher
        self.optimizer, self.placement = optimizer, placement
        self.table = _KeptTable(run)
        dev = placement.per_device.spec
        self.reverses = [fsdp.gathering_shard_map(
            lambda a, w, i, layer=layer: bodies.reverse_grads(layer, a, w, i), placement,
            ReverseOut(dev, dev, None, None), with_grads=True, stack=stack_of)[0]
            for layer in group]
        self.fbos = [fsdp.gathering_shard_map(
            lambda a, w, i, layer=layer: bodies.std_grads(layer, a, w, i), placement,
            FboOut(dev, None, None), with_grads=True, stack=stack_of)[0]
            if self.table.any(j) else None
            for j, layer in enumerate(group)]

    def _reverse(self, args, j, t, index, y, ct, weights):
        layer = self.group[j]
        out, grads = self.reverses[j](ReverseArgs(
            inputs_from_stack(y, layer.n_out), inputs_from_stack(ct, layer.n_out),
            bodies.at(args.state[j], t, axis=1), bodies.at(args.new_state[j], t, axis=1),
            args.rngs), weights, index)
        return (outputs_onto_stack(out.x, y, layer.n_out),
                outputs_onto_stack(out.ct_x, ct, layer.n_out), grads)

    def _recompute(self, args, j, t, index, y, ct, weights):
        """A kept position: the layer's fbo from its exact input, as a lone layer's from
        its stash."""
        layer, x = self.group[j], self.table.read(args.kept, j, t)
        out, grads = self.fbos[j](FboArgs(
            inputs_from_stack(x, layer.n_in), bodies.at(args.state[j], t, axis=1),
            args.rngs, inputs_from_stack(ct, layer.n_out)), weights, index)
        return x, outputs_onto_stack(out.ct_x, ct, layer.n_out), grads

    def grads(self, args, j, t, index, y, ct, weights):
        """One layer's ``(input stack items, their cotangents, global weight gradient)``."""
        if self.fbos[j] is None:
            return self._reverse(args, j, t, index, y, ct, weights)
        if self.table.all(j):
            return self._recompute(args, j, t, index, y, ct, weights)
        return jax.lax.cond(jnp.asarray(self.table.keep[:, j])[t],
                            functools.partial(self._recompute, args, j, t, index),
                            functools.partial(self._reverse, args, j, t, index),
                            y, ct, weights)

    def layer(self, args, values, shared, carry: _ReverseCarry, j: int, t: jax.Array):
        """Group position ``j`` at repetition ``t``: ``(new carry, its result)``."""
        f, extra = self.finisher, (shared, self.optimizer, self.placement)
        layer_values = f.layer_values(values, carry.params, j, t)
        # Traced once here; counting its draws and running it replay that trace.
        reverse, _ = traced_once(functools.partial(
            self.grads, args, j, t, shared.index + t * self.run.period + j),
            carry.y, carry.ct, f.weights(layer_values))

        def whole(y, ct, layer_values):
            y, ct, grads = reverse(y, ct, f.weights(layer_values))
            return y, ct, f.finish_layer(grads, layer_values, *extra)
        if reverse_in_turn(reverse, (carry.y, carry.ct), self.placement.mesh.size,
                           carry.y, carry.ct, f.weights(layer_values)):
            y, ct, result = in_turn(whole, t, carry.y, carry.ct, layer_values)
        else:  # The stack items stay uncopied (`revtrain.trainers.block.turns`).
            y, ct, grads = reverse(carry.y, carry.ct, f.weights(layer_values))
            result = f.finish_in_turn(t, grads, layer_values, *extra)
        params, out = f.put(carry.params, result, j, t)
        return _ReverseCarry(y, ct, params), out

    def body(self, args, values, shared, carry: _ReverseCarry, t: jax.Array):
        outs = [None] * self.run.period
        for j in reversed(range(self.run.period)):
            carry, outs[j] = self.layer(args, values, shared, carry, j, t)
        return carry, tuple(outs)

    def __call__(self, args: ReverseArgs, values: Any, shared: Shared) -> Any:
        carry = _ReverseCarry(args.y, args.ct_y, self.finisher.carried(values))
        carry, outs = _loop(functools.partial(self.body, args, values, shared), carry,
                            self.run.repeats, reverse=True)
        x, ct_x = jax.lax.with_sharding_constraint((carry.y, carry.ct),
                                                   self.placement.per_device)
        return self.finisher.scan_out(x, ct_x, carry.params, outs, self.run.repeats,
                                      self._place)

    def _place(self, params: Params) -> Params:
        return jax.lax.with_sharding_constraint(
            params, self.placement.stacked_weight_shardings(params))


def scan_program(kind: OpKind, group: Sequence[Layer], run: Run,
                 optimizer: optax.GradientTransformation, placement: Placement,
                 finisher: Finisher = UPDATE) -> tuple[Callable, Callable]:
    """The jitted ``FORWARD`` or ``BACKWARD`` program of ``run`` (two or more repetitions
    of ``group``) and its trace-counted function.

    The program is a `revtrain.trainers.block.donation.Program`, called as
    ``program(args, weights_or_params, shared)``, ``shared.index`` the run's first flat
    layer; it donates the fields of ``args`` its kind consumes
    (`revtrain.trainers.block.contract.CONSUMED`: the caller must hold no other reference
    to their buffers, `revtrain.trainers.block.donation.owned`). Outputs by kind
    (`revtrain.trainers.block.contract`):

    * ``FORWARD`` (``args`` a `ForwardArgs` of the carry items and the stacked
      states, stacked weights, not donated): a `ForwardOut` whose ``copies`` are the
      ``keep_every`` copies, or None; donates ``x``, in whose buffers ``y`` leaves.
    * ``BACKWARD`` with `UPDATE` (``args`` a `ReverseArgs` whose ``kept`` are the forward
      scan's copies, stacked `Params`): a `ReverseOut`, its ``stats`` a `LayerStats` of
      float32 ``[n]`` vectors over the run's ``n`` flat layers, in order (two outputs
      whatever the run's length); donates the carry ``y``
      and ``ct_y`` (the loop runs in their buffers, and ``x`` and ``ct_x`` leave in
      them) and the params (updated in place).
    * ``BACKWARD`` with `NORM` (stacked weights, not donated: the updating pass that
      follows reads them): a `NormOut`, its ``squared_norm`` a float32 ``[n]``
      vector, last layer first; donates ``y`` and ``ct_y`` as above.

    Raises:
      ValueError: for another kind.
    """
    if kind == OpKind.FORWARD:
        counted = eqx.debug.assert_max_traces(_forward_program(group, run, placement),
                                              max_traces=None)
        return Program(counted, donate_values=False), counted
    if kind != OpKind.BACKWARD:
        raise ValueError(f"kind={kind!r} has no scanned program; the loss is a lone layer")
    counted = eqx.debug.assert_max_traces(
        _ReverseScan(group, run, optimizer, placement, finisher), max_traces=None)
    return Program(counted, donate_values=finisher.donates_values), counted


__all__ = ["find_runs", "scan_program"]
