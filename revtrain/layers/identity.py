"""Structure identity: when two layer objects are known to compute the same function.

Trainers compile one function per *layer structure* and share it between layers whose
`Layer.structure_key` values are equal. The key is ``(module, qualname, args, kwargs)``:
the layer class and its constructor arguments (bound to the constructor's signature,
defaults filled in), each frozen into a hashable value.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np


def structure_key_of(layer: Any) -> Hashable:
    """Returns ``layer``'s structure key: equal for one class built with equal arguments."""
    cls = type(layer)
    args, kwargs = _bound_arguments(layer)
    return (cls.__module__, cls.__qualname__, _freeze(args), _freeze(kwargs))


def _bound_arguments(layer: Any) -> tuple[tuple, dict]:
    """The constructor arguments bound by name, defaults filled in (when they bind)."""
    args, kwargs = layer._constructor_args
    try:
        bound = inspect.signature(type(layer).__init__).bind(layer, *args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    bound.apply_defaults()
    return (), dict(list(bound.arguments.items())[1:])


def _freeze(value: Any) -> Hashable:
    """Turns constructor arguments into a hashable key (layers by their own key)."""
    if getattr(type(value), "structure_key", None) is not None and not isinstance(value, type):
        return value.structure_key
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _freeze(v)) for k, v in value.items())))
    if isinstance(value, (np.ndarray, jax.Array)):
        arr = np.asarray(value)
        return ("array", arr.shape, arr.dtype.str, arr.tobytes())
    if isinstance(value, (np.dtype, type)):
        return ("type", str(value))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


__all__ = ["structure_key_of"]
