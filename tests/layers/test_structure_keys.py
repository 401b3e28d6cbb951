"""Tests for revtrain.layers.structure_keys: `Layer.structure_key`, proven identity or None.

Trainers share one compiled program between layers with equal, non-None keys, so a key
must capture everything the layer computes with, or be None ("never share").
"""
import functools
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    Concatenate,
    Conv,
    Dense,
    Dup,
    Embedding,
    Fn,
    Layer,
    Remat,
    Residual,
    ReversibleHalfResidual,
    Select,
    Serial,
)
from revtrain.layers import layer as layer_module


class Linear(Layer):
    """``x @ w`` with ``w: [d_in, n_units]`` (only its constructor matters here)."""

    def __init__(self, n_units: int):
        super().__init__(n_in=1, n_out=1)
        self._n_units = n_units


class Scale(Layer):
    """Multiplies by ``factors``, an array argument."""

    def __init__(self, factors):
        super().__init__()
        self._factors = factors

    def forward_with_state(self, x, weights, state, rng):
        return x * self._factors, state


class Takes(Layer):
    """A layer with one constructor argument of any kind."""

    def __init__(self, value):
        super().__init__()
        self._value = value


class Shadowed(Layer):
    """Defined here, then its module-level name is rebound (below)."""


_SHADOWED = Shadowed
Shadowed = None  # noqa: F811 -- the name no longer finds the class


def _double(x):
    return 2 * x


def _triple(x):
    return 3 * x


def _multiply(factor, x):
    return factor * x


def scale_layer(s):
    """Returns a layer of a class defined in this function: it reads ``s`` from the call."""
    class _Scale(Layer):
        def forward_with_state(self, x, weights, state, rng):
            return x * s, state

    return _Scale()


def test_structure_key_follows_constructor_args():
    assert Concatenate(axis=1).structure_key == Concatenate(axis=1).structure_key
    assert Concatenate(axis=1).structure_key != Concatenate(axis=-1).structure_key
    assert Concatenate(n_items=3).structure_key != Concatenate().structure_key
    # Defaults are filled in: equal arguments however they are spelled.
    assert Concatenate().structure_key == Concatenate(2, axis=-1).structure_key
    assert Fn("F", _double).structure_key == Fn("F", _double, 1).structure_key
    assert Fn("F", _double).structure_key != Fn("F", _triple).structure_key
    assert Fn("F", _double).structure_key != Fn("G", _double).structure_key
    assert Select([0, 1]).structure_key != Select([1, 0]).structure_key
    assert Linear(3).structure_key != Linear(4).structure_key
    assert Linear(3).structure_key != Concatenate(3).structure_key
    assert Linear(3).structure_key is not None


def test_structure_key_of_combinators_uses_sublayer_keys():
    a = Serial(Linear(3), Fn("F", _double), Dup())
    b = Serial(Linear(3), Fn("F", _double), Dup())
    c = Serial(Linear(3), Fn("F", _triple), Dup())
    assert a.structure_key is not None
    assert a.structure_key == b.structure_key != c.structure_key
    assert len({a.structure_key, b.structure_key, c.structure_key}) == 2  # hashable


def test_structure_key_compares_arrays_by_value():
    assert Scale(np.array([1.0, 2.0])).structure_key == Scale(np.array([1.0, 2.0])).structure_key
    assert Scale(np.array([1.0, 2.0])).structure_key != Scale(np.array([1.0, 3.0])).structure_key
    assert Scale(jnp.ones(2)).structure_key != Scale(jnp.ones(2, jnp.bfloat16)).structure_key


def test_a_class_defined_in_a_function_has_no_key():
    # Both would share one compiled program under a (module, qualname) key, computing x * 2.
    assert scale_layer(2.0).structure_key is None
    assert scale_layer(3.0).structure_key is None
    assert Takes(type(scale_layer(2.0))).structure_key is None  # as an argument, too


def test_a_class_not_found_at_its_module_and_qualname_has_no_key():
    assert _SHADOWED().structure_key is None
    made = type("Made", (Layer,), {"__module__": __name__})
    assert made().structure_key is None
    assert Takes(Linear).structure_key == Takes(Linear).structure_key is not None


def test_lambdas_closures_and_bound_methods_have_no_key():
    assert Fn("f", lambda x: x * 2).structure_key is None
    assert Fn("f", lambda x: x * 3).structure_key is None
    factor = 2.0

    def nested(x):
        return factor * x

    assert Fn("f", nested).structure_key is None
    assert Fn("f", functools.partial(_multiply, lambda: 2)).structure_key is None
    assert Fn("f", functools.partial(lambda f, x: f * x, 2)).structure_key is None
    assert Fn("f", np.ones(3).__mul__).structure_key is None
    assert Fn("f", Linear(2).forward).structure_key is None


def test_module_level_functions_and_their_partials_are_keyed_by_name():
    assert Fn("relu", jax.nn.relu).structure_key == Fn("relu", jax.nn.relu).structure_key
    assert Fn("relu", jax.nn.relu).structure_key is not None
    assert Fn("tanh", jnp.tanh).structure_key is not None
    assert Fn("tanh", jnp.tanh).structure_key != Fn("tanh", jnp.sin).structure_key
    two = Fn("f", functools.partial(_multiply, 2.0))
    assert two.structure_key == Fn("f", functools.partial(_multiply, 2.0)).structure_key
    assert two.structure_key is not None
    assert two.structure_key != Fn("f", functools.partial(_multiply, 3.0)).structure_key


def test_equal_values_of_different_types_have_different_keys():
    # x * 2 keeps an int32 x int32; x * 2.0 makes it float32.
    keys = {Takes(2).structure_key, Takes(2.0).structure_key, Takes(True).structure_key,
            Takes(np.float32(2)).structure_key}
    assert len(keys) == 4 and None not in keys
    assert Takes((1, 2.0)).structure_key != Takes((1.0, 2)).structure_key


def test_an_unhashable_argument_that_is_not_a_container_has_no_key():
    # Keyed by id() it could match a later object that reuses the id after collection.
    assert Takes({1, 2}).structure_key is None
    assert Takes([1, {"a": (2, 3)}]).structure_key is not None


@pytest.mark.parametrize("make", [
    lambda bad: Serial(Linear(2), bad),
    lambda bad: Serial(Serial(Dup(), bad)),
    lambda bad: Residual(bad),
    lambda bad: ReversibleHalfResidual(bad),
    lambda bad: Remat(bad),
])
def test_a_layer_with_an_unprovable_sublayer_has_no_key(make):
    assert make(scale_layer(2.0)).structure_key is None
    assert make(Fn("f", lambda x: x)).structure_key is None
    assert make(Linear(2)).structure_key is not None


def test_default_initialisers_keep_dense_conv_and_embedding_keys():
    for make in (lambda: Dense(4), lambda: Conv(3, (2, 2)), lambda: Embedding(10, 4)):
        assert make().structure_key == make().structure_key is not None
    assert Dense(4, kernel_init=jax.nn.initializers.normal(0.1)).structure_key is None


def test_the_key_is_computed_once_and_cached():
    layer = Serial(Linear(3), Fn("F", _double))
    with mock.patch.object(layer_module, "structure_key_of",
                           wraps=layer_module.structure_key_of) as compute:
        first = layer.structure_key
        assert compute.call_count == 3  # once for each layer of the tree
        assert layer.structure_key is first
        assert all(sub.structure_key is not None for sub in layer.sublayers)
    assert compute.call_count == 3
    unprovable = scale_layer(1.0)
    with mock.patch.object(layer_module, "structure_key_of",
                           wraps=layer_module.structure_key_of) as compute:
        assert unprovable.structure_key is None
        assert unprovable.structure_key is None
    assert compute.call_count == 1


def test_test_module_classes_are_found_where_pytest_imported_them():
    # The rule relies on sys.modules; a sanity check that this module is there.
    assert sys.modules[Linear.__module__].Linear is Linear


def test_one_byte_ml_dtypes_with_equal_dtype_str_get_different_keys():
    # float8_e4m3fn and float8_e4m3fnuz share dtype.str ('<V1'); a key of .str alone would
    # let two layers that differ only in them share one compiled program.
    a, b = jnp.dtype("float8_e4m3fn"), jnp.dtype("float8_e4m3fnuz")
    assert a.str == b.str
    from revtrain.layers.structure_keys import _freeze
    assert _freeze(a) != _freeze(b)
    assert _freeze(jnp.zeros(2, a)) != _freeze(jnp.zeros(2, b))
