"""Tests for revtrain.layers.attention.rotary: RoPE makes attention scores depend on relative
positions only, and leaves position 0 unchanged."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import rotary_embedding
from revtrain.layers.attention.rotary import check_rotary_head_size


def test_scores_depend_only_on_the_offset():
    q = jax.random.normal(jax.random.key(0), (1, 1, 2, 16))
    k = jax.random.normal(jax.random.key(1), (1, 1, 2, 16))

    def score(m, n):
        qm = rotary_embedding(q, jnp.array([m]))
        kn = rotary_embedding(k, jnp.array([n]))
        return jnp.sum(qm * kn, axis=-1)

    np.testing.assert_allclose(score(3, 1), score(103, 101), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(score(7, 7), score(0, 0), rtol=1e-5, atol=1e-5)
    assert not np.allclose(score(3, 1), score(1, 3), atol=1e-3)


def test_position_zero_is_the_identity_and_norms_are_kept():
    x = jax.random.normal(jax.random.key(2), (2, 5, 3, 8))
    y = rotary_embedding(x, jnp.arange(5))
    np.testing.assert_allclose(y[:, 0], x[:, 0], rtol=1e-6)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    assert rotary_embedding(x.astype(jnp.bfloat16), jnp.arange(5)).dtype == jnp.bfloat16


def test_odd_head_size_is_refused():
    with pytest.raises(ValueError, match="d_head=7 is odd"):
        check_rotary_head_size(7, "CausalAttention")
