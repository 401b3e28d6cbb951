"""Initialising layers run in series; a run of equal layers by one init, vmapped.

`init_in_series` is the init of `revtrain.layers.Serial` and
`revtrain.layers.ReversibleSerial`: layer ``i`` gets key ``i`` of ``jax.random.split(rng,
n)`` and the signature of the stack its predecessors leave. A deep model repeats one group
of layers; initialised one layer at a time, the group's init is traced and dispatched once
per repetition (and every layer's output signature derived by one ``jax.eval_shape``), so
init time grows with the depth. Here a run of a group repeated ``k >= 8`` times
(`MIN_VMAPPED_REPEATS`) is initialised by one trace of the group's init, ``jax.vmap``-ped
over the run's keys (``[k, period]``); each layer is then given its slice. The group's
random draws run as one batched op each, whose program is compiled once whatever ``k`` is.

Runs are found as `revtrain.layers.scan` finds them for the forward pass
(`revtrain.layers.scan.plan_runs`), from the layers' structure keys alone (nothing is
initialised yet); a run is vmapped only when

* the group leaves as many stack items as it takes, with the shapes and dtypes it took
  (derived by ``jax.eval_shape`` inside the trace: no values), so every repetition sees
  one input signature -- when only the first repetition changes them (e.g. ``Dense(2)``
  layers on a wider input) that one is initialised alone and the rest is still a run;
* every repetition has as many layers under it as the first (equal structure keys make
  that so), and
* the group's init sets traced values only in what `Layer.init` sets (`OWN_VALUES`:
  weights, state, rng), which are then replaced by each layer's concrete slice.

Otherwise, or when tracing the vmapped init raises (a layer whose init reads a value in
Python), the run is initialised layer by layer, as before, with every attribute of the
layers touched by the trace put back first: an init that works eagerly works here, no
tracer is left in a layer, and errors are the same `revtrain.layers.LayerError` naming the
failing layer. The values are bitwise those of the layer-by-layer init (threefry random
bits do not depend on vmap; the tests check it on CPU).

The init is not jitted as a whole: XLA compiles every random draw of a program anew (the
threefry hash is most of its compile time), while eager ops compile one program per shape
and reuse it, so one program for a whole model compiled slower than the eager ops it
replaced (8 s against 5 s for the benchmarks' depth-2 LM, on a shared 2-core CPU), and
XLA's folding of an initialiser's constants (``normal * stddev``) changed values by one
ulp.

Reference: flax's ``nn.scan`` / ``nn.vmap`` lifted transforms, which initialise stacked
layers from split keys the same way (``variable_axes={'params': 0}``, ``split_rngs``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from revtrain.layers.layer import Layer
from revtrain.layers.scan import MIN_REPEATS, plan_runs, serial_arity
from revtrain.layers.signatures import signature_of
from revtrain.layers.stack import inputs_from_stack, outputs_onto_stack

MIN_VMAPPED_REPEATS = 8
"""Fewest repetitions a run needs to be initialised by the vmapped init: a vmapped draw
compiles a program for its ``[repeats, ...]`` shape, where a shallow run's layer-by-layer
init reuses the programs of one layer's shapes. On a 2-core CPU the vmapped init of the
benchmarks' LM cost about 0.5 s more than the layer-by-layer one at depths 2 to 8 and
saved 1.5 to 4 s at depth 32 (a test suite of shallow models ran 10% longer with every run
vmapped)."""

OWN_VALUES = ("_weights", "_state", "_rng", "_initialized")
"""What `Layer.init` sets on a layer object (its own values): a run's other layers get
these from the vmapped init, and nothing else may be left holding a traced value."""


class _CarryChanges(Exception):
    """Raised while tracing a group whose outputs differ from its inputs in shape or dtype."""


class _NotVmappable(Exception):
    """Raised while tracing a group whose init keeps traced values outside `OWN_VALUES`."""


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _layers_in(layers: Sequence[Layer]) -> list[Layer]:
    """The layers and every layer under them, depth first (pre-order), in order."""
    out, pending = [], list(reversed(layers))
    while pending:
        layer = pending.pop()
        out.append(layer)
        pending.extend(reversed(layer.sublayers))
    return out


def _own_values(layer: Layer) -> tuple:
    return tuple(getattr(layer, name) for name in OWN_VALUES)


def _leaks(layers: Sequence[Layer]) -> bool:
    """Whether an attribute outside `OWN_VALUES` of one of ``layers`` holds a tracer."""
    return any(name not in OWN_VALUES and any(map(_is_traced, jax.tree.leaves(value)))
               for layer in layers for name, value in vars(layer).items())


def _split_arrays(tree: Any) -> tuple[list, Callable[[Sequence], Any]]:
    """``(arrays, rebuild)``: the JAX array leaves of ``tree`` (traced or not) and
    ``rebuild(values)``, which gives ``tree`` with ``values`` in their places, a copy of
    each NumPy leaf and every other leaf (None, Python scalars) as it was.

    A vmapped init returns every JAX array, so an array that does not depend on the key
    (``jnp.ones``) is broadcast and each layer gets a buffer of its own, as it does when
    initialised alone (two layers sharing one buffer could not both donate it)."""
    leaves, treedef = jax.tree.flatten(tree)
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, jax.core.Tracer))]

    def rebuild(values: Sequence) -> Any:
        out = [np.array(leaf) if isinstance(leaf, np.ndarray) else leaf for leaf in leaves]
        for i, value in zip(at, values, strict=True):
            out[i] = value
        return jax.tree.unflatten(treedef, out)

    return [leaves[i] for i in at], rebuild


def init_in_series(layers: Sequence[Layer], input_signature: Any,
                   rng: jax.Array | None) -> tuple[tuple, tuple]:
    """Initialises ``layers`` run one after another on a stack, as `Serial` does.

    Args:
      layers: the layers, in order.
      input_signature: `revtrain.layers.ShapeDtype` pytree of the stack they start from.
      rng: PRNG key; layer ``i`` gets ``jax.random.split(rng, len(layers))[i]``; None gives
        every layer None (its own ``rng``), and no run is vmapped.

    Returns:
      ``(weights, states)``: tuples with one entry per layer; each layer keeps its own.

    Raises:
      LayerError: from the failing layer's `revtrain.layers.Layer.init`.
    """
    n = len(layers)
    if rng is None or not n:
        weights, states, _ = _one_by_one(layers, input_signature, [None] * n)
        return tuple(weights), tuple(states)
    keys = jax.random.split(rng, n)
    weights, states, stack = [], [], input_signature
    for start, period, repeats in plan_runs([layer.structure_key for layer in layers]):
        while repeats:
            end = start + period * repeats
            try:
                run = (_init_run(layers[start:end], period, stack, keys, start)
                       if repeats >= max(MIN_REPEATS, MIN_VMAPPED_REPEATS) else None)
            except _CarryChanges:  # The first repetition alone; the rest may be a run.
                end = start + period
            else:
                if run is not None:  # A run leaves the stack's signature as it was.
                    weights += run[0]
                    states += run[1]
                    break
            w, s, stack = _one_by_one(layers[start:end], stack,
                                      [_row(keys, i) for i in range(start, end)])
            weights += w
            states += s
            start, repeats = end, repeats - (end - start) // period
    return tuple(weights), tuple(states)


def _one_by_one(layers: Sequence[Layer], stack: Any, keys: Sequence) -> tuple[list, list, Any]:
    """Initialises ``layers`` one at a time; returns their weights, states and the stack."""
    weights, states = [], []
    for layer, key in zip(layers, keys, strict=True):
        inputs = inputs_from_stack(stack, layer.n_in)
        w, s = layer.init(inputs, rng=key)
        weights.append(w)
        states.append(s)
        stack = outputs_onto_stack(layer.output_signature(inputs), stack, layer.n_in)
    return weights, states, stack


def _shapes(signature: Any) -> tuple:
    """Tree structure, and shape and dtype of every leaf, of a signature."""
    leaves, treedef = jax.tree.flatten(signature)
    return treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves)


def _init_run(layers: Sequence[Layer], period: int, stack: Any, keys: jax.Array,
              start: int) -> tuple[list, list] | None:
    """Initialises a run (``layers``: a group of ``period`` layers, repeated, which get
    ``keys[start:]``) by one init of the group, vmapped over the repetitions' keys; returns
    the run's weights and states, one per layer, or None where the run must be
    initialised layer by layer. Either way no layer is left holding a tracer.

    Raises:
      _CarryChanges: when the group changes the shapes or dtypes of the items it takes.
    """
    group, repeats = layers[:period], len(layers) // period
    n_in, n_out = serial_arity(group)
    walks = [_layers_in(layers[t * period:(t + 1) * period]) for t in range(repeats)]
    if n_in != n_out or len({len(walk) for walk in walks}) != 1:
        return None
    carry = signature_of(inputs_from_stack(stack, n_in))
    saved, rebuilds = [dict(vars(sub)) for sub in walks[0]], []

    def init_group(group_keys: jax.Array) -> list:
        weights, states, signature = [], [], carry
        for layer, key in zip(group, group_keys, strict=True):
            inputs = inputs_from_stack(signature, layer.n_in)
            w, s = layer.init(inputs, rng=key)
            weights.append(w)
            states.append(s)
            signature = outputs_onto_stack(layer.output_signature(inputs), signature,
                                           layer.n_in)
        if _shapes(signature) != _shapes(carry):
            raise _CarryChanges
        if _leaks(walks[0]):
            raise _NotVmappable
        arrays, rebuild = _split_arrays((weights, states, [_own_values(s) for s in walks[0]]))
        rebuilds.append(rebuild)
        return arrays

    try:
        stacked = jax.vmap(init_group)(_group_keys(keys, start, repeats, period))
    except Exception as e:  # noqa: BLE001 -- initialised layer by layer, raising there
        for sub, attributes in zip(walks[0], saved, strict=True):  # Tracers out.
            vars(sub).clear()
            vars(sub).update(attributes)
        if isinstance(e, _CarryChanges):
            raise
        return None
    weights, states = [], []
    for t, walk in enumerate(walks):
        w, s, records = rebuilds[-1]([_row(leaf, t) for leaf in stacked])
        for sub, record in zip(walk, records, strict=True):
            for name, value in zip(OWN_VALUES, record, strict=True):
                setattr(sub, name, value)
        weights += w
        states += s
    return weights, states


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _group_keys(keys: jax.Array, start: int, repeats: int, period: int) -> jax.Array:
    """``keys[start:start + repeats * period]`` as ``[repeats, period]``, one program."""
    run = keys[start:start + repeats * period]
    return run.reshape((repeats, period) + run.shape[1:])


@jax.jit
def _row(array: jax.Array, index: int | jax.Array) -> jax.Array:
    """``array[index]``; the index is traced, so one program per array shape serves every
    row (eager indexing compiles two: a dynamic slice and a squeeze)."""
    return array[index]


__all__ = ["init_in_series"]
