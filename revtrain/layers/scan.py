"""Running layers in series with ``lax.scan`` over repeated runs: one compiled copy per run.

A deep model repeats one group of layers (a Transformer block, a RevNet unit) many times.
Unrolled, its compiled program holds one copy of the group per repetition and XLA's compile
time grows faster than the depth. `run_in_series` finds maximal runs of a group of ``p``
consecutive layers repeated ``k >= MIN_REPEATS`` times (``p <= MAX_PERIOD``) and runs each
run as one ``jax.lax.scan`` over the group's weights and states stacked along a new leading
axis (the scan-over-layers technique of flax ``nn.scan`` and MaxText), so the program holds
one copy of the group whatever ``k`` is.

A run is scanned only when it provably computes what the unrolled layers compute:

* every layer of the group has a non-None `Layer.structure_key` and the ``i``-th layer of
  each repetition has the same key and the same weights and state signature (tree
  structure, shapes, dtypes) as the ``i``-th layer of the first;
* the group leaves as many stack items as it takes (``n_in == n_out`` of the group; items
  below pass through untouched), and its outputs have the shapes, dtypes and sharding
  types of its inputs (checked by abstract evaluation; when only the first repetition
  changes them, it runs unrolled and the rest is scanned).

Results are exactly those of the unrolled layers: each layer gets the key it gets unrolled
(``jax.random.split(rng, n)[i]`` for layer ``i``, as `Serial`), the same weights and state,
and its new state is returned in its own slot. Public weights and states keep their layout
(one entry per layer); stacking happens inside the traced function, so it costs one
transient copy of the run's weights and states.

With a `revtrain.layers.remat.RematSchedule`, groups of layers run under one
``jax.checkpoint`` each (a scanned run: its scan body, or an inner scan over a group of
repetitions), so the backward pass keeps one input per group; values are unchanged.

Reference: the flax ``nn.scan`` lifted transform and MaxText's ``scan_layers`` option
(and its ``remat_policy``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revtrain.layers.layer import Layer, State, Weights
from revtrain.layers.remat import RematSchedule
from revtrain.layers.stack import inputs_from_stack, outputs_onto_stack

MIN_REPEATS = 2
"""The fewest repetitions of a group that are scanned (two copies are already one too many)."""

MAX_PERIOD = 8
"""The most layers in a repeated group (a reversible Transformer block is four)."""


@jax.tree_util.register_pytree_node_class
class StackedRun:
    """The weights (or gradients, or slots) of one run, stacked.

    Attributes:
      per_position: one tree per position ``j < period`` of the repeated group, each leaf
        ``[repeats, *leaf]``; entry ``t`` is the run's layer ``t * period + j``.
      period: layers in the repeated group.
      repeats: repetitions of the group.
    """

    def __init__(self, per_position: tuple, period: int, repeats: int):
        self.per_position, self.period, self.repeats = tuple(per_position), period, repeats

    def tree_flatten(self):
        return (self.per_position,), (self.period, self.repeats)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def layer_values(self, split: Callable[[Any, int], Any] = lambda a, t: a[t]) -> list:
        """One tree per layer of the run, in order (``split(leaf, t)`` takes entry ``t``)."""
        return [jax.tree.map(lambda a, t=t: split(a, t), self.per_position[j])
                for t in range(self.repeats) for j in range(self.period)]

    def __repr__(self) -> str:
        return f"StackedRun(period={self.period}, repeats={self.repeats})"


def _tree_signature(tree: Any) -> tuple:
    """Tree structure and every leaf's shape and dtype."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(leaf), jnp.result_type(leaf)) for leaf in leaves)


def layer_signature(layer: Layer, weights: Weights, state: State) -> Hashable | None:
    """What must be equal for two layers to share one scan body; None: never scanned."""
    key = layer.structure_key
    if key is None:
        return None
    return key, _tree_signature(weights), _tree_signature(state)


def plan_runs(signatures: Sequence[Hashable | None], max_period: int = MAX_PERIOD,
              min_repeats: int = MIN_REPEATS) -> list[tuple[int, int, int]]:
    """Splits a layer list into segments ``(start, period, repeats)``, in order.

    Greedy from the left: at each position the period (``1..max_period``) whose repetition
    covers the most layers wins (the smallest on ties); a position where no group repeats
    ``min_repeats`` times is a single unrolled layer, ``(start, 1, 1)``.

    Args:
      signatures: one per layer (`layer_signature`); None never matches.
      max_period: the largest group size tried.
      min_repeats: the fewest repetitions worth a scan (>= 2).

    Returns:
      Segments covering ``range(len(signatures))``; ``repeats >= min_repeats`` for a run.
    """
    n, start, segments = len(signatures), 0, []
    while start < n:
        best = (1, 1)
        for period in range(1, max_period + 1):
            group = list(signatures[start:start + period])
            if start + min_repeats * period > n or None in group:
                break
            repeats = 1
            while signatures[start + repeats * period:start + (repeats + 1) * period] == group:
                repeats += 1
            if repeats >= min_repeats and period * repeats > best[0] * best[1]:
                best = (period, repeats)
        segments.append((start, *best))
        start += best[0] * best[1]
    return segments


def serial_arity(layers: Sequence[Layer]) -> tuple[int, int]:
    """Returns ``(n_in, n_out)`` of running ``layers`` one after another on a stack."""
    needed, have = 0, 0
    for layer in layers:
        if layer.n_in > have:
            needed += layer.n_in - have
            have = layer.n_in
        have += layer.n_out - layer.n_in
    return needed, have


def _run_group(layers: Sequence[Layer], stack: Any, weights: Sequence, states: Sequence,
               keys: Sequence) -> tuple[Any, tuple]:
    new_states = []
    for layer, w, s, r in zip(layers, weights, states, keys, strict=True):
        y, new_s = layer.pure_fn(inputs_from_stack(stack, layer.n_in), w, s, r)
        stack = outputs_onto_stack(y, stack, layer.n_in)
        new_states.append(new_s)
    return stack, tuple(new_states)


def _keeps_types(layers: Sequence[Layer], carry: Any, weights: Sequence, states: Sequence,
                 keys: Sequence) -> bool:
    """Whether running the group once gives a carry of the input carry's abstract types
    (tree structure; shape, dtype, weak type and device variance of every leaf)."""
    jaxpr, out_tree = jax.make_jaxpr(
        lambda c, w, s, k: _run_group(layers, c, w, s, k)[0], return_shape=True)(
            carry, weights, states, keys)
    leaves, treedef = jax.tree.flatten(carry)
    return (treedef == jax.tree.structure(out_tree)
            and [jax.typeof(leaf) for leaf in leaves] == list(jaxpr.out_avals))


def _stacked(trees: Sequence[Any]) -> Any:
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _scan_run(layers: Sequence[Layer], repeats: int, stack: Any, per_position: tuple,
              states: Sequence, keys: jax.Array | None,
              remat: RematSchedule | None = None) -> tuple[Any, list]:
    """Runs ``layers`` (one group) ``repeats`` times by ``lax.scan`` over ``per_position``
    (a `StackedRun`'s stacked weights); states and keys (an array, or None) are flat over
    the run (``repeats * len(layers)`` entries). ``remat``: `_scan_in_groups`."""
    p, (n_in, _) = len(layers), serial_arity(layers)
    stacked_states = tuple(_stacked(states[j::p]) for j in range(p))
    xs_keys = None if keys is None else keys.reshape((repeats, p) + keys.shape[1:])

    def body(carry, xs):
        group_weights, group_states, group_keys = xs
        group_keys = [None] * p if group_keys is None else list(group_keys)
        return _run_group(layers, carry, group_weights, group_states, group_keys)

    xs = (tuple(per_position), stacked_states, xs_keys)
    scan = jax.lax.scan if remat is None else functools.partial(_scan_in_groups, remat=remat)
    carry, new_states = scan(body, inputs_from_stack(stack, n_in), xs, length=repeats)
    stack = outputs_onto_stack(carry, stack, n_in)
    flat_states = [jax.tree.map(lambda a, i=i: a[i], new_states[j])
                   for i in range(repeats) for j in range(p)]
    return stack, flat_states


def _scan_in_groups(body: Callable, carry: Any, xs: Any, length: int,
                    remat: RematSchedule) -> tuple[Any, Any]:
    """``lax.scan(body, carry, xs, length=length)`` with ``remat.every`` iterations per
    ``jax.checkpoint``: every iteration checkpointed (``every == 1``), else a scan over
    groups (``xs`` reshaped to ``[length // every, every, ...]``), each group an inner
    scan under one checkpoint, and the remainder (``length % every`` iterations, sliced
    off: a copy of its share of ``xs``) one more, shorter group."""
    every = min(remat.every, length)
    if every == 1:
        return jax.lax.scan(remat.checkpointed(body, in_scan=True), carry, xs, length=length)
    n_groups, rest = divmod(length, every)

    def group(carry, group_xs, size=every):
        return jax.lax.scan(body, carry, group_xs, length=size)

    head = xs if not rest else jax.tree.map(lambda a: a[:n_groups * every], xs)
    grouped = jax.tree.map(lambda a: a.reshape((n_groups, every) + a.shape[1:]), head)
    carry, ys = jax.lax.scan(remat.checkpointed(group, in_scan=True), carry, grouped,
                             length=n_groups)
    ys = jax.tree.map(lambda a: a.reshape((n_groups * every,) + a.shape[2:]), ys)
    if rest:
        tail = jax.tree.map(lambda a: a[n_groups * every:], xs)
        carry, tail_ys = remat.checkpointed(functools.partial(group, size=rest))(carry, tail)
        ys = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), ys, tail_ys)
    return carry, ys


class _Units:
    """Units of a series (a layer outside runs, or one repetition of a run's group) that
    wait to run unrolled, in order: together, or ``remat.every`` per ``jax.checkpoint``
    (`revtrain.layers.remat.RematSchedule`); ``new_states`` collects the series' new
    states, one per layer."""

    def __init__(self, layers: Sequence[Layer], weights: list, state: list, keys: list,
                 remat: RematSchedule | None):
        self._values = (layers, weights, state, keys)  # ``weights`` is updated in place.
        self._remat, self._units, self.new_states = remat, [], []

    def add(self, start: int, end: int) -> None:
        self._units.append((start, end))

    def run(self, stack: Any) -> Any:
        """Runs the waiting units on ``stack``; returns the new stack."""
        for start, end, checkpoint in self._groups():
            layers, weights, state, keys = (v[start:end] for v in self._values)
            fn = functools.partial(_run_group, layers)
            if checkpoint:
                fn = self._remat.checkpointed(fn)
            stack, states = fn(stack, weights, state, keys)
            self.new_states += states
        self._units = []
        return stack

    def _groups(self) -> list[tuple[int, int, bool]]:
        """``(start, end, checkpointed)`` of each group of consecutive units."""
        units, remat, n = self._units, self._remat, len(self._values[0])
        if not units:
            return []
        if remat is None:
            return [(units[0][0], units[-1][1], False)]
        last = [] if remat.include_last or units[-1] != (n - 1, n) else [(n - 1, n, False)]
        units = units[:len(units) - len(last)]
        return [(units[i][0], units[min(i + remat.every, len(units)) - 1][1], True)
                for i in range(0, len(units), remat.every)] + last


def _segments(layers: Sequence[Layer], weights: list, state: list) -> list:
    """``(start, period, repeats)`` per segment: a `StackedRun` entry's own run, else
    `plan_runs`' (a list holding stacked runs was planned when they were stacked)."""
    if any(isinstance(w, StackedRun) for w in weights):
        segments, i = [], 0
        while i < len(weights):
            w = weights[i]
            segments.append((i, w.period, w.repeats) if isinstance(w, StackedRun) else (i, 1, 1))
            i += segments[-1][1] * segments[-1][2]
        return segments
    return plan_runs([layer_signature(layer, w, s)
                      for layer, w, s in zip(layers, weights, state, strict=True)])


def run_in_series(layers: Sequence[Layer], stack: Any, weights: Weights, state: State,
                  rng: jax.Array | None, scan: bool = True,
                  remat: RematSchedule | None = None) -> tuple[Any, tuple]:
    """Runs ``layers`` one after another on ``stack``, scanning repeated runs.

    Args:
      layers: the layers, in order.
      stack: the input stack (one array or a tuple, top first).
      weights: one entry per layer; a run's entries may be kept stacked (a `StackedRun`
        at its first index, None at the others: `revtrain.layers.run_layout`).
      state: one entry per layer.
      rng: split into one key per layer (``jax.random.split(rng, len(layers))``, as
        `Serial`); None gives every layer None.
      scan: False runs every layer unrolled (stacked runs are split first).
      remat: run groups of layers under one ``jax.checkpoint`` each, as this
        `revtrain.layers.remat.RematSchedule` says (the same groups scanned or unrolled);
        None: no checkpoints.

    Returns:
      ``(stack, new_states)``, ``new_states`` one per layer: the values the unrolled
      layers give (with ``remat``, to float rounding: XLA may fuse a recomputation
      differently).
    """
    weights, state = list(weights), list(state)
    all_keys = None if rng is None or not layers else jax.random.split(rng, len(layers))
    keys = [None] * len(layers) if all_keys is None else list(all_keys)
    segments = _segments(layers, weights, state)
    if not scan or len(layers) < MIN_REPEATS:
        if remat is None:
            return _run_group(layers, stack, _split_stacked(weights), state, keys)
        weights, scan = _split_stacked(weights), False
    units = _Units(layers, weights, state, keys, remat)
    for start, period, repeats in segments:
        if repeats == 1:
            units.add(start, start + period)
            continue
        stack = units.run(stack)  # A run is grouped on its own.
        while repeats:
            group = layers[start:start + period]
            end = start + period * repeats
            stacked = weights[start] if isinstance(weights[start], StackedRun) else None
            first = (weights[start:start + period] if stacked is None else
                     [jax.tree.map(lambda a: a[0], w) for w in stacked.per_position])
            if scan and repeats >= MIN_REPEATS and _scannable(
                    group, stack, first, state[start:end], keys[start:end]):
                per_position = (tuple(_stacked(weights[start + j:end:period])
                                      for j in range(period))
                                if stacked is None else stacked.per_position)
                run_keys = None if all_keys is None else all_keys[start:end]
                stack, run_states = _scan_run(group, repeats, stack, per_position,
                                              state[start:end], run_keys, remat)
                units.new_states += run_states
                break
            if stacked is not None:  # Entries of a stacked run that is not scanned.
                weights[start:end] = stacked.layer_values()
            if not scan:  # Every repetition unrolled, grouped as a scan would group them.
                for t in range(repeats):
                    units.add(start + t * period, start + (t + 1) * period)
                stack = units.run(stack)
                break
            # The first repetition runs unrolled; the rest may still be a run.
            units.add(start, start + period)
            stack = units.run(stack)
            start, repeats = start + period, repeats - 1
    return units.run(stack), tuple(units.new_states)


def _split_stacked(weights: Sequence) -> list:
    """Per-layer weights, each `StackedRun` (and its placeholders) split into its layers'."""
    out = list(weights)
    for i, w in enumerate(weights):
        if isinstance(w, StackedRun):
            out[i:i + w.period * w.repeats] = w.layer_values()
    return out


def _scannable(group: Sequence[Layer], stack: Any, weights: Sequence, states: Sequence,
               keys: Sequence) -> bool:
    """Whether the group's carry keeps its count and types (`_keeps_types`)."""
    n_in, n_out = serial_arity(group)
    if n_in != n_out:
        return False
    p = len(group)
    carry = inputs_from_stack(stack, n_in)
    return _keeps_types(group, carry, weights[:p], states[:p], keys[:p])


__all__ = ["MAX_PERIOD", "MIN_REPEATS", "StackedRun", "layer_signature", "plan_runs",
           "run_in_series", "serial_arity"]
