"""Tests for revtrain.layers.combinators: stack routing, arity, rng splitting, weights."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    EMPTY,
    Add,
    Branch,
    Concatenate,
    Drop,
    Dup,
    Fn,
    Layer,
    LayerError,
    Parallel,
    Residual,
    Select,
    Serial,
    Split,
    Swap,
    inputs_from_stack,
    outputs_onto_stack,
    split_rng,
)
from tests.tree_utils import assert_trees_close

SDS = jax.ShapeDtypeStruct

A = np.array([1.0, 2.0], np.float32)
B = np.array([10.0, 20.0], np.float32)
C = np.array([100.0, 200.0], np.float32)
D = np.array([1000.0, 2000.0], np.float32)


def neg():
    return Fn("Neg", lambda x: -x)


def sub():
    return Fn("Sub", lambda x, y: x - y)


class AddUniform(Layer):
    """Dropout-like random layer: ``x + uniform(rng, x.shape)``."""

    def forward_with_state(self, x, weights, state, rng):
        return x + jax.random.uniform(rng, x.shape), state


class RandomScale(Layer):
    """``x * w`` with ``w: [d]`` drawn from the init rng."""

    def init_weights_and_state(self, input_signature, rng):
        return jax.random.normal(rng, input_signature.shape[-1:]), EMPTY

    def forward_with_state(self, x, weights, state, rng):
        return x * weights, state


class Linear(Layer):
    """``x @ w`` with ``w: [d_in, n_units]`` of ones; its shape follows the input."""

    def __init__(self, n_units: int):
        super().__init__()
        self._n_units = n_units

    def init_weights_and_state(self, input_signature, rng):
        return jnp.ones((input_signature.shape[-1], self._n_units)), EMPTY

    def forward_with_state(self, x, weights, state, rng):
        return x @ weights, state


class Counter(Layer):
    """Identity that counts its calls in its state."""

    def init_weights_and_state(self, input_signature, rng):
        return EMPTY, jnp.zeros((), jnp.int32)

    def forward_with_state(self, x, weights, state, rng):
        return x, state + 1


def assert_stack(actual, expected):
    """Compares a layer output (bare array or tuple) with a list of arrays."""
    if len(expected) == 1:
        assert not isinstance(actual, tuple), f"expected a bare array, got {actual!r}"
        actual = (actual,)
    assert isinstance(actual, tuple) and len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6)


# --------------------------------------------------------------------------------------
# Arity.


@pytest.mark.parametrize("make, n_in, n_out", [
    (lambda: Select([0]), 1, 1),
    (lambda: Select([2, 0]), 3, 2),
    (lambda: Select([0, 0, 0]), 1, 3),
    (lambda: Select([1], n_in=4), 4, 1),
    (lambda: Select([], n_in=2), 2, 0),
    (Dup, 1, 2),
    (Swap, 2, 2),
    (Drop, 1, 0),
    (Add, 2, 1),
    (lambda: Concatenate(n_items=3), 3, 1),
    (lambda: Split(n_items=4), 1, 4),
    (lambda: Serial(), 0, 0),
    (lambda: Serial(Dup(), Dup()), 1, 3),
    (lambda: Serial(Drop(), Drop()), 2, 0),
    (lambda: Serial(Add(), Add()), 3, 1),
    (lambda: Serial(Dup(), Add()), 1, 1),
    (lambda: Serial(neg(), Add()), 2, 1),
    (lambda: Serial(Swap(), Dup()), 2, 3),
    (lambda: Serial(Drop(), Dup(), Select([0, 1, 2, 1])), 3, 4),
    (lambda: Parallel(Dup(), Add(), None), 4, 4),
    (lambda: Parallel(), 0, 0),
    (lambda: Branch(Add(), Select([0])), 2, 2),
    (lambda: Branch(None, Select([2, 1]), Dup()), 3, 5),
    (lambda: Branch(), 0, 0),
    (lambda: Residual(neg()), 1, 1),
])
def test_arity(make, n_in, n_out):
    layer = make()
    assert (layer.n_in, layer.n_out) == (n_in, n_out)


# --------------------------------------------------------------------------------------
# Simple stack layers.


def test_select_dup_swap_drop_add_values():
    assert_stack(Select([2, 0, 2])((A, B, C)), [C, A, C])
    assert_stack(Select([1], n_in=3)((A, B, C)), [B])
    assert_stack(Dup()(A), [A, A])
    assert_stack(Swap()((A, B)), [B, A])
    assert Drop()(A) == ()
    assert_stack(Add()((A, B)), [A + B])


def test_select_rejects_bad_indices():
    with pytest.raises(ValueError, match=r"indices must be >= 0; got \[0, -1\]"):
        Select([0, -1])
    with pytest.raises(ValueError, match=r"Select\(\[0, 2\]\) needs n_in >= 3; got n_in=2"):
        Select([0, 2], n_in=2)


def test_concatenate_and_split_values():
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    y = -np.arange(4, dtype=np.float32).reshape(2, 2)
    np.testing.assert_array_equal(Concatenate()((x, y)), np.concatenate([x, y], axis=-1))
    np.testing.assert_array_equal(Concatenate(n_items=3, axis=0)((x, x, x)),
                                  np.concatenate([x, x, x], axis=0))
    assert_stack(Split(n_items=3)(x), np.split(x, 3, axis=-1))
    assert_stack(Split(axis=0)(x), [x[:1], x[1:]])
    np.testing.assert_array_equal(Split(n_items=1)(x), x)
    np.testing.assert_array_equal(Concatenate()(Split()(x)), x)


def test_concatenate_and_split_reject_bad_arguments():
    with pytest.raises(ValueError, match="n_items >= 1; got 0"):
        Concatenate(n_items=0)
    with pytest.raises(ValueError, match="n_items >= 1; got 0"):
        Split(n_items=0)
    with pytest.raises(LayerError, match="axis -1 of size 5 cannot be split into 2 equal parts"):
        Split()(np.ones((2, 5)))


def test_stack_given_as_list():
    assert_stack(Swap()([A, B]), [B, A])
    assert_stack(Select([1])([A, B]), [B])
    assert_stack(Parallel(neg(), None)([A, B]), [-A, B])
    np.testing.assert_array_equal(Concatenate()([A, B]), np.concatenate([A, B]))


# --------------------------------------------------------------------------------------
# Serial.


def test_serial_of_two_dups_gives_three_copies():
    assert_stack(Serial(Dup(), Dup())(A), [A, A, A])


def test_serial_values_and_pass_through_of_items_below():
    assert_stack(Serial(neg(), Add())((A, B)), [B - A])
    assert_stack(Serial(Swap(), neg())((A, B)), [-B, A])
    assert_stack(Serial(Drop(), sub())((A, B, C)), [B - C])
    assert_stack(Serial(Dup(), Add(), Dup(), Add())(A), [4 * A])
    assert Serial(Drop(), Drop())((A, B)) == ()


def test_serial_flattens_lists_and_keeps_nested_serials():
    inner = Serial(Dup(), Add())
    first, last = neg(), Swap()
    model = Serial(first, [Dup(), [inner, None]], None, (last,))
    assert len(model.sublayers) == 4
    assert model.sublayers[0] is first and model.sublayers[2] is inner
    assert model.sublayers[3] is last
    assert_stack(model(A), [-A, -2 * A])


def test_empty_combinators_are_weightless_and_run():
    for empty in (Serial(), Branch(), Parallel(), Serial([], None)):
        assert empty.initialized and empty.weights == () and empty(()) == ()
    model = Serial(Dup(), Serial(), Branch(), Parallel(), Add())
    assert model.initialized
    assert_stack(model(A), [2 * A])


def test_serial_rejects_non_layers():
    with pytest.raises(TypeError, match="expected a Layer, got function"):
        Serial(lambda x: x)


def test_serial_splits_rng_one_key_per_sublayer_in_order():
    layers = [AddUniform(), Dup(), AddUniform(), Swap(), AddUniform()]
    model = Serial(*layers)
    rng = jax.random.key(7)
    x = np.zeros((3, 4), np.float32)
    actual = model(x, rng=rng)
    # The same layers run by hand with split keys.
    keys = jax.random.split(rng, len(layers))
    stack = x
    for i, layer in enumerate(layers):
        y, _ = layer.pure_fn(inputs_from_stack(stack, layer.n_in), (), (), keys[i])
        stack = outputs_onto_stack(y, stack, layer.n_in)
    assert_stack(actual, list(stack))
    u0 = jax.random.uniform(keys[0], x.shape)
    np.testing.assert_allclose(actual[0], u0 + jax.random.uniform(keys[4], x.shape))
    np.testing.assert_allclose(actual[1], u0 + jax.random.uniform(keys[2], x.shape))
    assert not np.allclose(actual[0], actual[1])


def test_serial_rng_split_is_hierarchical_and_jit_invariant():
    model = Serial(AddUniform(), Serial(AddUniform(), AddUniform()))
    rng = jax.random.key(3)
    x = np.zeros(5, np.float32)
    outer = jax.random.split(rng, 2)
    inner = jax.random.split(outer[1], 2)
    expected = sum(jax.random.uniform(k, x.shape) for k in (outer[0], inner[0], inner[1]))
    y, _ = model.pure_fn(x, model.weights, model.state, rng)
    np.testing.assert_allclose(y, expected, rtol=1e-6)
    y_jit, _ = jax.jit(model.pure_fn)(x, model.weights, model.state, rng)
    np.testing.assert_allclose(y_jit, expected, rtol=1e-6)
    model.rng = rng
    np.testing.assert_allclose(model(x), expected, rtol=1e-6)


def test_split_rng_matches_jax_random_split():
    rng = jax.random.key(11)
    keys = split_rng(rng, 3)
    expected = jax.random.split(rng, 3)
    assert len(keys) == 3
    for i in range(3):
        np.testing.assert_array_equal(jax.random.key_data(keys[i]),
                                      jax.random.key_data(expected[i]))
    assert split_rng(None, 2) == [None, None] and split_rng(rng, 0) == []


def test_serial_init_splits_rng_and_propagates_shapes():
    model = Serial(Linear(4), RandomScale(), Dup(), Parallel(Linear(3), RandomScale()))
    rng = jax.random.key(2)
    weights, _ = model.init(SDS((2, 5), jnp.float32), rng=rng)
    assert weights[0].shape == (5, 4) and weights[1].shape == (4,)
    assert weights[3][0].shape == (4, 3) and weights[3][1].shape == (4,)
    keys = jax.random.split(rng, 4)
    np.testing.assert_allclose(weights[1], jax.random.normal(keys[1], (4,)))
    parallel_keys = jax.random.split(keys[3], 2)
    np.testing.assert_allclose(weights[3][1], jax.random.normal(parallel_keys[1], (4,)))
    out = model.output_signature(SDS((2, 5), jnp.float32))
    assert [o.shape for o in out] == [(2, 3), (2, 4)]


def test_serial_threads_state_of_sublayers():
    model = Serial(Counter(), Dup(), Parallel(Counter(), Counter()))
    model.init(SDS((2,), jnp.float32))
    for _ in range(3):
        model(A)
    assert int(model.state[0]) == 3
    assert [int(s) for s in model.state[2]] == [3, 3]
    _, new_state = model.pure_fn(A, model.weights, model.state, None)
    assert int(new_state[0]) == 4 and int(model.state[0]) == 3


# --------------------------------------------------------------------------------------
# Branch, Parallel, Residual.


def test_branch_values():
    assert_stack(Branch(Add(), Select([0]))((A, B)), [A + B, A])
    assert_stack(Branch(None, neg())(A), [A, -A])
    assert_stack(Branch(sub(), Select([1, 0]), None)((A, B)), [A - B, B, A, A])
    assert_stack(Branch([Dup(), Add()], neg())(A), [2 * A, -A])
    assert_stack(Branch(Select([2]), Dup())((A, B, C)), [C, A, A])


def test_branch_splits_rng():
    rng = jax.random.key(5)
    model = Branch(AddUniform(), AddUniform())
    y0, y1 = model(np.zeros(3, np.float32), rng=rng)
    keys = jax.random.split(rng, 2)
    np.testing.assert_allclose(y0, jax.random.uniform(keys[0], (3,)))
    np.testing.assert_allclose(y1, jax.random.uniform(keys[1], (3,)))


def test_parallel_values():
    assert_stack(Parallel(neg(), None, Add())((A, B, C, D)), [-A, B, C + D])
    assert_stack(Parallel(Dup(), Drop())((A, B)), [A, A])
    assert_stack(Parallel([Dup(), Add()], Swap())((A, B, C)), [2 * A, C, B])
    assert_stack(Parallel(None, None)((A, B)), [A, B])


def test_parallel_init_gives_each_sublayer_its_section():
    model = Parallel(Linear(2), None, Linear(3))
    weights, _ = model.init((SDS((1, 4), jnp.float32), SDS((1, 7), jnp.int32),
                             SDS((1, 5), jnp.float32)))
    assert weights[0].shape == (4, 2) and weights[1] == () and weights[2].shape == (5, 3)
    y = model((np.ones((1, 4)), np.zeros((1, 7), np.int32), np.ones((1, 5))))
    assert_stack(y, [np.full((1, 2), 4.0), np.zeros((1, 7)), np.full((1, 3), 5.0)])


def test_residual_values_and_weights():
    assert_stack(Residual(neg(), Dup(), Add())(A), [A - 2 * A])
    model = Residual(Linear(2))
    weights, _ = model.init(SDS((1, 2), jnp.float32))
    assert model.name == "Residual"
    # Serial(Branch(shortcut, Serial(f)), Add)
    assert weights[0][0] == () and weights[0][1][0].shape == (2, 2) and weights[1] == ()
    assert_stack(model(np.array([[1.0, 2.0]])), [[[4.0, 5.0]]])
    with_shortcut = Residual(neg(), shortcut=Fn("Double", lambda x: 2 * x))
    assert_stack(with_shortcut(A), [A])


# --------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize("layer, x, message", [
    (Serial(Add()), A, "Serial expects 2 inputs but got 1"),
    (Serial(Add()), (A, B, C), "Serial expects 2 inputs but got 3"),
    (Serial(Dup()), (A, B), "Serial expects 1 inputs but got 2"),
    (Parallel(None, Add()), (A, B), "Parallel expects 3 inputs but got 2"),
    (Branch(Add(), None), (A, B, C), "Branch expects 2 inputs but got 3"),
    (Select([1]), A, r"Select\[1\] expects 2 inputs but got 1"),
    (Swap(), (A, B, C), "Swap expects 2 inputs but got 3"),
    (Concatenate(n_items=3), (A, B), "Concatenate expects 3 inputs but got 2"),
])
def test_wrong_number_of_stack_items_says_expected_and_got(layer, x, message):
    with pytest.raises(LayerError, match=message):
        layer(x)


def test_wrong_number_of_signature_items_in_init():
    with pytest.raises(LayerError, match="Serial expects 2 inputs but got 1"):
        Serial(Linear(2), Add()).init(SDS((2, 3), jnp.float32))
    with pytest.raises(LayerError, match="Parallel expects 2 inputs but got 1"):
        Parallel(Linear(2), Linear(2)).init(SDS((2, 3), jnp.float32))


@pytest.mark.parametrize("make", [lambda: Serial(Dup(), Add()),
                                  lambda: Branch(Dup(), None),
                                  lambda: Parallel(Dup(), None)])
def test_wrong_length_weights_in_pure_fn_is_an_error(make):
    layer = make()
    x = A if layer.n_in == 1 else (A, B)
    with pytest.raises(LayerError, match=r"expects 2 weights \(one per sublayer\) but got 0"):
        layer.pure_fn(x, (), ((), ()), None)
    with pytest.raises(LayerError, match=r"expects 2 state \(one per sublayer\) but got 3"):
        layer.pure_fn(x, ((), ()), ((), (), ()), None)


def test_error_inside_combinator_names_inner_layer_and_its_inputs():
    model = Serial(Dup(), Concatenate(), Split(n_items=3))
    with pytest.raises(LayerError) as info:
        model(np.ones((2, 2), np.float32))
    assert info.value.layer_name == "Split"
    assert "float32[2,4]" in str(info.value) and "test_combinators.py" in str(info.value)


# --------------------------------------------------------------------------------------
# Compilation.


def test_jitted_serial_does_not_recompile():
    traces = []

    def double(x):
        traces.append(x.shape)
        return 2 * x

    model = Serial(Fn("Double", double), Dup(), AddUniform(), Add())
    f = jax.jit(model.pure_fn)
    x1 = np.arange(6, dtype=np.float32).reshape(2, 3)
    x2 = x1 + 10.0
    y1, _ = f(x1, model.weights, model.state, jax.random.key(0))
    y2, _ = f(x2, model.weights, model.state, jax.random.key(1))
    assert len(traces) == 1
    u1 = jax.random.uniform(jax.random.split(jax.random.key(1), 4)[2], (2, 3))
    np.testing.assert_allclose(y2, 4 * x2 + u1, rtol=1e-6)
    assert not np.allclose(y1 - 4 * x1, y2 - 4 * x2)
    f(np.ones((5, 3), np.float32), model.weights, model.state, jax.random.key(0))
    assert traces == [(2, 3), (5, 3)]


def test_jitted_and_eager_serial_agree_with_weights():
    model = Serial(Linear(3), RandomScale(), Branch(None, RandomScale()), Add())
    weights, state = model.init(SDS((2, 4), jnp.float32), rng=jax.random.key(9))
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    eager = model.pure_fn(x, weights, state, None)
    jitted = jax.jit(model.pure_fn)(x, weights, state, None)
    assert_trees_close(jitted, eager)
    s1, s2 = np.asarray(weights[1]), np.asarray(weights[2][1])
    np.testing.assert_allclose(eager[0], (x @ np.ones((4, 3))) * s1 * (1 + s2), rtol=1e-5)
