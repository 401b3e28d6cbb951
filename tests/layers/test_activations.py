"""Tests for revtrain.layers.activations: values vs numpy formulas, dtypes."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import Gelu, LogSoftmax, Relu, Sigmoid, Softmax, Tanh


def _x(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def test_activations_match_numpy_formulas():
    x = _x((3, 7))
    s = np.exp(x - x.max(-1, keepdims=True))
    softmax = s / s.sum(-1, keepdims=True)
    gelu_tanh = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    erf = np.vectorize(math.erf)
    cases = [
        (Relu(), np.maximum(x, 0)),
        (Gelu(), gelu_tanh),
        (Gelu(approximate=False), 0.5 * x * (1 + erf(x / math.sqrt(2)))),
        (Tanh(), np.tanh(x)),
        (Sigmoid(), 1 / (1 + np.exp(-x))),
        (Softmax(), softmax),
        (LogSoftmax(), np.log(softmax)),
        (LogSoftmax(axis=0), x - np.log(np.exp(x).sum(0, keepdims=True))),
    ]
    for layer, expected in cases:
        np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5,
                                   err_msg=layer.name)


def test_log_softmax_keeps_bfloat16_dtype():
    y = LogSoftmax()(jnp.asarray(_x((2, 5)), jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.exp(np.asarray(y, np.float32)).sum(-1), 1.0, atol=3e-2)


@pytest.mark.parametrize("layer,expected", [
    (LogSoftmax(), np.log(np.full((2, 3), 1 / 3))),
    (Softmax(), np.full((2, 3), 1 / 3)),
])
def test_softmaxes_of_integer_inputs_are_float32(layer, expected):
    y = layer(jnp.ones((2, 3), jnp.int32))
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, expected, rtol=1e-6)


@pytest.mark.parametrize("layer", [Relu(), Gelu(), Tanh(), Sigmoid()])
def test_element_wise_activations_keep_the_input_dtype(layer):
    assert layer(jnp.ones((2, 3), jnp.bfloat16)).dtype == jnp.bfloat16
