"""Tests for revtrain.layers.normalization: LayerNorm and BatchNorm."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from revtrain.layers import BatchNorm, LayerError, LayerNorm

SDS = jax.ShapeDtypeStruct


def _x(shape, seed=0):
    return (np.random.default_rng(seed).normal(size=shape) * 2 + 1).astype(np.float32)


def _grads_ok(layer, x, wrt_weights=True):
    """Central-difference check of d(output)/d(weights or x) in float64 (x64 scope only)."""
    with jax.enable_x64(True):
        w = jax.tree.map(lambda a: np.asarray(a, np.float64), layer.weights)
        s = jax.tree.map(lambda a: np.asarray(a).astype(
            np.float64 if np.issubdtype(np.asarray(a).dtype, np.floating) else np.int32),
            layer.state)
        x64 = np.asarray(x, np.float64)
        if wrt_weights:
            check_grads(lambda w_: layer.pure_fn(x64, w_, s, None)[0], (w,), 1, modes=["rev"])
        check_grads(lambda x_: layer.pure_fn(x_, w, s, None)[0], (x64,), 1, modes=["rev"])


def test_layer_norm_matches_numpy_and_uses_weights():
    layer = LayerNorm()
    (scale, bias), state = layer.init(SDS((2, 3, 6), jnp.float32))
    np.testing.assert_array_equal(scale, np.ones(6))
    np.testing.assert_array_equal(bias, np.zeros(6))
    assert state == ()
    x = _x((2, 3, 6))
    normed = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(layer(x), normed, rtol=1e-5, atol=1e-5)
    s, b = _x((6,), 1), _x((6,), 2)
    y = layer(x, weights=(s, b))
    np.testing.assert_allclose(y, normed * s + b, rtol=1e-5, atol=1e-5)
    assert layer.output_signature(SDS((2, 3, 6), jnp.bfloat16)).dtype == jnp.bfloat16


def test_layer_norm_bfloat16_close_to_float32():
    layer = LayerNorm()
    layer.init(SDS((4, 16), jnp.float32))
    x = _x((4, 16))
    y16 = layer(jnp.asarray(x, jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), layer(x), atol=5e-2)


def test_layer_norm_wrong_width_raises():
    layer = LayerNorm()
    layer.init(SDS((2, 4), jnp.float32))
    with pytest.raises(LayerError, match="last axis 4"):
        layer(np.ones((2, 5), np.float32))


def test_layer_norm_gradients_match_finite_differences():
    layer = LayerNorm()
    layer.init(SDS((2, 5), jnp.float32))
    layer.weights = (_x((5,), 3), _x((5,), 4))
    _grads_ok(layer, _x((2, 5)))


def test_batch_norm_train_mode_uses_batch_stats_and_updates_state_once():
    layer = BatchNorm(momentum=0.9)
    x = _x((4, 3, 3, 5))  # NHWC; statistics per channel.
    weights, state = layer.init(SDS(x.shape, jnp.float32))
    assert jax.tree.map(jnp.shape, weights) == ((5,), (5,))
    np.testing.assert_array_equal(state[0], np.zeros(5))
    np.testing.assert_array_equal(state[1], np.ones(5))
    assert state[2].dtype == jnp.int32 and int(state[2]) == 0
    y, new_state = layer.pure_fn(x, weights, state, None)
    mean, var = x.mean((0, 1, 2)), x.var((0, 1, 2))
    np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(new_state[0], 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_state[1], 0.9 + 0.1 * var, rtol=1e-5)
    assert int(new_state[2]) == 1
    # A pure function of the old state: recomputing from it gives the same new state.
    _, again = layer.pure_fn(x, weights, state, None)
    jax.tree.map(np.testing.assert_array_equal, again, new_state)
    # forward() stores the state: two calls, two updates.
    layer(x)
    layer(x)
    assert int(layer.state[2]) == 2
    np.testing.assert_allclose(layer.state[0], 0.9 * 0.1 * mean + 0.1 * mean, rtol=1e-5)


def test_batch_norm_eval_mode_uses_moving_averages_and_keeps_state():
    x = _x((6, 4))
    layer = BatchNorm(axis=0, mode="eval", center=False)
    weights, _ = layer.init(SDS(x.shape, jnp.float32))
    assert weights[1] == ()
    moving = (np.full(4, 0.5, np.float32), np.full(4, 4.0, np.float32), jnp.int32(7))
    scale = _x((4,), 5)
    y, state = layer.pure_fn(x, (scale, ()), moving, None)
    np.testing.assert_allclose(y, (x - 0.5) / np.sqrt(4.0 + 1e-5) * scale, rtol=1e-5)
    assert state is moving


def test_batch_norm_over_batch_and_length_of_sequences():
    x = _x((2, 5, 3))
    layer = BatchNorm(axis=(0, 1), scale=False)
    weights, state = layer.init(SDS(x.shape, jnp.float32))
    assert weights[0] == () and weights[1].shape == (3,)
    y, _ = layer.pure_fn(x, weights, state, None)
    np.testing.assert_allclose(np.asarray(y).mean((0, 1)), 0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y).var((0, 1)), 1, atol=1e-3)


def test_batch_norm_errors():
    with pytest.raises(ValueError, match="momentum=1.5"):
        BatchNorm(momentum=1.5)
    layer = BatchNorm()
    layer.init(SDS((2, 2, 2, 3), jnp.float32))
    with pytest.raises(LayerError, match="re-init"):
        layer(np.ones((2, 2, 2, 4), np.float32))
    with pytest.raises(LayerError, match="out of range"):
        BatchNorm(axis=(0, 3)).init(SDS((2, 3), jnp.float32))


def test_batch_norm_train_gradients_match_finite_differences():
    layer = BatchNorm(axis=(0, 1))
    layer.init(SDS((3, 2, 4), jnp.float32))
    layer.weights = (_x((4,), 6), _x((4,), 7))
    _grads_ok(layer, _x((3, 2, 4)))


# --------------------------------------------------------------------------------------
# Edge cases.


INTS = jnp.array([[0, 2, 4], [2, 4, 12]], jnp.int32)


def test_layer_norm_of_integers_is_float32_not_truncated():
    layer = LayerNorm()
    layer.init(INTS)
    y = layer(INTS)
    assert y.dtype == jnp.float32
    x = np.asarray(INTS, np.float64)
    expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(y, expected, rtol=1e-5)


def test_batch_norm_of_integers_is_float32_not_truncated():
    layer = BatchNorm(axis=0)
    layer.init(INTS)
    y = layer(INTS)
    assert y.dtype == jnp.float32
    x = np.asarray(INTS, np.float64)
    np.testing.assert_allclose(y, (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5), rtol=1e-5)


def test_layer_norm_init_on_a_scalar_is_a_clear_error():
    with pytest.raises(LayerError, match=r"LayerNorm expects inputs \[..., d\] of rank >= 1"):
        LayerNorm().init(jax.ShapeDtypeStruct((), jnp.float32))
