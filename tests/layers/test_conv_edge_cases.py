"""Edge cases of revtrain.layers.conv: integer pixels, 1-D/3-D defaults, bad filters."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import Conv


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
