"""Tests for revtrain.layers.fn: Fn and PureLayer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    Fn,
    LayerError,
    PureLayer,
)

SDS = jax.ShapeDtypeStruct




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


def test_pure_layer_passes_the_rng_and_the_stack_items():
    def f(x, rng):
        a, b = x
        return a + b, a * jax.random.uniform(rng, a.shape)

    layer = PureLayer(f, n_in=2, n_out=2, name="Mix")
    a, b = jnp.ones(3), 2 * jnp.ones(3)
    rng = jax.random.key(4)
    (s, m), state = layer.pure_fn((a, b), (), (), rng)
    np.testing.assert_allclose(s, 3 * np.ones(3))
    np.testing.assert_allclose(m, jax.random.uniform(rng, (3,)))
    assert state == () and layer.name == "Mix" and (layer.n_in, layer.n_out) == (2, 2)
