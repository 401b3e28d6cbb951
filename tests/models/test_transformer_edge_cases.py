"""Edge cases of revtrain.models.transformer: bad n_layers / compute_dtype, tiny shapes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.models import ReversibleTransformerLM, TransformerLM


@pytest.mark.parametrize("make", [ReversibleTransformerLM, TransformerLM])
@pytest.mark.parametrize("kwargs,message", [
    ({"n_layers": -1}, r"n_layers=-1 must be >= 0"),
    ({"compute_dtype": "int8"}, r"compute_dtype=int8 is not a float dtype"),
    ({"compute_dtype": "bflaot16"}, r"compute_dtype='bflaot16' is not a dtype"),
])
def test_bad_arguments_are_rejected_naming_them(make, kwargs, message):
    args = dict(vocab_size=4, d_model=4, d_ff=8, n_layers=1, n_heads=2, max_len=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        make(**args)


@pytest.mark.parametrize("make", [ReversibleTransformerLM, TransformerLM])
def test_vocab_one_length_one_batch_one(make):
    model = make(vocab_size=1, d_model=4, d_ff=8, n_layers=1, n_heads=2, max_len=4,
                 dropout=0.0)
    tokens = np.zeros((1, 1), np.int32)
    model.init(tokens, rng=jax.random.key(0))
    log_probs = model(tokens)
    assert log_probs.shape == (1, 1, 1)
    np.testing.assert_allclose(log_probs, 0.0, atol=1e-6)  # one class: probability 1


def test_zero_layers_is_embedding_then_head():
    model = ReversibleTransformerLM(vocab_size=3, d_model=4, d_ff=8, n_layers=0, n_heads=2,
                                    max_len=4, dropout=0.0)
    tokens = np.array([[0, 1, 2]], np.int32)
    model.init(tokens, rng=jax.random.key(0))
    y = model(tokens)
    assert y.shape == (1, 3, 3)
    np.testing.assert_allclose(jnp.exp(y).sum(-1), 1.0, rtol=1e-5)
