"""What a backward op does with its layer's gradient: its *finisher*, a value on the op.

A backward op (and the ``LOSS`` op) computes each of its layers' input cotangent and
weight gradient (`revtrain.trainers.block.bodies`); its finisher says what
happens to the gradient, as an optax ``GradientTransformation`` says what happens to a
model's:

* `UPDATE` (`Update`): the layer's optimizer step -- the program takes the layer's
  `Params`, donates them, and returns the new ones and the update's `LayerStats`;
* `NORM` (`Norm`): exact global-norm clipping's first pass -- the program takes the
  weights (not donated: the update pass reads them again) and returns the squared norm of
  the gradient in a `NormOut`; nothing is updated.

The programs (`revtrain.trainers.block.programs`,
`revtrain.trainers.block.scan_programs`) and the executor
(`revtrain.trainers.block.executor`) ask the op's finisher instead of testing a flag:
which values to fetch (`Finisher.values`), whether the program donates them
(``donates_values``), whether the stashed copies and the final activations are consumed
(``consumes_kept``: the norm pass leaves them to the update pass), how a program finishes
(`Finisher.finish`, and per layer of a scan `Finisher.finish_layer`) and how its results
are read (`Finisher.take`). Forward ops carry `UPDATE` too and never ask it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from revtrain.parallel.placement import Placement
from revtrain.trainers.block import bodies
from revtrain.trainers.block.contract import LayerStats, NormOut, ReverseOut, Shared
from revtrain.trainers.block.turns import in_turn
from revtrain.trainers.common.protocols import Params
from revtrain.trainers.common.updates import squared_norm


class Finisher(Protocol):
    """What a backward op does with its gradient (module docstring).

    Attributes:
      label: the prefix of its ops' labels (``''`` or ``'norm/'``).
      trace_prefix: the prefix of its programs' names in ``trace_counts``.
      donates_values: its programs take and donate the layer's `Params` (else weights).
      consumes_kept: its ops consume the stashed copies and the final activations (else
        they are left for a later pass).
    """

    label: str
    trace_prefix: str
    donates_values: bool
    consumes_kept: bool

    def values(self, store: Any, run: Any) -> Any:
        """The values the op's program takes from ``store`` (a `StepValues`) for its
        ``run``."""

    def weights(self, values: Any) -> Any:
        """The weights among a program's ``values``."""

    def finish(self, out: Any, grads: Any, values: Any, shared: Shared,
               optimizer: optax.GradientTransformation, placement: Placement) -> Any:
        """A per-layer program's output from its body's typed ``out`` and global
        gradient ``grads``."""

    def take(self, out: Any, run: Any, store: Any, carry: Any) -> None:
        """Reads a program's results: into ``store`` (a `StepValues`, under the op's
        ``run``) and ``carry`` (the executor's `StepCarry`, by the run's first layer)."""

    def take_loss(self, out: Any, run: Any, store: Any, carry: Any) -> None:
        """`take` for the loss op's program."""

    # A scanned run (`revtrain.trainers.block.scan_programs`).

    def carried(self, values: Any) -> Params | None:
        """What the reverse scan carries of the run's stacked ``values``."""

    def layer_values(self, values: Any, carried: Any, j: int, t: jax.Array) -> Any:
        """Group position ``j``'s values at repetition ``t``."""

    def finish_layer(self, grads: Any, layer_values: Any, shared: Shared,
                     optimizer: optax.GradientTransformation, placement: Placement) -> Any:
        """One layer's result inside a scan."""

    def finish_in_turn(self, t: jax.Array, grads: Any, layer_values: Any, shared: Shared,
                       optimizer: optax.GradientTransformation, placement: Placement) -> Any:
        """`finish_layer` after a reverse that ran outside a turn
        (`revtrain.trainers.block.turns`)."""

    def put(self, carried: Any, result: Any, j: int, t: jax.Array) -> tuple[Any, Any]:
        """``(new carry, per-layer output)`` after group position ``j`` at ``t``."""

    def scan_out(self, x: Any, ct_x: Any, carried: Any, outs: Sequence[Any],
                 repeats: int, place: Callable[[Any], Any]) -> Any:
        """The reverse scan's typed output; ``outs[j]`` stacks position ``j``'s per-layer
        outputs over the repetitions, ``place`` constrains stacked params' shardings."""


@dataclasses.dataclass(frozen=True)
class Update:
    """The update finisher: the layer's optimizer step (`bodies.update`)."""

    label: str = ""
    trace_prefix: str = ""
    donates_values: bool = True
    consumes_kept: bool = True

    def values(self, store: Any, run: Any) -> Params:
        return store.params(run)

    def weights(self, values: Params) -> Any:
        return values.weights

    def finish(self, out, grads, values, shared, optimizer, placement):
        new_params, stats = bodies.update(optimizer, grads, values, shared, placement)
        return out._replace(new_params=new_params, stats=stats)

    def take(self, out, run, store, carry) -> None:
        store.keep_params(run, out.new_params)
        carry.stats[run.start] = out.stats

    def take_loss(self, out, run, store, carry) -> None:
        self.take(out, run, store, carry)
        carry.loss = out.loss
        store.keep_state(run, out.new_state)

    def carried(self, values: Params) -> Params:
        return Params(tuple(values.weights), tuple(values.slots))

    def layer_values(self, values, carried, j, t) -> Params:
        return Params(bodies.at(carried.weights[j], t), bodies.at(carried.slots[j], t))

    def finish_layer(self, grads, layer_values, shared, optimizer, placement):
        return bodies.update(optimizer, grads, layer_values, shared, placement)

    def finish_in_turn(self, t, grads, layer_values, shared, optimizer, placement):
        return in_turn(lambda g, v: self.finish_layer(g, v, shared, optimizer, placement),
                       t, grads, layer_values)

    def put(self, carried: Params, result, j, t) -> tuple[Params, LayerStats]:
        new, stats = result
        return Params(*(tuple(bodies.put(p, n, t) if k == j else p for k, p in enumerate(part))
                        for part, n in zip(carried, new, strict=True))), stats

    def scan_out(self, x, ct_x, carried, outs, repeats, place) -> ReverseOut:
        stats = LayerStats(*(jnp.stack([getattr(outs[j], name)[t] for t in range(repeats)
                                        for j in range(len(outs))])
                             for name in LayerStats._fields))
        return ReverseOut(x, ct_x, place(carried), stats)


@dataclasses.dataclass(frozen=True)
class Norm:
    """The norm finisher: the gradient's squared norm, nothing updated (module docstring)."""

    label: str = "norm/"
    trace_prefix: str = "norm_"
    donates_values: bool = False
    consumes_kept: bool = False

    def values(self, store: Any, run: Any) -> Any:
        return store.weights(run)

    def weights(self, values: Any) -> Any:
        return values

    def finish(self, out, grads, values, shared, optimizer, placement) -> NormOut:
        return NormOut(getattr(out, "x", None), out.ct_x, squared_norm(grads))

    def take(self, out, run, store, carry) -> None:
        carry.squared_norms.append(out.squared_norm)

    def take_loss(self, out, run, store, carry) -> None:
        self.take(out, run, store, carry)

    def carried(self, values: Any) -> None:
        return None

    def layer_values(self, values, carried, j, t) -> Any:
        return bodies.at(values[j], t)

    def finish_layer(self, grads, layer_values, shared, optimizer, placement) -> jax.Array:
        return squared_norm(grads)

    def finish_in_turn(self, t, grads, layer_values, shared, optimizer, placement):
        return self.finish_layer(grads, layer_values, shared, optimizer, placement)

    def put(self, carried: None, result: jax.Array, j, t) -> tuple[None, jax.Array]:
        return carried, result

    def scan_out(self, x, ct_x, carried, outs, repeats, place) -> NormOut:
        # In the order of the per-layer backward ops: last layer first.
        return NormOut(x, ct_x, jnp.stack([outs[j][t] for t in reversed(range(repeats))
                                           for j in reversed(range(len(outs)))]))


UPDATE = Update()
"""The update pass's finisher (and the one forward ops carry, unasked)."""
NORM = Norm()
"""Exact global-norm clipping's norm pass's finisher."""

__all__ = ["NORM", "UPDATE", "Finisher", "Norm", "Update"]
