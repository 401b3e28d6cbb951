"""Combinators: layers built from sublayers that route data on the stack.

All combinators keep ``weights``/``state`` as the tuple of their sublayers' and split their
rng into one key per sublayer, in order (``jax.random.split(rng, len(sublayers))``). The
trainers rely on this for `Serial`: splitting the same rng into per-layer keys outside the
model reproduces what `Serial` does inside it.

Reference: the Trax combinators (``trax.layers.combinators``), whose names and stack
semantics these follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from revtrain.layers.layer import Layer
from revtrain.layers.remat import RematSchedule
from revtrain.layers.scan import run_in_series, serial_arity
from revtrain.layers.sequence_parallel import check_not_split
from revtrain.layers.series_init import init_in_series
from revtrain.layers.stack import (
    check_n_items,
    check_per_sublayer,
    inputs_from_stack,
    stack_items,
    stack_of,
)


def flatten_layers(layers: Sequence[Any]) -> list[Layer]:
    """Flattens nested lists/tuples of layers and drops None (Trax's convention)."""
    flat = []
    for layer in layers:
        if layer is None:
            continue
        if isinstance(layer, (list, tuple)):
            flat.extend(flatten_layers(layer))
        elif isinstance(layer, Layer):
            flat.append(layer)
        else:
            raise TypeError(f"expected a Layer, got {type(layer).__name__}: {layer!r}; wrap "
                            f"functions with revtrain.layers.Fn")
    return flat


def split_rng(rng: jax.Array | None, n: int) -> list[jax.Array | None]:
    """Splits ``rng`` into ``n`` keys, as every combinator does; None stays None."""
    if rng is None or n == 0:
        return [None] * n
    return list(jax.random.split(rng, n))


class Serial(Layer):
    """Runs sublayers one after another on the stack: ``Serial(l1, l2, ...)``.

    Nested lists/tuples of layers are flattened and None is skipped (nested `Serial` objects
    are kept as they are). ``n_in``/``n_out`` follow from the sublayers' arities; stack items
    below those a sublayer uses pass through. The rng is split into one key per sublayer.

    Consecutive sublayers that repeat one group of equal structure (e.g. the blocks of a
    deep Transformer) run as one ``jax.lax.scan`` over their stacked weights, so the
    compiled program holds one copy of the group and compile time does not grow with the
    depth; results, keys and the weights/state layout are those of running them one by one
    (the rules are in `revtrain.layers.scan`). Likewise `init` initialises such a run by
    one init of the group, vmapped over the run's keys, with the values of initialising
    them one by one (`revtrain.layers.series_init`).

    A `Serial` runs every sublayer as it is; `revtrain.layers.fuse_loss_heads` turns one
    whose sublayers end in ``Dense, LogSoftmax`` and a cross-entropy loss (also across
    nested Serials) into a `revtrain.layers.FusedSerial` that computes those in chunks of
    positions, so the full logits never exist (same weights layout; the rules and the
    opt-out are in `revtrain.layers.fused_head`).

    Args:
      *layers: the sublayers (nested lists/tuples flattened, None skipped).
      name: the layer's name.
      scan: False runs every sublayer unrolled (e.g. for a layer whose Python code needs
        concrete values outside ``jit``).
    """

    def __init__(self, *layers: Any, name: str | None = None, scan: bool = True):
        sublayers = flatten_layers(layers)
        n_in, n_out = serial_arity(sublayers)
        super().__init__(n_in=n_in, n_out=n_out, name=name, sublayers=sublayers)
        self._initialized = not sublayers  # an empty combinator has nothing to initialise
        self._scan = scan

    @property
    def scan(self) -> bool:
        """Whether repeated groups of sublayers run as one ``jax.lax.scan``."""
        return self._scan

    def forward_with_state(self, x, weights, state, rng, remat: RematSchedule | None = None):
        """`Layer.forward_with_state`; ``remat`` runs groups of sublayers under
        ``jax.checkpoint`` (`revtrain.layers.remat.RematSchedule`; the trainer's
        ``Trainer(remat=...)``), with the same values to float rounding."""
        check_n_items(self, x)
        check_per_sublayer(self, weights=weights, state=state)
        return run_in_series(self.sublayers, x, weights, state, rng, scan=self._scan,
                             remat=remat)

    def init_weights_and_state(self, input_signature, rng):
        check_n_items(self, input_signature)
        return init_in_series(self.sublayers, input_signature, rng)


class _SideBySide(Layer):
    """Runs each sublayer on its own inputs and stacks all outputs, in sublayer order.

    Subclasses say which inputs each sublayer reads (`_inputs_per_sublayer`); the rng is
    split into one key per sublayer and weights/state are the tuples of the sublayers'.
    """

    def __init__(self, layers: Sequence[Any], n_in_of: Any, name: str | None):
        sublayers = [Select([0]) if layer is None else layer for layer in layers]
        sublayers = [Serial(s) if isinstance(s, (list, tuple)) else s for s in sublayers]
        super().__init__(n_in=n_in_of([s.n_in for s in sublayers]),
                         n_out=sum(s.n_out for s in sublayers), name=name,
                         sublayers=sublayers)
        self._initialized = not sublayers  # an empty combinator has nothing to initialise

    def _inputs_per_sublayer(self, x: Any) -> list[Any]:
        raise NotImplementedError

    def forward_with_state(self, x, weights, state, rng):
        check_n_items(self, x)
        check_per_sublayer(self, weights=weights, state=state)
        outputs, new_states = [], []
        for layer, xs, w, s, r in zip(self.sublayers, self._inputs_per_sublayer(x), weights,
                                      state, split_rng(rng, len(self.sublayers)), strict=True):
            y, new_s = layer.pure_fn(xs, w, s, r)
            outputs.extend(y if isinstance(y, tuple) else (y,))
            new_states.append(new_s)
        return stack_of(outputs), tuple(new_states)

    def init_weights_and_state(self, input_signature, rng):
        check_n_items(self, input_signature)
        weights, states = [], []
        for layer, xs, r in zip(self.sublayers, self._inputs_per_sublayer(input_signature),
                                split_rng(rng, len(self.sublayers)), strict=True):
            w, s = layer.init(xs, rng=r)
            weights.append(w)
            states.append(s)
        return tuple(weights), tuple(states)


class Parallel(_SideBySide):
    """Runs sublayers side by side on consecutive stack sections.

    ``Parallel(f, g)`` with ``f: a -> b`` and ``g: c -> d`` maps ``(a..., c...)`` to
    ``(b..., d...)``; ``n_in``/``n_out`` are the sums of the sublayers'. None is an identity
    on one item.
    """

    def __init__(self, *layers: Any, name: str | None = None):
        super().__init__(layers, sum, name)

    def _inputs_per_sublayer(self, x: Any) -> list[Any]:
        items = stack_items(x)
        sections, start = [], 0
        for layer in self.sublayers:
            section = items[start:start + layer.n_in]
            sections.append(section[0] if layer.n_in == 1 else tuple(section))
            start += layer.n_in
        return sections


class Branch(_SideBySide):
    """Runs each sublayer on (copies of) the top of the stack and stacks all outputs.

    ``Branch(f, g)`` with ``f: a -> b`` and ``g: a -> c`` maps ``a`` to ``(b, c)``. Each
    sublayer reads the top ``sublayer.n_in`` items; ``n_in`` is the largest of those. None
    copies the top item.
    """

    def __init__(self, *layers: Any, name: str | None = None):
        super().__init__(layers, lambda n_ins: max(n_ins, default=0), name)

    def _inputs_per_sublayer(self, x: Any) -> list[Any]:
        return [inputs_from_stack(x, layer.n_in) for layer in self.sublayers]


class Residual(Serial):
    """``x -> x + f(x)`` (or ``shortcut(x) + f(x)``), with ``f = Serial(*layers)``.

    Built as ``Serial(Branch(shortcut, Serial(*layers)), Add())``, so its weights are
    ``((shortcut_weights, f_weights), ())``. ``f`` must map its inputs to one output of the
    shortcut's shape.
    """

    def __init__(self, *layers: Any, shortcut: Layer | None = None, name: str | None = None):
        super().__init__(Branch(shortcut, Serial(*layers)), Add(), name=name or "Residual")


class Select(Layer):
    """Copies/reorders stack items: outputs ``x[i]`` for ``i`` in ``indices``.

    Args:
      indices: stack positions to output, top first; repeats copy.
      n_in: how many items to consume; default ``max(indices) + 1``.

    Raises:
      ValueError: for a negative index, or ``n_in <= max(indices)``.
    """

    def __init__(self, indices: Sequence[int], n_in: int | None = None):
        indices = tuple(int(i) for i in indices)
        if any(i < 0 for i in indices):
            raise ValueError(f"Select indices must be >= 0; got {list(indices)}")
        needed = max(indices, default=-1) + 1
        n_in = needed if n_in is None else n_in
        if n_in < needed:
            raise ValueError(f"Select({list(indices)}) needs n_in >= {needed}; got "
                             f"n_in={n_in}")
        super().__init__(n_in=n_in, n_out=len(indices), name=f"Select{list(indices)}")
        self._indices = indices

    def forward_with_state(self, x, weights, state, rng):
        check_n_items(self, x)
        items = stack_items(x)
        return stack_of([items[i] for i in self._indices]), state


class _StackOp(Layer):
    """A weightless stack layer defined by ``op(items) -> outputs`` (items is a tuple)."""

    N_IN = 1
    N_OUT = 1

    def __init__(self):
        super().__init__(n_in=self.N_IN, n_out=self.N_OUT)

    def op(self, items: tuple) -> Any:
        raise NotImplementedError

    def forward_with_state(self, x, weights, state, rng):
        check_n_items(self, x)
        return self.op(stack_items(x)), state


class Dup(_StackOp):
    """Duplicates the top item: ``x -> (x, x)``."""

    N_IN, N_OUT = 1, 2

    def op(self, items):
        return items[0], items[0]


class Swap(_StackOp):
    """Swaps the top two items: ``(x, y) -> (y, x)``."""

    N_IN, N_OUT = 2, 2

    def op(self, items):
        return items[1], items[0]


class Drop(_StackOp):
    """Removes the top item: ``x -> ()``."""

    N_IN, N_OUT = 1, 0

    def op(self, items):
        return ()


class Add(_StackOp):
    """Adds the top two items element-wise (shapes must broadcast)."""

    N_IN, N_OUT = 2, 1

    def op(self, items):
        return items[0] + items[1]


class Concatenate(Layer):
    """Concatenates the top ``n_items`` items along ``axis``."""

    def __init__(self, n_items: int = 2, axis: int = -1):
        if n_items < 1:
            raise ValueError(f"Concatenate needs n_items >= 1; got {n_items}")
        super().__init__(n_in=n_items, n_out=1)
        self._axis = axis

    @property
    def axis(self) -> int:
        """The axis the items are joined along."""
        return self._axis

    def forward_with_state(self, x, weights, state, rng):
        check_n_items(self, x)
        items = stack_items(x)
        if items[0].ndim > 2 and self._axis % items[0].ndim == 1:
            check_not_split(f"Concatenate(axis={self._axis})", "concatenate features "
                            "(axis=-1) or use seq=1", why="joins arrays")
        return jnp.concatenate(items, axis=self._axis), state


class Split(Layer):
    """Splits the top item into ``n_items`` equal parts along ``axis``.

    Raises:
      LayerError: (from ValueError) when the axis size is not divisible by ``n_items``.
    """

    def __init__(self, n_items: int = 2, axis: int = -1):
        if n_items < 1:
            raise ValueError(f"Split needs n_items >= 1; got {n_items}")
        super().__init__(n_in=1, n_out=n_items)
        self._n_items, self._axis = n_items, axis

    def forward_with_state(self, x, weights, state, rng):
        size = x.shape[self._axis]
        if x.ndim > 2 and self._axis % x.ndim == 1:
            check_not_split(f"Split(axis={self._axis})", "split features (axis=-1) or use "
                            "seq=1", why="cuts arrays")
        if size % self._n_items:
            raise ValueError(f"axis {self._axis} of size {size} cannot be split into "
                             f"{self._n_items} equal parts; use a size divisible by "
                             f"{self._n_items}")
        return stack_of(jnp.split(x, self._n_items, axis=self._axis)), state


__all__ = ["Serial", "Parallel", "Branch", "Residual", "Select", "Dup", "Swap", "Drop", "Add",
           "Concatenate", "Split", "flatten_layers", "split_rng"]
