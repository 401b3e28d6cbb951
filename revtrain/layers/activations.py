"""Activation layers: weightless element-wise (or per-axis) functions of one input.

`Relu`, `Gelu`, `Tanh` and `Sigmoid` compute in, and return, their input's dtype.
`LogSoftmax` and `Softmax` compute in at least float32 (bfloat16 logits are upcast, since
their sums lose precision) and return the input's float dtype, float32 for integer inputs.

References: Trax's activation layers (``trax.layers.activation_fns`` and ``trax.layers.core``),
whose names and defaults these keep; Hendrycks & Gimpel, 2016 (GELU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from revtrain.layers.layer import Layer
from revtrain.layers.sequence_parallel import check_not_split
from revtrain.layers.signatures import float_dtype


class _Activation(Layer):
    """A weightless element-wise (or per-axis) function of one input."""

    def __init__(self):
        super().__init__(n_in=1, n_out=1)

    def apply(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    def forward_with_state(self, x, weights, state, rng):
        return self.apply(x), state


def _check_axis(layer: _Activation, x: jax.Array) -> None:
    """Raises ValueError for a softmax over axis 1 of a sequence-split ``[batch, length,
    ...]`` input."""
    if x.ndim > 2 and layer._axis % x.ndim == 1:
        check_not_split(f"{layer.name}(axis={layer._axis})", "normalise over the last axis "
                        "of [batch, length, d] inputs or use seq=1", why="normalises")


class Relu(_Activation):
    """``max(x, 0)`` element-wise."""

    position_wise = True

    def apply(self, x):
        return jax.nn.relu(x)


class Gelu(_Activation):
    """Gaussian error linear unit (Hendrycks & Gimpel, 2016).

    Args:
      approximate: use the tanh approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715
        x^3)))`` as Trax's ``Gelu`` does (default); False gives the exact ``x Phi(x)``.
    """

    position_wise = True

    def __init__(self, approximate: bool = True):
        super().__init__()
        self._approximate = approximate

    def apply(self, x):
        return jax.nn.gelu(x, approximate=self._approximate)


class Tanh(_Activation):
    """``tanh(x)`` element-wise."""

    position_wise = True

    def apply(self, x):
        return jnp.tanh(x)


class Sigmoid(_Activation):
    """``1 / (1 + exp(-x))`` element-wise."""

    position_wise = True

    def apply(self, x):
        return jax.nn.sigmoid(x)


class LogSoftmax(_Activation):
    """``x - logsumexp(x, axis)``: log-probabilities from logits.

    Computed in at least float32 (bfloat16 logits are upcast) and returned in ``x.dtype``
    (float32 for integer inputs).
    """

    def __init__(self, axis: int = -1):
        super().__init__()
        self._axis = axis

    @property
    def axis(self) -> int:
        """The axis normalised over."""
        return self._axis

    def apply(self, x):
        _check_axis(self, x)
        return jax.nn.log_softmax(x.astype(jnp.promote_types(x.dtype, jnp.float32)),
                                  axis=self._axis).astype(float_dtype(x))


class Softmax(_Activation):
    """``exp(x) / sum(exp(x), axis)``; computed in at least float32, returned in ``x.dtype``
    (float32 for integer inputs)."""

    def __init__(self, axis: int = -1):
        super().__init__()
        self._axis = axis

    def apply(self, x):
        _check_axis(self, x)
        return jax.nn.softmax(x.astype(jnp.promote_types(x.dtype, jnp.float32)),
                              axis=self._axis).astype(float_dtype(x))


__all__ = ["Gelu", "LogSoftmax", "Relu", "Sigmoid", "Softmax", "Tanh"]
