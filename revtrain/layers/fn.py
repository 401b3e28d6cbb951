"""Weightless layers from plain functions: `PureLayer` and Trax's `Fn`.

A function given to these layers becomes part of the layer's identity: a module-level
named function (``jax.nn.relu``) lets layers built from it share compiled programs, a
lambda or closure does not (see `revtrain.layers.structure_keys`).

Reference: Trax's ``trax.layers.base.Fn`` (arity from the function's positional arguments).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax

from revtrain.layers.layer import Layer
from revtrain.layers.stack import check_n_items


class PureLayer(Layer):
    """A weightless layer from a pure function ``f(x, rng) -> y`` (no state).

    Used by `Fn` and by simple stack layers. ``f`` receives one array when ``n_in == 1``,
    else a tuple of ``n_in`` arrays.

    Args:
      f: ``f(x, rng) -> y``, returning one array or a tuple of ``n_out`` arrays.
      n_in: number of stack items ``f`` takes.
      n_out: number of stack items ``f`` returns.
      name: the layer's name; default ``'PureLayer'``.

    Raises (from ``pure_fn``):
      LayerError: when ``f`` returns other than ``n_out`` items.
    """

    def __init__(self, f: Callable[[Any, jax.Array], Any], n_in: int = 1, n_out: int = 1,
                 name: str | None = None):
        super().__init__(n_in=n_in, n_out=n_out, name=name)
        self._f = f

    def forward_with_state(self, x, weights, state, rng):
        del weights
        check_n_items(self, x)
        y = self._f(x, rng)
        check_n_items(self, y, self.n_out, "outputs from its function (n_out)")
        if isinstance(y, (tuple, list)):
            y = y[0] if self.n_out == 1 else tuple(y)
        return y, state


class Fn(PureLayer):
    """A weightless layer from a function of its inputs: ``Fn('Add1', lambda x: x + 1)``.

    ``n_in`` is the number of positional arguments of ``f`` (as in Trax's ``Fn``); ``f``
    returns one array, or a tuple of ``n_out`` arrays. Layers built from the same
    module-level function (``Fn('Relu', jax.nn.relu)``) share compiled programs in the
    trainers; a lambda or closure gives a ``structure_key`` of None, so never shares.

    Args:
      name: the layer's name.
      f: the function, of ``n_in`` positional array arguments.
      n_out: number of arrays ``f`` returns.

    Raises:
      ValueError: if ``f`` takes ``*args``/``**kwargs`` or keyword-only arguments.
    """

    def __init__(self, name: str, f: Callable[..., Any], n_out: int = 1):
        parameters = inspect.signature(f).parameters.values()
        for p in parameters:
            if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                raise ValueError(f"Fn {name}: argument {p.name!r} of f must be positional; "
                                 f"use a function with only positional arguments")
        n_in = len(list(parameters))

        def call(x, rng):
            del rng
            return f(*x) if n_in != 1 else f(x)

        super().__init__(call, n_in=n_in, n_out=n_out, name=name)


__all__ = ["Fn", "PureLayer"]
