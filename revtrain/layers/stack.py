"""The stack layers pass data on, and the one check of how many items something holds.

A *stack* is one array (a stack of one item) or a tuple of items, top of stack first. A
layer with ``n_in`` inputs takes the top ``n_in`` items (`inputs_from_stack`) and puts its
``n_out`` outputs in their place (`outputs_onto_stack`); items below pass through.

`check_n_items` is the single arity check of the layers package: a layer's inputs against
``n_in``, a reversible layer's outputs and cotangents against ``n_out``, and a
combinator's per-sublayer ``weights``/``state`` tuples against its number of sublayers all
go through it, so every such error reads the same way.

Reference: the stack idiom of Trax (``trax.layers.base``), whose helper names these keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

Stack = Any


class Checked(Protocol):
    """What the checks here read of a layer; every `revtrain.layers.Layer` has it.

    Written as a protocol so that this module needs nothing from ``layer.py`` (which
    imports it): ``name`` starts each message, ``n_in`` is the default count and
    ``sublayers`` the per-sublayer count.
    """

    @property
    def name(self) -> str: ...

    @property
    def n_in(self) -> int: ...

    @property
    def sublayers(self) -> Sequence[Any]: ...


def inputs_from_stack(stack: Stack, n: int) -> Any:
    """Returns the top ``n`` items of ``stack``: bare when ``n == 1``, else a tuple.

    Args:
      stack: one array (a stack of one) or a tuple/list of items, top first.
      n: how many items to take.

    Raises:
      ValueError: when the stack holds fewer than ``n`` items (Trax silently returns fewer).
    """
    items = _at_least(stack, n)
    return items[0] if n == 1 else tuple(items[:n])


def outputs_onto_stack(outputs: Any, stack: Stack, n: int) -> Stack:
    """Removes the top ``n`` items of ``stack`` and puts ``outputs`` on top.

    Args:
      outputs: one array (one output) or a tuple of outputs.
      stack: the stack before the layer ran (top first).
      n: how many items the layer consumed.

    Returns:
      The new stack; a stack of one item is returned bare.

    Raises:
      ValueError: when the stack holds fewer than ``n`` items.
    """
    items = _at_least(stack, n)
    return stack_of(stack_items(outputs) + items[n:])


def check_n_items(layer: Checked, items: Any, n: int | None = None, what: str = "inputs",
                  *, bare_is_one: bool = True, fix: str = "") -> None:
    """Raises ValueError unless ``items`` holds exactly ``n`` items.

    Args:
      layer: the layer the items belong to; its ``name`` starts the message.
      items: a stack (one bare item or a tuple/list), or a per-sublayer tuple.
      n: the expected count; default ``layer.n_in``.
      what: what the items are, for the message (``'inputs'``, ``'output items'``,
        ``'weights (one per sublayer)'``, ...).
      bare_is_one: whether a value that is not a tuple/list counts as one item (the stack
        convention). Per-sublayer trees pass False: they must be tuples.
      fix: how to call it correctly, appended to the message after ``'; '``.

    Raises:
      ValueError: ``"<layer> expects <n> <what> but got <count or type>[; <fix>]"``.
    """
    n = layer.n_in if n is None else n
    if isinstance(items, (tuple, list)):
        got: Any = len(items)
    elif bare_is_one:
        got = 1
    else:
        got = f"a {type(items).__name__}, not a tuple"
    if got != n:
        raise ValueError(f"{layer.name} expects {n} {what} but got {got}"
                         + (f"; {fix}" if fix else ""))


def check_per_sublayer(layer: Checked, **trees: Any) -> None:
    """Raises ValueError unless each tree is a tuple with one item per sublayer of ``layer``.

    Args:
      layer: a combinator; ``len(layer.sublayers)`` items are expected.
      **trees: the trees to check by name (``weights=..., state=..., new_state=...``); the
        name is in the message.

    Raises:
      ValueError: from `check_n_items`, naming the layer, the tree, and both counts.
    """
    for kind, tree in trees.items():
        check_n_items(layer, tree, len(layer.sublayers), f"{kind} (one per sublayer)",
                      bare_is_one=False, fix=f"pass the tuple of its sublayers' {kind}")


def _at_least(stack: Stack, n: int) -> tuple:
    """The stack's items as a tuple; raises ValueError when there are fewer than ``n``."""
    items = stack_items(stack)
    if len(items) < n:
        raise ValueError(f"stack has {len(items)} items but {n} are needed; feed the layer "
                         f"{n} inputs")
    return items


def stack_items(stack: Stack) -> tuple:
    """The items of a stack as a tuple (a bare item is a stack of one)."""
    if isinstance(stack, (tuple, list)):
        return tuple(stack)
    return (stack,)


def stack_of(items: Sequence[Any]) -> Any:
    """The stack holding ``items``: the item itself when there is one, else a tuple."""
    items = tuple(items)
    return items[0] if len(items) == 1 else items


__all__ = ["Checked", "Stack", "check_n_items", "check_per_sublayer", "inputs_from_stack",
           "outputs_onto_stack", "stack_items", "stack_of"]
