"""Edge cases of revtrain.layers.blocks: drift of a reversible stack without a loss layer."""
import jax
import jax.numpy as jnp
import pytest

from revtrain import layers as tl


def test_reconstruction_error_of_a_reversible_serial_needs_no_loss_layer():
    model = tl.ReversibleSerial(tl.ReversibleHalfResidual(tl.Dense(4), tl.Dropout(0.3)),
                                tl.ReversibleSwap(), tl.ReversibleHalfResidual(tl.Dense(4)))
    keys = jax.random.split(jax.random.key(0), 2)
    x = tuple(jax.random.normal(k, (2, 4)) for k in keys)
    model.init(x, rng=jax.random.key(1))
    errors = tl.reconstruction_error(model, x, jax.random.key(2))
    assert len(errors) == 3
    assert all(0.0 <= e < 1e-5 for e in errors)
    assert errors[0] > 0.0  # float32 drift of the first half-residual is measured
    # As a one-element list of layers too.
    assert tl.reconstruction_error([model], x, jax.random.key(2)) == errors


def test_reconstruction_error_of_nothing_is_a_clear_error():
    with pytest.raises(ValueError, match=r"got no layers"):
        tl.reconstruction_error([], jnp.ones(2), jax.random.key(0))
