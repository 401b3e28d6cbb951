"""Donation by field: a block-trainer program gives the buffers it consumes to its outputs.

Every program of a block step takes typed arguments (`revtrain.trainers.block.contract`), and
each argument type names the fields the program *consumes* (`contract.CONSUMED`): the stack
items it replaces and the cotangents it turns into its input's. `Program` donates those
fields' buffers (and, for an updating program, the layer's `Params`), so

* an output written in a consumed item's place reuses its buffer (a half-residual's
  ``x1 + F(x2)`` in ``x1``'s, a reverse op's reconstructed input in its output's), and
* an item that passes through unchanged (the half-residual's ``x2``, the untouched
  cotangent) comes back in its own buffer: without donation ``jax.jit`` would copy it to a
  new output.

``jax.jit`` donates whole arguments; a `Program` is ``jax.jit`` of the function over its
arguments' *leaves*, donating each consumed leaf that an output of the same shape and dtype
can take (as ``jax.jit`` pairs them: outputs in order, each with the first unpaired donated
input of its shape and dtype). A consumed leaf no output can take (an embedding's token
ids, a loss layer's integer targets) is not donated, so no "donated buffers were not
usable" warning is raised and nothing is copied for it.

A donated buffer is deleted by the call, so what a program consumes must be nobody else's:
`owned` replaces each leaf the program will donate that something else still holds (a
stash, the stack below, the step's batch, the final activations the update pass reads
again) or that appears twice by a copy. The executor
(`revtrain.trainers.block.executor`) passes every program's arguments through it.

References: JAX's buffer donation (https://docs.jax.dev/en/latest/faq.html#buffer-donation);
XLA's ``memory_analysis`` (``alias_size_in_bytes``) measures what a program reuses.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revtrain.trainers.block.contract import CONSUMED


def _aval(leaf: Any) -> tuple:
    return tuple(leaf.shape), np.dtype(leaf.dtype)


def _field_ranges(args: Any) -> dict[str, range]:
    """Per field of the typed ``args``, the positions of its leaves among ``args``'s."""
    ranges, start = {}, 0
    for name, value in zip(args._fields, args, strict=True):
        n = len(jax.tree.leaves(value))
        ranges[name] = range(start, start + n)
        start += n
    return ranges


def _paired(candidates: list[int], in_avals: list, out_avals: list) -> set[int]:
    """The donated ``candidates`` (leaf positions, in order) that ``jax.jit`` pairs with
    an output: each output, in order, takes the first unpaired candidate of its shape and
    dtype (``jax._src.interpreters.mlir._set_up_aliases``)."""
    free = collections.defaultdict(collections.deque)
    for k in candidates:
        free[in_avals[k]].append(k)
    paired = set()
    for aval in out_avals:
        if free[aval]:
            paired.add(free[aval].popleft())
    return paired


class Program:
    """A jitted block-trainer program that donates what it consumes.

    Called as ``program(args, values, shared)`` (or ``.lower(args, values, shared)``), as
    ``fn`` is. Donated: the leaves of ``args``'s consumed fields (`contract.CONSUMED` of its
    type) that an output can take, and with ``donate_values`` every leaf of ``values``
    (the layer's `Params`, which the update's ``new_params`` reuse). Nothing else.

    One ``jax.jit`` per pytree structure and shapes of the arguments (the pairing depends on
    them); its function is one per structure, so tracing happens once for the pairing's
    ``eval_shape`` and the jit together (``jax.jit`` caches the trace by function).

    Args:
      fn: ``(args, values, shared) -> typed outputs``, not jitted.
      donate_values: donate ``values`` too (an updating program).
    """

    def __init__(self, fn: Callable, donate_values: bool):
        self._fn = fn
        self._donate_values = donate_values
        self._flat: dict[Any, Callable] = {}
        self._jitted: dict[Any, tuple[Callable, tuple[bool, ...]]] = {}

    def _flat_fn(self, treedef: Any) -> Callable:
        if treedef not in self._flat:
            self._flat[treedef] = lambda *leaves: self._fn(*treedef.unflatten(leaves))
        return self._flat[treedef]

    def _entry(self, args: Any, values: Any, shared: Any) -> tuple[Callable, tuple, tuple]:
        """``(jitted flat function, leaves, donated mask over args's leaves)``."""
        leaves, treedef = jax.tree.flatten((args, values, shared))
        key = (treedef, *[(leaf.shape, leaf.dtype) for leaf in leaves])
        if key not in self._jitted:
            self._jitted[key] = self._donating(args, values, treedef, leaves,
                                               [_aval(leaf) for leaf in leaves])
        jitted, mask = self._jitted[key]
        return jitted, leaves, mask

    def _donating(self, args: Any, values: Any, treedef: Any, leaves: list,
                  in_avals: list) -> tuple[Callable, tuple[bool, ...]]:
        n_args = len(jax.tree.leaves(args))
        ranges = _field_ranges(args)
        consumed = [k for name in CONSUMED[type(args)] for k in ranges[name]]
        given = (list(range(n_args, n_args + len(jax.tree.leaves(values))))
                 if self._donate_values else [])
        flat = self._flat_fn(treedef)
        outs = jax.tree.leaves(jax.jit(flat).eval_shape(*leaves))
        paired = _paired(consumed + given, in_avals, [_aval(o) for o in outs])
        donated = sorted(set(given) | (paired & set(consumed)))
        mask = tuple(k in donated for k in range(n_args))
        return jax.jit(flat, donate_argnums=tuple(donated)), mask

    def __call__(self, args: Any, values: Any, shared: Any) -> Any:
        jitted, leaves, _ = self._entry(args, values, shared)
        return jitted(*leaves)

    def lower(self, args: Any, values: Any, shared: Any) -> Any:
        """``jax.jit(...).lower`` of the call (abstract arguments welcome)."""
        jitted, leaves, _ = self._entry(args, values, shared)
        return jitted.lower(*leaves)

    def trace(self, args: Any, values: Any, shared: Any) -> Any:
        """``jax.jit(...).trace`` of the call: its jaxpr, and ``lower()`` from it."""
        jitted, leaves, _ = self._entry(args, values, shared)
        return jitted.trace(*leaves)

    def donated(self, args: Any, values: Any, shared: Any) -> tuple[bool, ...]:
        """Per leaf of ``args`` (``jax.tree.leaves`` order), whether the call donates it."""
        return self._entry(args, values, shared)[2]


def consumed_leaves(args: Any) -> tuple[bool, ...]:
    """Per leaf of ``args`` (``jax.tree.leaves`` order), whether it is in a field its
    programs consume (`contract.CONSUMED`): what a `Program` may donate."""
    consumed = {k for name in CONSUMED[type(args)] for k in _field_ranges(args)[name]}
    return tuple(k in consumed for k in range(len(jax.tree.leaves(args))))


def owned(args: Any, donated: tuple[bool, ...], held: Any,
          copy: Callable[[Any], Any]) -> Any:
    """``args`` with each leaf that the call donates (``donated``, per leaf: a
    `Program.donated` mask) and that something else also holds -- ``held`` (what stays in
    use after the call: stashes, the stack below, the batch), a leaf the call does not
    donate, or an earlier donated leaf -- replaced by ``copy(leaf)``, so that the call
    deletes nothing in use.

    Works on abstract values too (`jax.ShapeDtypeStruct`, by identity as arrays are):
    precompiling passes `consumed_leaves` as ``donated``, a superset, so that every copy a
    step can make is compiled ahead.
    """
    leaves, treedef = jax.tree.flatten(args)
    seen = {id(leaf) for leaf in jax.tree.leaves(held)}
    seen |= {id(leaf) for leaf, d in zip(leaves, donated, strict=True) if not d}

    def own(leaf, d):
        if d and isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
            if id(leaf) in seen:
                leaf = copy(leaf)
            seen.add(id(leaf))
        return leaf
    return treedef.unflatten([own(leaf, d) for leaf, d in zip(leaves, donated, strict=True)])


@jax.jit
def copy(leaf: jax.Array) -> jax.Array:
    """A new buffer holding ``leaf`` (same sharding): what `owned` donates in its place."""
    return jnp.copy(leaf)


__all__ = ["Program", "consumed_leaves", "copy", "owned"]
