"""What each op of a block step takes and gives, typed both ways: the op contract.

Every program of a block step -- a run's (`revtrain.trainers.block.programs`: a lone
layer's, or a scanned run's, `revtrain.trainers.block.scan_programs`) -- takes one of the argument
types below and returns one of the output types; the executor
(`revtrain.trainers.block.executor`) reads outputs by field name, never by position:

============================  ==============  ===========  ==============================
op (its run)                  arguments       donates      outputs
============================  ==============  ===========  ==============================
``FORWARD``                   `ForwardArgs`   ``x``        `ForwardOut` (``copies``: a
                                                           scan's ``keep_every``, or None)
``BACKWARD``, input from its  `ReverseArgs`   ``y``,       `ReverseOut` (a scan's stats
output (``kept`` a scan's                     ``ct_y``     as ``[n]`` vectors)
copies, or None)
``BACKWARD``, input from the  `FboArgs`       ``ct_y``     `FboOut`
stash (`Run.from_stash`)
``LOSS``                      `LossArgs`      nothing      `LossOut`
a backward or loss op, norm   as above        as above     `NormOut` (no update; ``x``
finisher                                                   None but for `ReverseArgs`)
============================  ==============  ===========  ==============================

A backward op's run says where its input comes from
(`revtrain.trainers.block.plan.Run.from_stash`): a lone layer whose input stack was
stashed recomputes the layer from it (`FboArgs`); any other reconstructs its input from
its output (`ReverseArgs`), a scanned run's kept layers from the copies in ``kept``.

What a backward or loss op does with its gradient is its finisher
(`revtrain.trainers.block.finishers`): the update finisher's program takes the layer's
`Params`, donates them (its ``new_params`` output reuses their buffers) and returns the
kind's output; the norm finisher's (exact global-norm clipping's first pass) takes the
weights, donates none of them and returns a `NormOut`. Programs are called as
``program(args, weights_or_params, shared)``, ``shared`` the replicated `Shared` scalars.

**Donation** (`revtrain.trainers.block.donation`): a program donates the fields of its
arguments that it consumes (`CONSUMED`, the "donates" column): the stack items it replaces
and the cotangents it turns into its input's, each leaf that an output of the same shape
and dtype can take. So an output written in a consumed item's place reuses its buffer, and
an item that passes through unchanged (a half-residual's ``x2``, the cotangent it leaves
alone) comes back in its own buffer instead of a copy. The fields are in the order of the
outputs that take them (``y`` -> ``x``, ``ct_y`` -> ``ct_x``), which is how ``jax.jit``
pairs them. Nothing else is donated: states, keys, stashed copies and (norm finisher)
weights are read again later. The caller makes sure a donated buffer is nobody else's
(`revtrain.trainers.block.donation.owned`).

The per-device bodies that compute these outputs are `revtrain.trainers.block.bodies`.

References: Trax's ``ReversibleSerialTrainer`` (one fbo -- forward, backward, optimizer --
per layer); Gomez et al. 2017 (RevNet) for reconstructing a layer's input from its output.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from revtrain.trainers.common.protocols import Params


class ForwardArgs(NamedTuple):
    """Per-device arguments of a forward program (leading device axis on every leaf).

    Attributes:
      x: the layer's (or run's) input stack items.
      state: the layer's state (a run's: per group position, stacked over repetitions,
        ``[devices, repeats, ...]``).
      rngs: uint32 key data ``[devices, n_layers, *key]`` of the step
        (`revtrain.parallel.rngs.StepKeys`).
    """

    x: Any
    state: Any
    rngs: jax.Array


class FboArgs(NamedTuple):
    """A lone layer's backward op, recomputed from its stashed input ``x``: `ForwardArgs`
    plus ``ct_y``, the cotangent of the layer's outputs."""

    x: Any
    state: Any
    rngs: jax.Array
    ct_y: Any


class ReverseArgs(NamedTuple):
    """A reversible layer's (or a scanned run's) backward op, its input reconstructed from
    its output (leading device axis on every leaf).

    Attributes:
      y: the output stack items (a run's top ``n_items``: the scan's carry), from which
        the input is reconstructed.
      ct_y: their cotangents (a scan carries them too).
      state: the state before the forward pass (a run's: per group position, stacked over
        repetitions, ``[devices, repeats, ...]``).
      new_state: likewise, after it.
      rngs: the step's key data ``[devices, n_layers, *key]``.
      kept: a scanned run's ``keep_every`` copies (per carry item ``[devices,
        len(run.kept), ...]``), from which its kept layers are recomputed instead; None
        for a lone layer or a run without any.
    """

    y: Any
    ct_y: Any
    state: Any
    new_state: Any
    rngs: jax.Array
    kept: Any = None


class LossArgs(NamedTuple):
    """The loss layer's fbo: the final stack ``x``, ``state``, ``rngs`` and
    ``batch_weights``, the batch's third item (per-position loss weights) or None for a
    batch without weights (every device's share is then equal)."""

    x: Any
    state: Any
    rngs: jax.Array
    batch_weights: Any


CONSUMED: dict[type, tuple[str, ...]] = {
    ForwardArgs: ("x",),
    FboArgs: ("ct_y",),
    ReverseArgs: ("y", "ct_y"),
    LossArgs: (),
}
"""Per argument type, the fields its programs consume and donate (the table above). What
moves on is not consumed: a ``LOSS`` op's ``x`` (the final stack) is the first backward
op's ``y``, a recomputing backward op's ``x`` (its stash) the stack below it, so of an
`FboArgs` only ``ct_y`` is."""


STACK: dict[type, str] = {
    ForwardArgs: "x",
    FboArgs: "x",
    ReverseArgs: "y",
    LossArgs: "x",
}
"""Per argument type, the field that holds the layer's stack (its input, or its output
for a reverse op): the one whose length axis is the sequence's (`stack_of`)."""


def stack_of(args: Any) -> Any:
    """The stack items of typed ``args`` (`STACK`): what
    `revtrain.parallel.collectives.gathering_shard_map` reads the sequence length from."""
    return getattr(args, STACK[type(args)])


class Shared(NamedTuple):
    """Replicated scalars of a program call.

    Attributes:
      index: int32, the flat layer index (selects the layer's key from ``rngs``; a run's
        first layer for a scan program).
      lr: float32 learning rate to inject, or None.
      clip: None, or float32 ``(global_norm, max_norm)``: the gradient is scaled as
        ``optax.clip_by_global_norm`` would scale the whole model's before the update.
    """

    index: jax.Array
    lr: jax.Array | None = None
    clip: tuple[jax.Array, jax.Array] | None = None


class LayerStats(NamedTuple):
    """Norms of one layer's update, float32 scalars of global arrays (a scanned run's:
    ``[n]`` vectors over its flat layers, in order)."""

    gradients_l2: jax.Array
    weights_l2: jax.Array


class ForwardOut(NamedTuple):
    """A forward program's outputs.

    Attributes:
      y: the layer's (run's) output stack items, per device.
      new_state: its state after the pass (a run's stacked as in `ForwardArgs`).
      copies: a scan's ``keep_every`` copies (per carry item ``[devices, n_kept, ...]``),
        or None.
    """

    y: Any
    new_state: Any
    copies: Any = None


class FboOut(NamedTuple):
    """A standard layer's fbo: ``ct_x`` (its input's cotangent, per device), the updated
    ``new_params`` (in the donated buffers) and its `LayerStats`."""

    ct_x: Any
    new_params: Params | None
    stats: LayerStats | None


class ReverseOut(NamedTuple):
    """A reversible layer's (or scanned run's) reverse-and-fbo: the reconstructed input
    ``x``, its cotangent ``ct_x`` (both per device), ``new_params`` and ``stats``."""

    x: Any
    ct_x: Any
    new_params: Params | None
    stats: LayerStats | None


class LossOut(NamedTuple):
    """The loss layer's fbo.

    Attributes:
      loss: float32 scalar, the weighted mean loss over the global batch.
      ct_x: the final stack's cotangent, per device (each device's share of the loss).
      new_params: the loss layer's updated weights and slots.
      new_state: its state after the pass, per device.
      stats: its `LayerStats`.
    """

    loss: jax.Array
    ct_x: Any
    new_params: Params | None
    new_state: Any
    stats: LayerStats | None


class NormOut(NamedTuple):
    """A norm finisher's program (exact global-norm clipping's first backward pass): what
    moves the pass on and the squared norm of the global gradient; nothing is updated.

    Attributes:
      x: the reconstructed input (of a `ReverseArgs` op), or None.
      ct_x: the input's cotangent.
      squared_norm: float32, the layer's squared gradient norm (a scanned run's ``[n]``
        vector, last layer first).
    """

    x: Any
    ct_x: Any
    squared_norm: jax.Array


__all__ = ["CONSUMED", "STACK", "FboArgs", "FboOut", "ForwardArgs", "ForwardOut", "LayerStats",
           "LossArgs", "LossOut", "NormOut", "ReverseArgs", "ReverseOut", "Shared",
           "stack_of"]
