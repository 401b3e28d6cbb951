"""Tests for revtrain.layers.layer: the Layer contract and combinator weights."""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    EMPTY,
    Add,
    Dense,
    Drop,
    Dropout,
    Dup,
    Fn,
    Layer,
    LayerError,
    Parallel,
    Relu,
    Residual,
    ReversibleHalfResidual,
    ReversibleSerial,
    ReversibleSwap,
    Select,
    Serial,
    Swap,
)
from revtrain.layers.normalization import BatchNorm
from tests.layers.toy_layers import Linear
from tests.tree_utils import assert_trees_close

SDS = jax.ShapeDtypeStruct
X = np.arange(6, dtype=np.float32).reshape(2, 3)


class Counter(Layer):
    """Identity that counts its calls in its state (an int32 scalar)."""

    def init_weights_and_state(self, input_signature, rng):
        return EMPTY, jnp.zeros((), jnp.int32)

    def forward_with_state(self, x, weights, state, rng):
        return x, state + 1


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
# Combinator weights.


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


# --------------------------------------------------------------------------------------
# Reused layer objects, wrong numbers of stack items.


ONES = np.ones((2, 3), np.float32)


def _dense_and_its_line() -> tuple[Dense, int]:
    """A new Dense and the line that created it."""
    return Dense(3), inspect.currentframe().f_lineno


@pytest.mark.parametrize("make", [
    lambda d: Serial(d, Relu(), d),
    lambda d: Serial(Residual(d), Residual(d)),
    lambda d: Parallel(d, d),
    lambda d: Serial(Serial(d), Serial(Relu(), Serial(d))),
    lambda d: ReversibleSerial(ReversibleHalfResidual(d), ReversibleSwap(),
                               ReversibleHalfResidual(d)),
])
def test_a_layer_with_weights_used_twice_is_rejected_naming_it(make):
    # Trainers would hold one weight copy per use and write back only the last one.
    d, line = _dense_and_its_line()
    with pytest.raises(ValueError, match=r"Dense \(created at .*test_layer.py:"
                                         rf"{line}\) is used more than once"):
        make(d)


def test_a_reused_combinator_holding_weights_is_rejected():
    block = Serial(Dense(3), Relu())
    with pytest.raises(ValueError, match=r"Dense .* is used more than once"):
        Serial(block, block)


def test_a_reused_stateful_layer_is_rejected():
    norm = BatchNorm(axis=0)
    with pytest.raises(ValueError, match=r"BatchNorm .* is used more than once"):
        Serial(norm, Dense(3), norm)


def test_weightless_layers_may_be_reused_and_run():
    relu, drop, swap = Relu(), Dropout(0.5), ReversibleSwap()
    model = Serial(relu, Dense(3), relu, drop, drop)
    model.init(ONES, rng=jax.random.key(0))
    y = model.pure_fn(ONES, model.weights, model.state, jax.random.key(1))[0]
    assert y.shape == (2, 3)
    rev = ReversibleSerial(swap, swap)
    out, _ = rev.pure_fn((ONES, 2 * ONES), rev.weights, rev.state, None)
    np.testing.assert_array_equal(out[0], ONES)


def test_leaf_given_two_items_is_a_clear_layer_error_in_init_and_pure_fn():
    layer = Dense(3)
    with pytest.raises(LayerError, match=r"Dense.init .*Dense expects 1 inputs but got 2"):
        layer.init((ONES, ONES))
    layer.init(ONES)
    with pytest.raises(LayerError, match=r"Dense.pure_fn .*Dense expects 1 inputs but got 2"):
        layer.pure_fn((ONES, ONES), layer.weights, layer.state, None)
    assert layer(jnp.asarray(ONES)).shape == (2, 3)
