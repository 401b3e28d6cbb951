"""Tests of revtrain/training/decoding.py: cached and uncached decoding, sampling."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain import layers as tl
from revtrain.models import ReversibleTransformerLM, TransformerLM
from revtrain.training.decoding import CachedDecoder, Decoder, decode_text, sample_token

SIZES = dict(vocab_size=16, d_model=8, d_ff=16, n_layers=2, n_heads=2, max_len=12,
             dropout=0.1)
MODELS = [functools.partial(ReversibleTransformerLM, **SIZES),
          functools.partial(TransformerLM, **SIZES)]


def _trained_values(model_fn):
    model = model_fn(mode="train")
    model.init(jax.ShapeDtypeStruct((2, 12), jnp.int32), rng=jax.random.key(3))
    return model.weights, model.state


@pytest.mark.parametrize("model_fn", MODELS, ids=["reversible", "plain"])
def test_cached_log_probs_equal_a_full_forward_pass(model_fn):
    weights, state = _trained_values(model_fn)
    tokens = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]], np.int32)
    full, _ = model_fn(mode="eval").pure_fn(tokens, weights, state, jax.random.key(0))
    predict = model_fn(mode="predict")
    _, cache = predict.init(jax.ShapeDtypeStruct((1, 1), jnp.int32))
    for i in range(tokens.shape[1]):
        out, cache = predict.pure_fn(tokens[:, i:i + 1], weights, cache, jax.random.key(0))
        np.testing.assert_allclose(out[0, 0], full[0, i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_fn", MODELS, ids=["reversible", "plain"])
def test_cached_and_uncached_decoders_agree(model_fn):
    weights, state = _trained_values(model_fn)
    cached = CachedDecoder(model_fn(mode="predict"), weights, max_len=12)
    uncached = Decoder(model_fn(mode="eval"), weights, state, length=12)
    prompt = [1, 2, 3]
    assert cached.decode(prompt, 9) == uncached.decode(prompt, 9)
    for kwargs in (dict(temperature=1.0), dict(temperature=0.7, top_k=3),
                   dict(temperature=1.3, top_p=0.8)):
        rng = jax.random.key(5)
        first = cached.decode(prompt, 9, rng=rng, **kwargs)
        assert first == uncached.decode(prompt, 9, rng=rng, **kwargs)
        assert first == cached.decode(prompt, 9, rng=rng, **kwargs)  # Deterministic.
    with pytest.raises(ValueError, match="exceeds the cache of max_len=12"):
        cached.decode(prompt, 10)


def test_temperature_zero_is_argmax_and_filters_restrict_the_choice():
    log_probs = jnp.log(jnp.array([0.1, 0.5, 0.3, 0.1]))
    key = jax.random.key(0)
    assert int(sample_token(log_probs, key)) == 1
    draws = {int(sample_token(log_probs, jax.random.fold_in(key, i), 1.0, 2))
             for i in range(50)}
    assert draws == {1, 2}  # top_k=2
    draws = {int(sample_token(log_probs, jax.random.fold_in(key, i), 1.0, None, 0.5))
             for i in range(20)}
    assert draws == {1}  # The most likely token alone holds 0.5.


def test_uncached_decoder_slides_its_window_and_checks_arguments():
    class NextToken(tl.Layer):
        def forward_with_state(self, x, weights, state, rng):
            return jax.nn.one_hot((x + 1) % 256, 256) * 10.0, state

    decoder = Decoder(NextToken(), (), (), length=4)
    assert decoder.decode([10], 6) == [11, 12, 13, 14, 15, 16]
    assert decode_text(decoder, "a", 3) == ("bcd", [98, 99, 100])
    with pytest.raises(ValueError, match="prompt is empty"):
        decoder.decode([], 3)
    for temperature in (-1, float("inf"), float("nan")):  # inf would sample uniformly.
        with pytest.raises(ValueError, match=f"temperature={temperature} must be a finite "):
            decoder.decode([1], 3, temperature=temperature)
    with pytest.raises(ValueError, match="top_p=0"):
        decoder.decode([1], 3, temperature=1, top_p=0)
    for kwargs in (dict(top_k=2), dict(top_p=0.5)):  # Greedy would ignore them.
        name, value = next(iter(kwargs.items()))
        with pytest.raises(ValueError, match=f"{name}={value} has no effect at "
                                             f"temperature=0 \\(greedy decoding\\)"):
            decoder.decode([1], 3, **kwargs)


def test_default_length_fills_what_the_cache_holds_and_too_much_names_the_fix():
    """The README's decode command gives no --max_new_bytes: a cached decoder continues as
    far as its cache allows (at most 200 bytes); asking for more says how many fit."""
    model_fn = functools.partial(ReversibleTransformerLM, **{**SIZES, "vocab_size": 256})
    weights, state = _trained_values(model_fn)
    cached = CachedDecoder(model_fn(mode="predict"), weights, max_len=12)
    text, tokens = decode_text(cached, "The ", None)
    assert len(tokens) == 12 - 4
    uncached = Decoder(model_fn(mode="eval"), weights, state, length=12)
    assert len(decode_text(uncached, "The ", None)[1]) == 200  # a sliding window: no limit
    with pytest.raises(ValueError, match=r"ask for at most 8 new ones \(--max_new_bytes=8\), "
                                         r"shorten the prompt to at most 3 tokens, or decode "
                                         r"without the cache \(--nocache"):
        decode_text(cached, "The ", 9)
    with pytest.raises(ValueError, match=r"plus 1 new ones exceeds the cache of max_len=12; "
                                         r"shorten the prompt to at most 11 tokens, or"):
        decode_text(cached, "x" * 12, None)  # The prompt alone fills the cache.
