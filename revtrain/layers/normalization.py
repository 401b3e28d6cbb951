"""Normalization layers: `LayerNorm` and `BatchNorm`.

Statistics are computed in at least float32 (bfloat16 inputs are upcast) and outputs are
returned in the input dtype (float32 for integer inputs); weights and state are float32.
Both layers keep their weights as ``(scale, bias)``; a disabled part
(``BatchNorm(center=False)`` / ``scale=False``) is ``()`` in its place.

References: Ba et al., 2016, "Layer Normalization"; Ioffe & Szegedy, 2015, "Batch
Normalization"; Trax's ``trax.layers.normalization`` (arguments, defaults, the moving-average
state and its ``n_batches`` counter).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from revtrain.layers.core import check_mode
from revtrain.layers.layer import Layer
from revtrain.layers.sequence_parallel import check_not_split
from revtrain.layers.signatures import float_dtype


class LayerNorm(Layer):
    """Normalises over the last axis: ``[..., d] -> [..., d]``.

    ``y = (x - mean) / sqrt(var + epsilon) * scale + bias`` with mean and (biased) variance
    over the last axis. Weights: ``(scale: float32[d], bias: float32[d])``, initialised to
    ones and zeros.

    Args:
      epsilon: added to the variance for numerical stability (Trax's default 1e-6).
    """

    position_wise = True

    def __init__(self, epsilon: float = 1e-6):
        super().__init__(n_in=1, n_out=1)
        self._epsilon = epsilon

    def forward_with_state(self, x, weights, state, rng):
        scale, bias = weights
        if x.shape[-1:] != scale.shape:
            raise ValueError(f"LayerNorm was initialised for last axis {scale.shape[0]} but "
                             f"received {x.shape[-1] if x.ndim else None}; re-init the layer")
        xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self._epsilon)
        return (y * scale + bias).astype(float_dtype(x)), state

    def init_weights_and_state(self, input_signature, rng):
        if not input_signature.shape:
            raise ValueError("LayerNorm expects inputs [..., d] of rank >= 1; got a scalar")
        d = input_signature.shape[-1]
        return (jnp.ones((d,), jnp.float32), jnp.zeros((d,), jnp.float32)), ()


class BatchNorm(Layer):
    """Batch normalization with moving averages of the statistics.

    In ``'train'`` mode the input is normalised with the mean and (biased) variance of the
    batch over ``axis`` and the new state holds updated moving averages,
    ``moving = momentum * moving + (1 - momentum) * batch_stat``, and ``n_batches + 1``. In
    ``'eval'``/``'predict'`` mode the moving averages are used and the state is returned
    unchanged. The new state is a pure function of the old state and the input, so a
    reversible block can recompute the forward pass from the *old* state and discard the
    recomputed state.

    Weights: ``(scale, bias)``, each ``float32[stats_shape]`` (the input shape without the
    ``axis`` dimensions, e.g. ``[channels]`` for NHWC and ``axis=(0, 1, 2)``), initialised to
    ones and zeros; ``()`` replaces ``scale`` if ``scale=False`` and ``bias`` if
    ``center=False``. State: ``(moving_mean, moving_var, n_batches)`` with float32
    ``stats_shape`` arrays initialised to zeros and ones, and an int32 scalar count.

    Args:
      axis: axes reduced over (batch and spatial axes); ints, negatives allowed.
      epsilon: added to the variance.
      momentum: weight of the old moving average at each update.
      center: learn a bias (Trax's ``beta``).
      scale: learn a scale (Trax's ``gamma``).
      mode: ``'train'``, ``'eval'`` or ``'predict'``.
    """

    def __init__(self, axis: int | Sequence[int] = (0, 1, 2), epsilon: float = 1e-5,
                 momentum: float = 0.999, center: bool = True, scale: bool = True,
                 mode: str = "train"):
        super().__init__(n_in=1, n_out=1)
        self._axis = (axis,) if isinstance(axis, int) else tuple(axis)
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNorm momentum={momentum} must be in [0, 1]; e.g. 0.999")
        self._epsilon = epsilon
        self._momentum = momentum
        self._center = center
        self._scale = scale
        self._mode = check_mode(mode, "BatchNorm")

    def _axes(self, ndim: int) -> tuple[int, ...]:
        if any(not -ndim <= a < ndim for a in self._axis):
            raise ValueError(f"BatchNorm axis={self._axis} is out of range for rank-{ndim} "
                             f"inputs; use axes in [-{ndim}, {ndim})")
        return tuple(sorted({a % ndim for a in self._axis}))

    def _stats_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        axes = self._axes(len(shape))
        return tuple(d for i, d in enumerate(shape) if i not in axes)

    def forward_with_state(self, x, weights, state, rng):
        axes = self._axes(x.ndim)
        moving_mean, moving_var, n_batches = state
        if moving_mean.shape != self._stats_shape(x.shape):
            raise ValueError(f"BatchNorm was initialised for statistics of shape "
                             f"{moving_mean.shape} but input {x.shape} over axis={axes} "
                             f"gives {self._stats_shape(x.shape)}; re-init the layer")
        # Shape that broadcasts a stats_shape array against x.
        bshape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
        xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        if self._mode == "train":
            if x.ndim > 2 and 1 in axes:
                check_not_split(f"BatchNorm(axis={self._axis})", "normalise over the features "
                                "(LayerNorm) or use seq=1", why="averages statistics")
            mean = jnp.mean(xf, axis=axes)
            var = jnp.mean(jnp.square(xf - mean.reshape(bshape)), axis=axes)
            m = self._momentum
            state = (m * moving_mean + (1.0 - m) * mean.astype(moving_mean.dtype),
                     m * moving_var + (1.0 - m) * var.astype(moving_var.dtype),
                     n_batches + 1)
        else:
            mean, var = moving_mean, moving_var
        y = (xf - mean.reshape(bshape)) * jax.lax.rsqrt(var.reshape(bshape) + self._epsilon)
        scale_w, bias_w = weights
        if self._scale:
            y = y * scale_w.reshape(bshape)
        if self._center:
            y = y + bias_w.reshape(bshape)
        return y.astype(float_dtype(x)), state

    def init_weights_and_state(self, input_signature, rng):
        shape = self._stats_shape(input_signature.shape)
        scale = jnp.ones(shape, jnp.float32) if self._scale else ()
        bias = jnp.zeros(shape, jnp.float32) if self._center else ()
        state = (jnp.zeros(shape, jnp.float32), jnp.ones(shape, jnp.float32),
                 jnp.zeros((), jnp.int32))
        return (scale, bias), state
