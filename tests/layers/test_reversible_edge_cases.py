"""Edge cases of revtrain.layers.reversible: reverse asked with the wrong structure."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    Dense,
    LayerError,
    ReversibleHalfResidual,
    ReversibleLayer,
    ReversibleReshape,
    ReversibleSerial,
    ReversibleSwap,
)

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
    with pytest.raises(LayerError, match=r"layer created at .*test_reversible_edge_cases.py"):
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
