"""Edge cases of revtrain.layers.attention: integer inputs and bad head arguments."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import CausalAttention


def test_integer_inputs_compute_in_float32_like_float_inputs():
    layer = CausalAttention(4, n_heads=2)
    x = jnp.arange(24, dtype=jnp.int32).reshape(2, 3, 4) % 5
    layer.init(x, rng=jax.random.key(0))
    y = layer(x)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, layer(x.astype(jnp.float32)), rtol=1e-6)
    assert float(jnp.abs(y).max()) > 0.1  # not truncated to integer weights


@pytest.mark.parametrize("d_feature,n_heads,message", [
    (0, 1, r"d_feature=0 must be a positive int"),
    (4, 2.0, r"n_heads=2.0 must be a positive int"),
    (4, 0, r"n_heads=0 must be a positive int"),
    (8, 3, r"d_feature=8 is not divisible by n_heads=3"),
])
def test_bad_head_arguments_are_rejected_at_construction(d_feature, n_heads, message):
    with pytest.raises(ValueError, match=message):
        CausalAttention(d_feature, n_heads=n_heads)


def test_length_one_and_batch_one():
    layer = CausalAttention(4, n_heads=4)
    x = jnp.ones((1, 1, 4))
    layer.init(x, rng=jax.random.key(0))
    w_v, b_v = layer.weights[2]
    w_o, b_o = layer.weights[3]
    # One position attends only to itself: output = (x W_v + b_v) W_o + b_o.
    np.testing.assert_allclose(layer(x), (x @ w_v + b_v) @ w_o + b_o, rtol=1e-5, atol=1e-6)
