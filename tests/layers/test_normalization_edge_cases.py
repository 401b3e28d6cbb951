"""Edge cases of revtrain.layers.normalization: integer inputs, scalar signatures."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import LayerError, LayerNorm
from revtrain.layers.normalization import BatchNorm

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
