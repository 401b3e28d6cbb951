"""Convolution and pooling on channels-last inputs: `Conv`, `AvgPool`, `MaxPool`.

Inputs are ``[batch, *spatial, channels]`` (NHWC for 2-D), with 1, 2 or 3 spatial axes as
given by the length of ``kernel_size`` / ``pool_size``. `Conv` computes with
``jax.lax.conv_general_dilated``, pooling with ``jax.lax.reduce_window``; both keep a float
input's dtype (weights are float32 and cast to it); `Conv` computes integer inputs (e.g.
uint8 pixels) in float32.

References: Trax's ``trax.layers.convolution.Conv`` and ``trax.layers.core`` pooling layers
(arguments and defaults: ``strides`` default to the pool size, ``'VALID'`` pooling padding);
He et al., 2016 and Gomez et al., 2017 (RevNet), which use these for downsampling and heads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from revtrain.layers.core import GLOROT_UNIFORM, TINY_NORMAL, Initializer
from revtrain.layers.layer import Layer
from revtrain.layers.sequence_parallel import check_not_split
from revtrain.layers.signatures import float_dtype

Padding = str | Sequence[tuple[int, int]]

_DIMENSION_NUMBERS = {
    1: ("NWC", "WIO", "NWC"),
    2: ("NHWC", "HWIO", "NHWC"),
    3: ("NDHWC", "DHWIO", "NDHWC"),
}


def _as_tuple(value: int | Sequence[int], n: int, what: str) -> tuple[int, ...]:
    """``3 -> (3,) * n``; a sequence must already have ``n`` items."""
    if isinstance(value, int):
        return (value,) * n
    value = tuple(int(v) for v in value)
    if len(value) != n:
        raise ValueError(f"{what}={value} has {len(value)} items but {n} spatial axes are "
                         f"used; pass {n} values")
    return value


def _window(size: int | Sequence[int]) -> tuple[int, ...]:
    """A window size: an int means the same size on 2 spatial axes."""
    return (size, size) if isinstance(size, int) else tuple(int(v) for v in size)


def _padding(padding: Padding) -> str | tuple[tuple[int, int], ...]:
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(f"padding={padding!r} must be 'SAME', 'VALID' or a sequence of "
                             f"(low, high) pairs")
        return padding.upper()
    return tuple((int(lo), int(hi)) for lo, hi in padding)


def _check_rank(x: jax.Array, n_spatial: int, name: str) -> None:
    check_not_split(name, "use seq=1 for convolutional models", why="slides windows")
    if x.ndim != n_spatial + 2:
        raise ValueError(f"{name} with {n_spatial} spatial axes expects inputs of rank "
                         f"{n_spatial + 2}, [batch, *spatial, channels]; got shape {x.shape}")


class Conv(Layer):
    """A convolution: ``[batch, *spatial, c_in] -> [batch, *spatial', filters]``.

    Weights are ``(w, b)`` with ``w: float32[*kernel_size, c_in, filters]`` (HWIO for 2-D)
    and ``b: float32[filters]``, or ``(w,)`` when ``use_bias=False``. Defaults as Trax's
    ``Conv``: Glorot-uniform kernel (fans include the receptive field), bias from a normal
    distribution with stddev 1e-6.

    Args:
      filters: number of output channels.
      kernel_size: window size per spatial axis (its length sets the number of spatial
        axes: 1, 2 or 3); an int means the same size on 2 axes.
      strides: stride per spatial axis, or one int for all (default 1).
      padding: ``'SAME'``, ``'VALID'`` or ``(low, high)`` pairs per spatial axis.
      use_bias: add a learned bias.

    Raises:
      ValueError: when ``filters < 1`` or ``strides`` has the wrong length.
      LayerError: (from ``pure_fn``) when the input rank or channel count differs from
        those at ``init``.
    """

    def __init__(self, filters: int, kernel_size: int | Sequence[int] = (3, 3),
                 strides: int | Sequence[int] = 1, padding: Padding = "SAME",
                 use_bias: bool = True, kernel_init: Initializer = GLOROT_UNIFORM,
                 bias_init: Initializer = TINY_NORMAL):
        super().__init__(n_in=1, n_out=1)
        self._kernel_size = _window(kernel_size)
        n = len(self._kernel_size)
        if n not in _DIMENSION_NUMBERS:
            raise ValueError(f"Conv supports 1, 2 or 3 spatial axes; kernel_size="
                             f"{self._kernel_size} has {n}")
        if filters < 1:
            raise ValueError(f"Conv filters={filters} must be >= 1")
        self._filters = filters
        self._strides = _as_tuple(strides, n, "strides")
        self._padding = _padding(padding)
        self._use_bias = use_bias
        self._kernel_init = kernel_init
        self._bias_init = bias_init

    def forward_with_state(self, x, weights, state, rng):
        n = len(self._kernel_size)
        _check_rank(x, n, "Conv")
        w = weights[0]
        if x.shape[-1] != w.shape[-2]:
            raise ValueError(f"Conv expects {w.shape[-2]} input channels (as at init) but "
                             f"received {x.shape[-1]}; feed [..., {w.shape[-2]}] or re-init")
        dtype = float_dtype(x, w.dtype)
        y = jax.lax.conv_general_dilated(
            x.astype(dtype), w.astype(dtype), window_strides=self._strides,
            padding=self._padding, dimension_numbers=_DIMENSION_NUMBERS[n])
        if self._use_bias:
            y = y + weights[1].astype(dtype)
        return y, state

    def init_weights_and_state(self, input_signature, rng):
        _check_rank(input_signature, len(self._kernel_size), "Conv")
        c_in = input_signature.shape[-1]
        rng_w, rng_b = jax.random.split(rng)
        w = self._kernel_init(rng_w, (*self._kernel_size, c_in, self._filters), jnp.float32)
        if not self._use_bias:
            return (w,), ()
        return (w, self._bias_init(rng_b, (self._filters,), jnp.float32)), ()


class _Pool(Layer):
    """Shared arguments of the pooling layers (channels-last, one window per channel)."""

    def __init__(self, pool_size: int | Sequence[int] = (2, 2),
                 strides: int | Sequence[int] | None = None, padding: Padding = "VALID"):
        super().__init__(n_in=1, n_out=1)
        self._pool_size = _window(pool_size)
        n = len(self._pool_size)
        self._strides = self._pool_size if strides is None else _as_tuple(strides, n, "strides")
        self._padding = _padding(padding)

    def _reduce(self, x: jax.Array, init: jax.Array, op) -> jax.Array:
        _check_rank(x, len(self._pool_size), self.name)
        padding = self._padding
        if not isinstance(padding, str):
            padding = ((0, 0), *padding, (0, 0))
        return jax.lax.reduce_window(x, init, op, (1, *self._pool_size, 1),
                                     (1, *self._strides, 1), padding)


class MaxPool(_Pool):
    """Maximum over windows: ``[batch, *spatial, c] -> [batch, *spatial', c]``.

    Args:
      pool_size: window size per spatial axis (its length sets the number of spatial axes).
      strides: window step per spatial axis; defaults to ``pool_size`` (as Trax).
      padding: ``'VALID'`` (default), ``'SAME'`` or ``(low, high)`` pairs per spatial axis;
        padded positions never win the maximum.
    """

    def forward_with_state(self, x, weights, state, rng):
        if jnp.issubdtype(x.dtype, jnp.floating):
            init = jnp.array(-jnp.inf, x.dtype)
        else:
            init = jnp.array(jnp.iinfo(x.dtype).min, x.dtype)
        return self._reduce(x, init, jax.lax.max), state


class AvgPool(_Pool):
    """Mean over windows: ``[batch, *spatial, c] -> [batch, *spatial', c]``.

    Padded positions are excluded from the mean (each output divides by the number of real
    inputs in its window), as ``jax.example_libraries.stax.AvgPool`` which Trax wraps.

    Args:
      pool_size: window size per spatial axis (its length sets the number of spatial axes).
      strides: window step per spatial axis; defaults to ``pool_size`` (as Trax).
      padding: ``'VALID'`` (default), ``'SAME'`` or ``(low, high)`` pairs per spatial axis.
    """

    def forward_with_state(self, x, weights, state, rng):
        total = self._reduce(x, jnp.array(0, x.dtype), jax.lax.add)
        if self._padding == "VALID":
            return total / jnp.array(math.prod(self._pool_size), x.dtype), state
        ones = np.ones((1, *x.shape[1:-1], 1), np.float32)
        counts = self._reduce(jnp.asarray(ones), jnp.array(0, jnp.float32), jax.lax.add)
        return total / counts.astype(x.dtype), state
