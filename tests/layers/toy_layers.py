"""Small layers the layer tests share (a helpers module, not a test file)."""
import jax
import jax.numpy as jnp

from revtrain.layers import Layer
from revtrain.layers.layer import EMPTY


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
