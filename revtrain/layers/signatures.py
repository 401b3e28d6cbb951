"""Shape signatures, dtypes, and `LayerError`: how layers describe their inputs.

A *signature* is a pytree of ``jax.ShapeDtypeStruct`` (`ShapeDtype`) standing for arrays
of those shapes and dtypes; `Layer.init` builds weights from one, without a real batch.
The same descriptions fill the message of a `LayerError`, which names the layer, where it
was created and the shapes it was given.

References: Trax's ``LayerError`` and ``_find_frame`` (``trax.layers.base``), whose idea
of naming the layer's creation site this follows in revtrain's own code.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ShapeDtype = jax.ShapeDtypeStruct

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LayerError(Exception):
    """An exception raised inside a layer, re-raised with where and how it was called.

    The message names the layer, the file:line where the layer object was created (the
    first frame outside revtrain), the method that failed, the input shapes/dtypes, and the
    original exception. As Trax's ``LayerError``; the original exception is chained as
    ``__cause__`` and kept in ``original``.

    Args:
      layer_name: the failing layer's name.
      method: the method that raised (``'pure_fn'``, ``'init'``, ``'reverse'``, ...).
      caller: ``file:line`` where the layer object was created.
      input_signature: what the method was given (arrays or `ShapeDtype` pytree).
      original: the exception raised inside the layer.
    """

    def __init__(self, layer_name: str, method: str, caller: str, input_signature: Any,
                 original: BaseException):
        self.layer_name = layer_name
        self.method = method
        self.caller = caller
        self.input_signature = input_signature
        self.original = original
        message = (f"Exception in {layer_name}.{method} (layer created at {caller}); "
                   f"inputs: {format_signature(input_signature)}; "
                   f"{type(original).__name__}: {original}")
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.layer_name, self.method, self.caller, self.input_signature,
                             self.original))


def format_signature(signature: Any) -> str:
    """Returns ``'(float32[2,3], int32[2])'``-style text for arrays or signatures.

    Args:
      signature: a pytree of arrays or `ShapeDtype`; other leaves show their type name.
    """
    leaves = jax.tree_util.tree_leaves(signature)
    parts = []
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            shape = ",".join(str(d) for d in leaf.shape)
            parts.append(f"{getattr(leaf.dtype, 'name', leaf.dtype)}[{shape}]")
        else:
            parts.append(type(leaf).__name__)
    return "(" + ", ".join(parts) + ")"


def signature_of(x: Any) -> Any:
    """Returns the `ShapeDtype` signature (pytree of ``jax.ShapeDtypeStruct``) of ``x``.

    Args:
      x: a pytree of arrays, `ShapeDtype` or Python/NumPy scalars.
    """
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), _dtype_of(a)), x)


def _dtype_of(a: Any) -> Any:
    """The dtype of an array, `ShapeDtype` or scalar (scalars as ``jnp.asarray`` types them)."""
    if hasattr(a, "dtype"):
        return a.dtype
    return jnp.asarray(a).dtype


def float_dtype(x: Any, fallback: Any = jnp.float32) -> jnp.dtype:
    """The dtype a layer computes ``x`` in: ``x.dtype`` if it is a float type, else ``fallback``.

    Layers compute in their input's dtype (a bfloat16 activation gives a bfloat16 output);
    integer or bool inputs (token ids, masks) are computed in ``fallback``, usually the
    weights' dtype or float32.

    Args:
      x: an array or `ShapeDtype`.
      fallback: the dtype for non-float ``x``.
    """
    return x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.dtype(fallback)


def error_signature(x: Any) -> Any:
    """As `signature_of`, but never raises: non-array leaves are kept for their type name."""
    def leaf(a):
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return jax.ShapeDtypeStruct(np.shape(a), a.dtype)
        return a
    try:
        return jax.tree_util.tree_map(leaf, x)
    except Exception:  # noqa: BLE001 -- only describes inputs for an error message
        return type(x).__name__


def creation_site(layer: Any) -> str:
    """Returns ``file:line`` of the user code creating ``layer``.

    Skips frames inside the revtrain package, gin's configurable wrappers, and the
    ``__init__`` methods of ``layer`` itself (a user-defined subclass's ``super().__init__``
    call), as Trax's ``_find_frame`` does.
    """
    frame = sys._getframe(1)
    outermost = frame
    while frame is not None:
        outermost = frame
        path = os.path.abspath(frame.f_code.co_filename)
        module = str(frame.f_globals.get("__name__", ""))
        skip = (path.startswith(_PACKAGE_DIR + os.sep) or module.split(".")[0] == "gin"
                or (frame.f_code.co_name == "__init__"
                    and frame.f_locals.get("self") is layer))
        if not skip:
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return f"{outermost.f_code.co_filename}:{outermost.f_lineno}"


__all__ = ["LayerError", "ShapeDtype", "creation_site", "error_signature", "float_dtype",
           "format_signature", "signature_of"]
