"""Tests for revtrain.layers.conv: Conv, AvgPool and MaxPool vs direct numpy loops."""
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from revtrain.layers import AvgPool, Conv, LayerError, MaxPool

SDS = jax.ShapeDtypeStruct


def _x(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _conv_reference(x, w, b, stride, pad):
    """Direct NHWC/HWIO convolution (cross-correlation) with explicit zero padding."""
    (pt, pb), (pl, pr) = pad
    xp = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))
    kh, kw, _, f = w.shape
    oh = (xp.shape[1] - kh) // stride[0] + 1
    ow = (xp.shape[2] - kw) // stride[1] + 1
    out = np.zeros((x.shape[0], oh, ow, f))
    for i, j in itertools.product(range(oh), range(ow)):
        patch = xp[:, i * stride[0]:i * stride[0] + kh, j * stride[1]:j * stride[1] + kw]
        out[:, i, j] = np.einsum("bhwc,hwcf->bf", patch, w)
    return out + b


@pytest.mark.parametrize("padding,strides,pad", [
    ("SAME", (1, 1), ((1, 1), (1, 1))),
    ("VALID", (1, 1), ((0, 0), (0, 0))),
    ("VALID", (2, 1), ((0, 0), (0, 0))),
    (((2, 0), (1, 1)), (1, 2), ((2, 0), (1, 1))),
])
def test_conv_matches_direct_loop(padding, strides, pad):
    layer = Conv(4, kernel_size=(3, 3), strides=strides, padding=padding)
    x = _x((2, 5, 6, 3))
    (w, b), state = layer.init(SDS(x.shape, jnp.float32), rng=jax.random.key(1))
    assert w.shape == (3, 3, 3, 4) and b.shape == (4,) and state == ()
    y = layer(x)
    np.testing.assert_allclose(y, _conv_reference(x, np.asarray(w), np.asarray(b), strides,
                                                  pad), rtol=1e-4, atol=1e-5)
    assert layer.output_signature(SDS(x.shape, jnp.float32)).shape == y.shape


def test_conv_glorot_kernel_counts_receptive_field_and_no_bias_variant():
    w, _ = Conv(8, kernel_size=3).init(SDS((1, 4, 4, 6), jnp.float32))
    limit = math.sqrt(6.0 / (9 * 6 + 9 * 8))
    assert np.abs(np.asarray(w[0])).max() <= limit
    layer = Conv(2, kernel_size=(1, 1), use_bias=False)
    (k,), _ = layer.init(SDS((1, 2, 2, 3), jnp.float32))
    x = _x((1, 2, 2, 3))
    np.testing.assert_allclose(layer(x), x @ np.asarray(k)[0, 0], rtol=1e-5, atol=1e-6)


def test_conv_one_spatial_axis_and_bfloat16():
    layer = Conv(2, kernel_size=(2,), strides=(1,), padding="VALID")
    x = _x((2, 5, 3))
    (w, b), _ = layer.init(SDS(x.shape, jnp.float32))
    w, b = np.asarray(w), np.asarray(b)
    expected = np.stack([x[:, t] @ w[0] + x[:, t + 1] @ w[1] for t in range(4)], 1) + b
    np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert layer(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16


def test_conv_wrong_channels_and_rank_raise():
    layer = Conv(4)
    layer.init(SDS((1, 4, 4, 3), jnp.float32))
    with pytest.raises(LayerError, match="expects 3 input channels.*received 5"):
        layer(np.ones((1, 4, 4, 5), np.float32))
    with pytest.raises(LayerError, match="rank 4"):
        layer(np.ones((4, 4, 3), np.float32))
    with pytest.raises(ValueError, match="strides"):
        Conv(4, kernel_size=(3, 3), strides=(1, 1, 1))


def test_conv_gradients_match_finite_differences():
    layer = Conv(2, kernel_size=(2, 2), strides=(1, 1), padding="SAME")
    layer.init(SDS((1, 3, 3, 2), jnp.float32), rng=jax.random.key(3))
    x = _x((1, 3, 3, 2))
    with jax.enable_x64(True):
        w = jax.tree.map(lambda a: np.asarray(a, np.float64), layer.weights)
        x64 = np.asarray(x, np.float64)
        check_grads(lambda w_: layer.pure_fn(x64, w_, (), None)[0], (w,), 1, modes=["rev"])
        check_grads(lambda x_: layer.pure_fn(x_, w, (), None)[0], (x64,), 1, modes=["rev"])


def test_pooling_valid_default_strides_equal_pool_size():
    x = _x((2, 4, 6, 3))
    blocks = x.reshape(2, 2, 2, 3, 2, 3)
    np.testing.assert_allclose(MaxPool()(x), blocks.max((2, 4)), rtol=1e-6)
    np.testing.assert_allclose(AvgPool()(x), blocks.mean((2, 4)), rtol=1e-5, atol=1e-6)
    assert MaxPool(pool_size=(2, 3)).output_signature(SDS(x.shape, jnp.float32)).shape == (
        2, 2, 2, 3)


def test_pooling_same_padding_ignores_padded_positions():
    x = np.arange(1, 6, dtype=np.float32).reshape(1, 5, 1, 1)  # one spatial column.
    avg = AvgPool(pool_size=(2, 1), strides=(2, 1), padding="SAME")(x)
    np.testing.assert_allclose(np.asarray(avg).ravel(), [1.5, 3.5, 5.0])
    neg = -x
    mx = MaxPool(pool_size=(2, 1), strides=(2, 1), padding="SAME")(neg)
    np.testing.assert_allclose(np.asarray(mx).ravel(), [-1.0, -3.0, -5.0])
    ints = MaxPool(pool_size=(3, 1), strides=(1, 1))(x.astype(np.int32))
    np.testing.assert_array_equal(np.asarray(ints).ravel(), [3, 4, 5])


# --------------------------------------------------------------------------------------
# Edge cases.


def test_uint8_pixels_compute_in_float32_not_with_truncated_weights():
    layer = Conv(2, (3, 3))
    pixels = (jnp.arange(48) % 251).astype(jnp.uint8).reshape(1, 4, 4, 3)
    layer.init(pixels, rng=jax.random.key(0))
    y = layer(pixels)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, layer(pixels.astype(jnp.float32)), rtol=1e-6)
    assert float(jnp.abs(y).max()) > 1.0


@pytest.mark.parametrize("kernel_size,shape", [((3,), (2, 5, 3)), ((1, 1, 1), (1, 2, 2, 2, 3))])
def test_one_and_three_spatial_axes_work_with_default_strides(kernel_size, shape):
    layer = Conv(4, kernel_size)
    x = jnp.ones(shape)
    w, _ = layer.init(x, rng=jax.random.key(0))
    assert w[0].shape == (*kernel_size, 3, 4)
    assert layer(x).shape == shape[:-1] + (4,)


def test_zero_filters_is_rejected_at_construction():
    with pytest.raises(ValueError, match=r"Conv filters=0 must be >= 1"):
        Conv(0)
