"""Edge cases of revtrain.layers.base: reused layer objects, wrong numbers of stack items."""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    Dense,
    Dropout,
    LayerError,
    Parallel,
    Relu,
    Residual,
    ReversibleHalfResidual,
    ReversibleSerial,
    ReversibleSwap,
    Serial,
)
from revtrain.layers.normalization import BatchNorm

X = np.ones((2, 3), np.float32)


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
    with pytest.raises(ValueError, match=r"Dense \(created at .*test_base_edge_cases.py:"
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
    model.init(X, rng=jax.random.key(0))
    y = model.pure_fn(X, model.weights, model.state, jax.random.key(1))[0]
    assert y.shape == (2, 3)
    rev = ReversibleSerial(swap, swap)
    out, _ = rev.pure_fn((X, 2 * X), rev.weights, rev.state, None)
    np.testing.assert_array_equal(out[0], X)


def test_leaf_given_two_items_is_a_clear_layer_error_in_init_and_pure_fn():
    layer = Dense(3)
    with pytest.raises(LayerError, match=r"Dense.init .*Dense expects 1 inputs but got 2"):
        layer.init((X, X))
    layer.init(X)
    with pytest.raises(LayerError, match=r"Dense.pure_fn .*Dense expects 1 inputs but got 2"):
        layer.pure_fn((X, X), layer.weights, layer.state, None)
    assert layer(jnp.asarray(X)).shape == (2, 3)
