"""Structure keys: when two layer objects are known to compute the same function.

Trainers compile one function per *layer structure* and share it between layers whose
`Layer.structure_key` values are equal and not None (a deep model of identical blocks then
compiles once, not once per block). A shared compiled function bakes in everything the
layer's code reads besides its weights, state and rng, so the key must capture all of it,
or be None, which means "never share".

The key is ``(module, qualname, args, kwargs)``: the layer class by its import path and
its constructor arguments (bound to the constructor's signature, defaults filled in), each
frozen into a hashable value. Identity cannot be proven, and the key is None, when:

* the class is defined inside a function (``<locals>`` in its ``__qualname__``; its
  methods may read the function's variables) or is not the object found at
  ``__module__.__qualname__``;
* an argument is a lambda, a nested function or closure (``<locals>`` in its qualname, or
  ``__closure__`` set), a bound method (it reads its object), a ``functools.partial`` of
  any of these, or a class that is itself unprovable;
* an argument is neither hashable nor a list, tuple, dict or array (keying it by ``id``
  would be unsafe: ids are reused once an object is garbage-collected);
* an argument or sublayer is a layer whose own key is None.

Module-level named functions (``jax.nn.relu``, ``jnp.tanh``) are keyed by module and
qualname; arrays by shape, dtype and bytes; hashable values (numbers, strings, enums) by
their type and value (``2``, ``2.0`` and ``True`` are equal in Python but not as keys).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np


class _Unprovable(Exception):
    """Raised while freezing an argument whose identity cannot be proven."""


def structure_key_of(layer: Any) -> Hashable | None:
    """Returns ``layer``'s structure key, or None when its identity cannot be proven.

    Args:
      layer: a `Layer` (it records its constructor arguments in ``_constructor_args``).

    Returns:
      A hashable ``(module, qualname, args, kwargs)``, equal for layers of one class built
      with equal arguments; None under the rules in this module's docstring.
    """
    cls = type(layer)
    args, kwargs = _bound_arguments(layer)
    try:
        key = (*_class_path(cls), _freeze(args), _freeze(kwargs))
    except _Unprovable:
        return None
    if any(sub.structure_key is None for sub in layer.sublayers):
        return None
    return key


def _bound_arguments(layer: Any) -> tuple[tuple, dict]:
    """The constructor arguments bound by name, defaults filled in (when they bind)."""
    args, kwargs = layer.constructor_args
    try:
        bound = inspect.signature(type(layer).__init__).bind(layer, *args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    bound.apply_defaults()
    return (), dict(list(bound.arguments.items())[1:])


def _class_path(cls: type) -> tuple[str, str]:
    """``(module, qualname)`` of a class importable under that path; else `_Unprovable`."""
    module, qualname = cls.__module__, cls.__qualname__
    if "<locals>" in qualname or _lookup(module, qualname) is not cls:
        raise _Unprovable(f"{module}.{qualname}")
    return module, qualname


def _lookup(module: str, qualname: str) -> Any:
    """The object at ``module.qualname`` in an imported module, or None."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _freeze(value: Any) -> Hashable:
    """Turns a constructor argument into a hashable key; raises `_Unprovable`."""
    if isinstance(value, type):
        return ("type", *_class_path(value))
    if getattr(type(value), "structure_key", None) is not None:  # a Layer
        key = value.structure_key
        if key is None:
            raise _Unprovable(value.name)
        return key
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _freeze(v)) for k, v in value.items())))
    if isinstance(value, (np.ndarray, jax.Array)):
        arr = np.asarray(value)
        # dtype.str alone is '<V1' for every 1-byte ml_dtypes type (float8 variants, int4):
        # the name tells them apart.
        return ("array", arr.shape, arr.dtype.str, arr.dtype.name, arr.tobytes())
    if isinstance(value, np.dtype):
        return ("dtype", value.str, value.name)
    if isinstance(value, functools.partial):
        return ("partial", _freeze(value.func), _freeze(value.args), _freeze(value.keywords))
    if callable(value) and hasattr(value, "__qualname__"):
        return ("function", *_function_path(value))
    try:
        hash(value)
    except TypeError:
        raise _Unprovable(type(value).__name__) from None
    # With its type: 2 == 2.0 == True, but x * 2 and x * 2.0 differ for integer x.
    return (type(value).__module__, type(value).__qualname__, value)


def _function_path(f: Any) -> tuple[str, str]:
    """``(module, qualname)`` of a module-level named function; else `_Unprovable`."""
    module, qualname = getattr(f, "__module__", None), f.__qualname__
    owner = getattr(f, "__self__", None)
    if (module is None or "<lambda>" in qualname or "<locals>" in qualname
            or getattr(f, "__closure__", None) is not None
            or (owner is not None and not inspect.ismodule(owner))
            or _lookup(module, qualname) is not f):
        raise _Unprovable(qualname)
    return module, qualname


__all__ = ["structure_key_of"]
