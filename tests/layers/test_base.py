"""Tests for revtrain.layers.base: the Layer contract, LayerError, Fn and the stack helpers."""
import inspect
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tree_utils import assert_trees_close

from revtrain.layers import (
    EMPTY,
    Add,
    Drop,
    Dup,
    Fn,
    Layer,
    LayerError,
    Parallel,
    Select,
    Serial,
    Swap,
    base,
    inputs_from_stack,
    outputs_onto_stack,
    signature_of,
)

SDS = jax.ShapeDtypeStruct


def _here() -> str:
    """Returns ``file:line`` of the caller's current line."""
    frame = inspect.currentframe().f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class Linear(Layer):
    """``x @ w + b`` with ``w: [d_in, n_units]`` drawn from the rng and ``b = 1``."""

    def __init__(self, n_units: int):
        super().__init__(n_in=1, n_out=1)
        self._n_units = n_units

    def init_weights_and_state(self, input_signature, rng):
        w = jax.random.normal(rng, (input_signature.shape[-1], self._n_units))
        return (w, jnp.ones((self._n_units,))), EMPTY

    def forward_with_state(self, x, weights, state, rng):
        w, b = weights
        return x @ w + b, state


class Counter(Layer):
    """Identity that counts its calls in its state (an int32 scalar)."""

    def init_weights_and_state(self, input_signature, rng):
        return EMPTY, jnp.zeros((), jnp.int32)

    def forward_with_state(self, x, weights, state, rng):
        return x, state + 1


class Failing(Layer):
    """Raises a ValueError in forward (it has no weights, so needs no init)."""

    def forward_with_state(self, x, weights, state, rng):
        raise ValueError("forward went wrong")


class FailingInit(Layer):
    """Raises a ValueError in init."""

    def init_weights_and_state(self, input_signature, rng):
        raise ValueError("init went wrong")


X = np.arange(6, dtype=np.float32).reshape(2, 3)


# --------------------------------------------------------------------------------------
# Attributes, init, pure_fn, forward.


def test_leaf_attributes_before_and_after_init():
    layer = Linear(4)
    assert (layer.n_in, layer.n_out, layer.name, layer.sublayers) == (1, 1, "Linear", ())
    assert layer.weights == () and layer.state == ()
    assert not layer.initialized
    weights, state = layer.init(SDS((2, 3), jnp.float32), rng=jax.random.key(5))
    assert layer.initialized
    assert weights[0].shape == (3, 4) and weights[1].shape == (4,)
    assert state == ()
    assert layer.weights is weights
    np.testing.assert_array_equal(jax.random.key_data(layer.rng),
                                  jax.random.key_data(jax.random.key(5)))


def test_init_is_deterministic_in_rng_and_needs_no_batch():
    w1, _ = Linear(4).init(SDS((2, 3), jnp.float32), rng=jax.random.key(1))
    w2, _ = Linear(4).init(SDS((7, 3), jnp.float32), rng=jax.random.key(1))
    w3, _ = Linear(4).init(SDS((2, 3), jnp.float32), rng=jax.random.key(2))
    assert_trees_close(w1, w2)
    assert not np.allclose(w1[0], w3[0])


def test_default_rng_is_key_zero():
    layer = Linear(2)
    layer.init(SDS((1, 3), jnp.float32))
    expected = jax.random.normal(jax.random.key(0), (3, 2))
    np.testing.assert_allclose(layer.weights[0], expected)


def test_pure_fn_eager_and_jitted_match_numpy():
    layer = Linear(4)
    weights, state = layer.init(SDS((2, 3), jnp.float32), rng=jax.random.key(0))
    expected = X @ np.asarray(weights[0]) + 1.0
    y, new_state = layer.pure_fn(X, weights, state, None)
    np.testing.assert_allclose(y, expected, rtol=1e-5)
    assert new_state == ()
    y_jit, _ = jax.jit(layer.pure_fn)(X, weights, state, jax.random.key(3))
    np.testing.assert_allclose(y_jit, expected, rtol=1e-5)


def test_call_and_forward_use_own_weights_or_given_ones():
    layer = Linear(2)
    weights, _ = layer.init(SDS((2, 3), jnp.float32))
    np.testing.assert_allclose(layer(X), X @ np.asarray(weights[0]) + 1, rtol=1e-5)
    np.testing.assert_allclose(layer.forward(X), layer(X))
    other = (jnp.zeros((3, 2)), jnp.full((2,), 5.0))
    np.testing.assert_allclose(layer(X, weights=other), np.full((2, 2), 5.0))
    assert layer.weights is weights  # passing weights does not store them


def test_forward_stores_new_state_and_pure_fn_does_not():
    layer = Counter()
    layer.init(SDS((2,), jnp.float32))
    layer(np.ones(2))
    layer.forward(np.ones(2))
    assert int(layer.state) == 2
    _, new_state = layer.pure_fn(np.ones(2), (), layer.state, None)
    assert int(new_state) == 3 and int(layer.state) == 2


def test_uninitialized_layer_refuses_to_run():
    layer = Linear(2)
    with pytest.raises(ValueError, match=r"Linear .* not initialised; call Linear.init"):
        layer(X)
    with pytest.raises(ValueError, match="not initialised"):
        layer.output_signature(SDS((2, 3), jnp.float32))


def test_weightless_layers_are_initialized_without_init():
    assert Dup().initialized and Fn("F", lambda x: x).initialized
    assert Serial(Dup(), Add()).initialized
    assert not Serial(Dup(), Linear(2)).initialized


def test_output_signature_by_abstract_evaluation():
    layer = Serial(Linear(5), Fn("ToInt", lambda x: x.astype(jnp.int32)), Dup())
    layer.init(SDS((2, 3), jnp.float32))
    out = layer.output_signature(SDS((2, 3), jnp.float32))
    assert isinstance(out, tuple) and len(out) == 2
    for o in out:
        assert isinstance(o, jax.ShapeDtypeStruct)
        assert (o.shape, o.dtype) == ((2, 5), jnp.int32)
    # Another batch size: weights do not depend on it.
    assert layer.output_signature(SDS((7, 3), jnp.float32))[0].shape == (7, 5)


def test_repr_is_a_trax_like_tree():
    layer = Serial(Swap(), Serial(Dup(), Drop()), Parallel(Fn("Neg", lambda x: -x), Dup()))
    assert repr(layer) == (
        "Serial_in2_out3[\n"
        "  Swap_in2_out2\n"
        "  Serial_in1_out1[\n"
        "    Dup_in1_out2\n"
        "    Drop_in1_out0\n"
        "  ]\n"
        "  Parallel_in2_out3[\n"
        "    Neg_in1_out1\n"
        "    Dup_in1_out2\n"
        "  ]\n"
        "]")
    assert repr(Select([1, 0])) == "Select[1, 0]_in2_out2"


def test_name_can_be_given():
    assert Serial(Dup(), name="Block").name == "Block"
    assert repr(Serial(Dup(), name="Block")).startswith("Block_in1_out2[")


def test_negative_arity_is_rejected():
    with pytest.raises(ValueError, match="n_in=-1"):
        Layer(n_in=-1)


# --------------------------------------------------------------------------------------
# Combinator weights, deferred values.


def test_combinator_weights_are_the_sublayers_and_assignment_reaches_them():
    first, second = Linear(3), Linear(2)
    model = Serial(first, Counter(), second)
    weights, state = model.init(SDS((2, 4), jnp.float32))
    assert len(weights) == 3 and weights[1] == ()
    assert weights[0][0].shape == (4, 3) and weights[2][0].shape == (3, 2)
    assert int(state[1]) == 0
    new = ((jnp.zeros((4, 3)), jnp.ones(3)), (), (jnp.eye(3, 2), jnp.zeros(2)))
    model.weights = new
    assert first.weights is new[0] and second.weights is new[2]
    assert model.weights[0] is new[0]
    np.testing.assert_allclose(model(np.ones((2, 4))), np.ones((2, 2)))


def test_wrong_length_weights_tuple_names_both_sizes():
    model = Serial(Linear(3), Linear(2), Dup())
    with pytest.raises(ValueError, match=r"Serial expects 3 weights .* but got 2"):
        model.weights = ((), ())
    with pytest.raises(ValueError, match=r"Serial expects 3 state .* but got a dict"):
        model.state = {}


def test_assigning_weights_marks_combinator_initialized():
    model = Serial(Linear(2), Dup())
    assert not model.initialized
    model.weights = ((jnp.ones((3, 2)), jnp.zeros(2)), ())
    assert model.initialized
    np.testing.assert_allclose(model(np.ones((1, 3)))[1], np.full((1, 2), 3.0))


class _Fetcher:
    def __init__(self, value):
        self.value, self.calls = value, 0

    def __call__(self):
        self.calls += 1
        return self.value


def test_deferred_leaf_weights_are_fetched_once_on_first_read():
    layer = Linear(2)
    fetch = _Fetcher((jnp.ones((3, 2)), jnp.zeros(2)))
    layer.weights = base._Deferred(fetch)
    assert fetch.calls == 0
    assert layer.weights is fetch.value
    assert layer.weights is fetch.value
    assert fetch.calls == 1


def test_deferred_combinator_weights_are_fetched_once_through_nesting():
    inner = Serial(Linear(2), Linear(1))
    model = Serial(Linear(3), inner)
    value = ((jnp.ones((4, 3)), jnp.zeros(3)),
             ((jnp.ones((3, 2)), jnp.zeros(2)), (jnp.ones((2, 1)), jnp.full(1, 0.5))))
    fetch = _Fetcher(value)
    model.weights = base._Deferred(fetch)
    assert fetch.calls == 0
    assert model.initialized
    assert inner.sublayers[1].weights[1] is value[1][1][1]
    assert fetch.calls == 1
    assert_trees_close(model.weights, value)
    assert fetch.calls == 1
    # 1 * 4 -> 4 * 3 = 12 -> 12 * 2 = 24 -> + 0.5
    np.testing.assert_allclose(model(np.ones((1, 4))), [[24.5]])


def test_deferred_state_through_combinator():
    model = Serial(Counter(), Counter())
    fetch = _Fetcher((jnp.array(5), jnp.array(7)))
    model.state = base._Deferred(fetch)
    assert fetch.calls == 0
    model(np.ones(2))
    assert [int(s) for s in model.state] == [6, 8] and fetch.calls == 1


def test_deferred_value_of_wrong_length_names_sizes_on_read():
    model = Serial(Linear(2), Linear(2))
    model.weights = base._Deferred(lambda: ((), (), ()))
    with pytest.raises(ValueError, match=r"tuple of 2 items .*got 3"):
        _ = model.weights


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
# Fn.


def test_fn_arity_from_positional_arguments():
    assert (Fn("Z", lambda: jnp.zeros(2)).n_in, Fn("O", lambda x: x).n_in) == (0, 1)
    assert Fn("T", lambda x, y, z: x + y + z).n_in == 3
    assert Fn("T", lambda x, y: (x, y, x), n_out=3).n_out == 3


def test_fn_values():
    a, b = np.array([1.0, 2.0]), np.array([10.0, 20.0])
    np.testing.assert_allclose(Fn("Sub", lambda x, y: x - y)((a, b)), [-9.0, -18.0])
    np.testing.assert_allclose(Fn("Z", lambda: jnp.full(2, 4.0))(()), [4.0, 4.0])
    y = Fn("Split", lambda x: (x, 2 * x), n_out=2)(a)
    assert isinstance(y, tuple) and len(y) == 2
    np.testing.assert_allclose(y[1], [2.0, 4.0])
    # A one-item tuple or list for n_out == 1 comes back bare.
    np.testing.assert_allclose(Fn("One", lambda x: [x + 1])(a), [2.0, 3.0])


def test_fn_wrong_number_of_outputs_is_an_error():
    with pytest.raises(LayerError, match=r"Two expects 2 outputs from .* but got 1"):
        Fn("Two", lambda x: x, n_out=2)(np.ones(2))
    with pytest.raises(LayerError, match=r"One expects 1 outputs from .* but got 2"):
        Fn("One", lambda x: (x, x))(np.ones(2))


def test_fn_wrong_number_of_inputs_says_expected_and_got():
    with pytest.raises(LayerError, match="Pair expects 2 inputs but got 3"):
        Fn("Pair", lambda x, y: x + y)((np.ones(2),) * 3)


def test_fn_rejects_non_positional_arguments():
    with pytest.raises(ValueError, match="argument 'xs' of f must be positional"):
        Fn("V", lambda *xs: xs[0])
    with pytest.raises(ValueError, match="argument 'k' of f must be positional"):
        Fn("K", lambda x, *, k: x)


# --------------------------------------------------------------------------------------
# Stack helpers and signatures.


@pytest.mark.parametrize("stack, n, expected", [
    (("a", "b", "c"), 1, "a"),
    (("a", "b", "c"), 2, ("a", "b")),
    (("a", "b", "c"), 3, ("a", "b", "c")),
    (("a", "b", "c"), 0, ()),
    (["a", "b"], 2, ("a", "b")),
])
def test_inputs_from_stack(stack, n, expected):
    assert inputs_from_stack(stack, n) == expected


def test_inputs_from_a_bare_item_stack():
    x = np.ones(3)
    assert inputs_from_stack(x, 1) is x
    assert inputs_from_stack(x, 0) == ()


@pytest.mark.parametrize("outputs, stack, n, expected", [
    ("y", ("a", "b", "c"), 1, ("y", "b", "c")),
    (("y", "z"), ("a", "b", "c"), 1, ("y", "z", "b", "c")),
    ("y", ("a", "b"), 2, "y"),
    ((), ("a", "b"), 1, "b"),
    ((), ("a", "b"), 2, ()),
    ("y", ("a", "b"), 0, ("y", "a", "b")),
    (("y", "z"), (), 0, ("y", "z")),
])
def test_outputs_onto_stack(outputs, stack, n, expected):
    assert outputs_onto_stack(outputs, stack, n) == expected


@pytest.mark.parametrize("helper", [inputs_from_stack,
                                    lambda s, n: outputs_onto_stack("y", s, n)])
def test_stack_shorter_than_n_names_both_sizes(helper):
    with pytest.raises(ValueError, match="stack has 2 items but 3 are needed"):
        helper(("a", "b"), 3)
    with pytest.raises(ValueError, match="stack has 1 items but 2 are needed"):
        helper(np.ones(2), 2)


def test_signature_of_and_stack_layers_on_signatures():
    sig = signature_of((np.ones((2, 3), np.float32), jnp.zeros(4, jnp.int32)))
    assert sig == (SDS((2, 3), jnp.float32), SDS((4,), jnp.int32))
    assert base.format_signature(sig) == "(float32[2,3], int32[4])"
