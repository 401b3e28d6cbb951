"""Tests for revtrain.layers.reversible: round trips, fused grads, rng and state handling."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    Dense,
    Dropout,
    Fn,
    Layer,
    LayerError,
    Relu,
    ReversibleHalfResidual,
    ReversibleLayer,
    ReversibleReshape,
    ReversibleSelect,
    ReversibleSerial,
    ReversibleSwap,
    Serial,
    ShapeDtype,
)
from revtrain.layers.normalization import BatchNorm, LayerNorm
from tests.tree_utils import assert_trees_close

BATCH, LENGTH, D = 2, 4, 8


def _x(seed=0, shape=(BATCH, LENGTH, D), n=2):
    keys = jax.random.split(jax.random.key(seed), n)
    items = tuple(jax.random.normal(k, shape) for k in keys)
    return items[0] if n == 1 else items


def _signature(x):
    return jax.tree.map(lambda a: ShapeDtype(a.shape, a.dtype), x)


def _init(layer, x, seed=1):
    return layer.init(_signature(x), jax.random.key(seed))


def _reference_vjp(layer, x, weights, state, rng, ct):
    def f(x, w):
        return layer.pure_fn(x, w, state, rng)[0]

    _, vjp_fn = jax.vjp(f, x, weights)
    return vjp_fn(ct)


def _check_layer(layer, x, rng, atol=1e-5):
    """Round trip and reverse_and_grad == jax.vjp for an initialised reversible layer."""
    weights, state = layer.weights, layer.state
    y, new_state = layer.pure_fn(x, weights, state, rng)
    assert_trees_close(layer.reverse(y, weights, state, new_state, rng), x, atol=atol)
    ct = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype).reshape(a.shape)), y)
    x_rec, grads = layer.reverse_and_grad(y, ct, weights, state, new_state, rng)
    assert_trees_close(x_rec, x, atol=atol)
    assert_trees_close(grads, _reference_vjp(layer, x, weights, state, rng, ct), atol=atol)
    return y, new_state


class _Shift(Layer):
    """Test layer: ``x + state`` with ``new_state = state + step`` (state visible in y)."""

    def __init__(self, step=1.0):
        super().__init__()
        self._step = step

    def forward_with_state(self, x, weights, state, rng):
        return x + state, state + self._step

    def init_weights_and_state(self, input_signature, rng):
        return (), jnp.asarray(0.5, jnp.float32)


class _AddIds(ReversibleLayer):
    """Test layer without a fused grad: ``(x, ids) -> (x + w * ids, ids)``."""

    def __init__(self):
        super().__init__(n_in=2, n_out=2)

    def forward_with_state(self, x, weights, state, rng):
        return (x[0] + weights * x[1][..., None], x[1]), state

    def reverse(self, output, weights, state, new_state, rng):
        return (output[0] - weights * output[1][..., None], output[1])

    def init_weights_and_state(self, input_signature, rng):
        return jnp.asarray(0.3, jnp.float32), ()


def test_select_must_be_a_permutation():
    with pytest.raises(ValueError, match="not a permutation"):
        ReversibleSelect([0, 0])
    with pytest.raises(ValueError, match="not a permutation"):
        ReversibleSelect([1, 2])


@pytest.mark.parametrize("layer", [ReversibleSelect([2, 0, 1]), ReversibleSwap(),
                                   ReversibleReshape((LENGTH * D,), (LENGTH, D), n_in=3)],
                         ids=["select", "swap", "reshape"])
def test_stack_layers_round_trip_and_grad(layer):
    x = _x(n=layer.n_in)
    _init(layer, x)
    y, _ = _check_layer(layer, x, jax.random.key(0))
    if isinstance(layer, ReversibleReshape):
        assert y[0].shape == (BATCH, LENGTH * D)
    else:
        expected = tuple(x[i] for i in layer._indices)
        assert_trees_close(y, expected)


def test_half_residual_adds_f_and_reverses_with_dropout():
    layer = ReversibleHalfResidual(LayerNorm(), Dense(D), Relu(), Dropout(0.5))
    x = _x()
    _init(layer, x)
    rng = jax.random.key(3)
    y, _ = _check_layer(layer, x, rng)
    f = Serial(LayerNorm(), Dense(D), Relu(), Dropout(0.5))
    f_out, _ = f.pure_fn(x[1], layer.weights[0], layer.state[0], jax.random.split(rng, 2)[0])
    assert_trees_close(y, (x[0] + f_out, x[1]))
    assert float(jnp.mean(f_out == 0.0)) > 0.3  # dropout really dropped
    other, _ = layer.pure_fn(x, layer.weights, layer.state, jax.random.key(4))
    assert not np.allclose(other[0], y[0])  # a different rng gives a different mask


def test_half_residual_weights_are_compute_then_attention():
    layer = ReversibleHalfResidual(Dense(D), attention_layer=Dense(D))
    _init(layer, _x())
    assert len(layer.weights) == 2 and len(layer.sublayers) == 2
    assert layer.weights[0][0][0].shape == (D, D)  # Serial(Dense) -> (dense_weights,)
    plain = ReversibleHalfResidual(Dense(D))
    _init(plain, _x())
    assert plain.weights[1] == ()
    assert plain.structure_key == ReversibleHalfResidual(Dense(D)).structure_key is not None


def test_half_residual_rejects_layers_leaving_two_items():
    with pytest.raises(ValueError, match="exactly one"):
        ReversibleHalfResidual(Fn("Two", lambda a: (a, a), n_out=2))


def test_half_residual_reverse_uses_old_compute_state_and_new_attention_state():
    layer = ReversibleHalfResidual(_Shift(1.0), attention_layer=_Shift(10.0))
    x = _x()
    _init(layer, x)
    old = layer.state
    y, new = layer.pure_fn(x, layer.weights, old, None)
    assert_trees_close(new, ((old[0][0] + 1.0,), old[1] + 10.0))
    assert_trees_close(y[0], x[0] + x[1] + 1.0)  # 0.5 + 0.5 from the old states
    # Reconstruction runs f with (old compute state, new attention state): f = x2 + 11.
    expected = (y[0] - (x[1] + 0.5 + 10.5), x[1])
    assert_trees_close(layer.reverse(y, layer.weights, old, new, None), expected)
    x_rec, _ = layer.reverse_and_grad(y, y, layer.weights, old, new, None)
    assert_trees_close(x_rec, expected)


def test_half_residual_with_several_context_items_and_attention_layer():
    add = Fn("Add", lambda a, b: a * b)
    layer = ReversibleHalfResidual(add, Dense(D), attention_layer=Dense(D))
    assert layer.n_in == layer.n_out == 3
    x = _x(n=3)
    _init(layer, x)
    _check_layer(layer, x, jax.random.key(0))


def test_half_residual_keeps_residual_stream_dtype():
    cast = Fn("ToBf16", lambda a: a.astype(jnp.bfloat16))
    layer = ReversibleHalfResidual(cast, Dense(D))
    x = _x()
    _init(layer, x)
    y, _ = layer.pure_fn(x, layer.weights, layer.state, None)
    assert y[0].dtype == jnp.float32 and y[1].dtype == jnp.float32


def test_default_reverse_and_grad_gives_float0_for_integer_inputs():
    layer = _AddIds()
    x = (_x(n=1), jnp.arange(BATCH * LENGTH, dtype=jnp.int32).reshape(BATCH, LENGTH))
    _init(layer, x)
    y, _ = layer.pure_fn(x, layer.weights, (), None)
    ct = (jnp.ones_like(y[0]), np.zeros(y[1].shape, jax.dtypes.float0))
    x_rec, (x_ct, w_ct) = layer.reverse_and_grad(y, ct, layer.weights, (), (), None)
    assert_trees_close(x_rec[0], x[0], atol=1e-5)
    assert x_ct[1].dtype == jax.dtypes.float0
    assert_trees_close(w_ct, jnp.sum(x[1]).astype(jnp.float32) * D)


def _block(rate=0.25, mode="train"):
    """One RevNet-style block with dropout and BatchNorm inside."""
    return [ReversibleHalfResidual(LayerNorm(), Dense(D), Dropout(rate, mode=mode)),
            ReversibleSwap(),
            ReversibleHalfResidual(BatchNorm(axis=(0, 1), mode=mode), Dense(D), Relu()),
            ReversibleSwap()]


def test_serial_rejects_non_reversible_sublayer_naming_it():
    with pytest.raises(TypeError, match="sublayer 1 \\(Dense"):
        ReversibleSerial(ReversibleSwap(), Dense(D))


def test_serial_round_trip_grad_and_rng_split_match_serial():
    layer = ReversibleSerial(_block(), _block())
    x = _x()
    _init(layer, x)
    rng = jax.random.key(7)
    y, new_state = _check_layer(layer, x, rng)
    plain = Serial(*layer.sublayers)
    y_plain, state_plain = plain.pure_fn(x, layer.weights, layer.state, rng)
    assert_trees_close(y, y_plain)
    assert_trees_close(new_state, state_plain)


def test_serial_batchnorm_state_updated_once():
    layer = ReversibleSerial(_block())
    x = _x()
    _init(layer, x)
    old = layer.state
    y = layer(x)  # forward stores the new state in the layer
    new = layer.state
    bn_old, bn_new = old[2][0][0], new[2][0][0]
    assert int(bn_old[2]) == 0 and int(bn_new[2]) == 1
    assert not np.allclose(bn_old[0], bn_new[0])
    x_rec, _ = layer.reverse_and_grad(y, y, layer.weights, old, new, layer.rng)
    assert_trees_close(x_rec, x, atol=1e-5)
    assert int(layer.state[2][0][0][2]) == 1  # reversal did not touch the state


def test_serial_eval_batchnorm_reverses_with_old_state():
    """In eval mode BatchNorm normalises with the moving statistics held in the old state."""
    layer = ReversibleSerial(_block(mode="eval"))
    x = _x()
    _init(layer, x)
    stats = (jnp.full((D,), 0.3), jnp.full((D,), 2.0), jnp.asarray(5, jnp.int32))
    state = list(layer.state)
    state[2] = ((stats, (), ()), ())
    state = tuple(state)
    _check_layer(layer, x, jax.random.key(0))
    y, new_state = layer.pure_fn(x, layer.weights, state, None)
    assert_trees_close(layer.reverse(y, layer.weights, state, new_state, None), x, atol=1e-5)


def test_serial_passes_each_sublayer_its_own_old_and_new_state():
    layer = ReversibleSerial(ReversibleHalfResidual(_Shift(1.0)), ReversibleSwap(),
                             ReversibleHalfResidual(_Shift(2.0)))
    x = _x()
    _init(layer, x)
    y, new_state = _check_layer(layer, x, None)
    assert float(new_state[0][0][0]) == 1.5 and float(new_state[2][0][0]) == 2.5


def test_nested_serial_and_jit():
    layer = ReversibleSerial(ReversibleSerial(_block()), _block())
    x = _x()
    _init(layer, x)
    rng = jax.random.key(2)
    y, new_state = layer.pure_fn(x, layer.weights, layer.state, rng)
    reverse = jax.jit(layer.reverse_and_grad)
    x_rec, grads = reverse(y, y, layer.weights, layer.state, new_state, rng)
    assert_trees_close(x_rec, x, atol=1e-5)
    assert_trees_close(grads, _reference_vjp(layer, x, layer.weights, layer.state, rng, y),
                       atol=1e-5)


# --------------------------------------------------------------------------------------
# Edge cases.


X = (jnp.ones((2, 4)), jnp.arange(8.0).reshape(2, 4))


def _forward(layer):
    layer.init(X, rng=jax.random.key(0))
    y, new_state = layer.pure_fn(X, layer.weights, layer.state, None)
    return y, new_state


def _half_residual():
    return ReversibleHalfResidual(Dense(4))


def _serial():
    return ReversibleSerial(ReversibleHalfResidual(Dense(4)), ReversibleSwap())


@pytest.mark.parametrize("make", [_half_residual, _serial, ReversibleSwap])
def test_reverse_of_one_item_names_layer_and_expected_items(make):
    layer = make()
    y, new_state = _forward(layer)
    name = layer.name
    with pytest.raises(LayerError, match=rf"{name}.reverse .*{name} expects 2 output "
                                         rf"items but got 1"):
        layer.reverse(y[0], layer.weights, layer.state, new_state, None)
    with pytest.raises(LayerError, match=rf"{name}.reverse_and_grad .*{name} expects 2 "
                                         rf"ct items but got 3"):
        layer.reverse_and_grad(y, (y[0], y[1], y[0]), layer.weights, layer.state, new_state,
                               None)


def test_reverse_error_names_where_the_layer_was_created():
    layer = _half_residual()
    y, new_state = _forward(layer)
    with pytest.raises(LayerError, match=r"layer created at .*test_reversible.py"):
        layer.reverse((y[0],) * 3, layer.weights, layer.state, new_state, None)


@pytest.mark.parametrize("make", [_half_residual, _serial])
def test_reverse_with_wrong_state_or_weights_names_the_tree(make):
    layer = make()
    y, new_state = _forward(layer)
    with pytest.raises(LayerError, match=r"expects 2 new_state \(one per sublayer\) but got 0"):
        layer.reverse(y, layer.weights, layer.state, (), None)
    with pytest.raises(LayerError, match=r"expects 2 state .* but got a NoneType"):
        layer.reverse_and_grad(y, y, layer.weights, None, new_state, None)
    with pytest.raises(LayerError, match=r"expects 2 weights \(one per sublayer\) but got 1"):
        layer.reverse(y, layer.weights[:1], layer.state, new_state, None)


def test_reshape_reverse_with_wrong_ct_is_a_layer_error():
    layer = ReversibleReshape((8,), (2, 4))
    y = jnp.ones((3, 8))
    with pytest.raises(LayerError, match=r"ReversibleReshape expects 1 ct items but got 2"):
        layer.reverse_and_grad(y, (y, y), (), (), (), None)
    np.testing.assert_array_equal(layer.reverse(y, (), (), (), None), jnp.ones((3, 2, 4)))


def test_subclass_reverse_errors_are_layer_errors_and_correct_results_pass_through():
    class Negate(ReversibleLayer):
        def forward_with_state(self, x, weights, state, rng):
            return -x, state

        def reverse(self, output, weights, state, new_state, rng):
            if output.ndim != 2:
                raise ValueError("Negate wants rank 2")
            return -output

    layer = Negate()
    with pytest.raises(LayerError, match=r"Negate.reverse .*Negate wants rank 2"):
        layer.reverse(jnp.ones(3), (), (), (), None)
    # The default reverse_and_grad goes through the wrapped reverse and is correct.
    x, (ct_x, ct_w) = layer.reverse_and_grad(-X[1], jnp.ones((2, 4)), (), (), (), None)
    np.testing.assert_array_equal(x, X[1])
    np.testing.assert_array_equal(ct_x, -jnp.ones((2, 4)))
    with pytest.raises(LayerError, match=r"Negate.reverse_and_grad"):
        layer.reverse_and_grad(-X[1], jnp.ones((5,)), (), (), (), None)
