"""Tests for revtrain.layers.signatures: LayerError, creation sites, signatures, dtypes."""
import inspect
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    Add,
    Dup,
    Fn,
    Layer,
    LayerError,
    Serial,
    signature_of,
)
from revtrain.layers.signatures import float_dtype, format_signature
from tests.layers.toy_layers import Linear

SDS = jax.ShapeDtypeStruct
X = np.arange(6, dtype=np.float32).reshape(2, 3)


def _here() -> str:
    """Returns ``file:line`` of the caller's current line."""
    frame = inspect.currentframe().f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class Failing(Layer):
    """Raises a ValueError in forward (it has no weights, so needs no init)."""

    def forward_with_state(self, x, weights, state, rng):
        raise ValueError("forward went wrong")


class FailingInit(Layer):
    """Raises a ValueError in init."""

    def init_weights_and_state(self, input_signature, rng):
        raise ValueError("init went wrong")


# --------------------------------------------------------------------------------------
# LayerError.


def test_forward_error_names_layer_creation_site_and_inputs():
    layer, created_at = Failing(), _here()
    assert layer.caller == created_at
    with pytest.raises(LayerError) as info:
        layer(X)
    message = str(info.value)
    assert "Failing.pure_fn" in message
    assert f"layer created at {created_at}" in message
    assert "float32[2,3]" in message
    assert "ValueError: forward went wrong" in message
    assert isinstance(info.value.original, ValueError)
    assert info.value.__cause__ is info.value.original
    assert info.value.layer_name == "Failing" and info.value.caller == created_at


def test_init_error_names_layer_and_signature():
    layer, created_at = FailingInit(), _here()
    with pytest.raises(LayerError, match=r"FailingInit.init \(layer created at .*int32\[4\]"):
        layer.init(SDS((4,), jnp.int32))
    assert layer.caller == created_at


def test_nested_error_names_the_innermost_layer():
    inner, inner_site = Failing(), _here()
    model = Serial(Dup(), Serial(Add(), inner, name="Inner"), name="Outer")
    with pytest.raises(LayerError) as info:
        model(np.ones((3, 2), np.float32))
    assert info.value.layer_name == "Failing"
    assert f"created at {inner_site}" in str(info.value)
    assert "float32[3,2]" in str(info.value)


def test_nested_init_error_names_the_innermost_layer():
    inner, inner_site = FailingInit(), _here()
    model = Serial(Linear(2), Serial(inner))
    with pytest.raises(LayerError) as info:
        model.init(SDS((5, 3), jnp.float32))
    assert info.value.layer_name == "FailingInit" and info.value.method == "init"
    assert inner_site in str(info.value) and "float32[5,2]" in str(info.value)


def test_error_under_jit_is_a_layer_error():
    layer, created_at = Failing(), _here()
    with pytest.raises(LayerError, match=r"Failing.pure_fn .*float32\[2,3\]") as info:
        jax.jit(layer.pure_fn)(X, (), (), None)
    assert created_at in str(info.value)


def test_error_message_survives_key_inputs_and_pickling():
    layer = Fn("Bad", lambda x: x.undefined_attribute)
    with pytest.raises(LayerError, match=r"key<fry>\[2\]") as info:
        layer(jax.random.split(jax.random.key(0), 2))
    copy = pickle.loads(pickle.dumps(info.value))
    assert str(copy) == str(info.value) and copy.layer_name == "Bad"


def test_subclass_with_own_init_points_at_the_creating_line():
    layer, site = Linear(2), _here()
    assert layer.caller == site
    model, model_site = Serial(Linear(2), Dup()), _here()
    assert model.caller == model_site and model.sublayers[0].caller == model_site


def test_layers_made_by_a_helper_point_at_the_helper_line():
    def make():
        return Fn("Made", lambda x: x), _here()

    layer, site = make()
    assert layer.caller == site


# --------------------------------------------------------------------------------------
# Signatures and dtypes.


def test_signature_of_and_stack_layers_on_signatures():
    sig = signature_of((np.ones((2, 3), np.float32), jnp.zeros(4, jnp.int32)))
    assert sig == (SDS((2, 3), jnp.float32), SDS((4,), jnp.int32))
    assert format_signature(sig) == "(float32[2,3], int32[4])"


def test_format_signature_names_non_array_leaves_by_type():
    assert format_signature((SDS((), jnp.bfloat16), 3, "a")) == "(bfloat16[], int, str)"


@pytest.mark.parametrize("dtype, fallback, expected", [
    (jnp.bfloat16, jnp.float32, jnp.bfloat16),
    (jnp.float16, jnp.int32, jnp.float16),
    (jnp.int32, jnp.float32, jnp.float32),
    (jnp.bool_, jnp.bfloat16, jnp.bfloat16),
])
def test_float_dtype_keeps_float_inputs_and_falls_back_for_the_rest(dtype, fallback, expected):
    assert float_dtype(SDS((2,), dtype), fallback) == jnp.dtype(expected)
    assert float_dtype(jnp.zeros(2, dtype), fallback) == jnp.dtype(expected)


def test_float_dtype_defaults_to_float32():
    assert float_dtype(jnp.arange(3)) == jnp.float32
