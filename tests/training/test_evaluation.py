"""Tests of revtrain/training/evaluation.py and decoding.py."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain import layers as tl
from revtrain.training import Evaluator, bits_per_byte
from revtrain.training.decoding import Decoder, decode_text


class _FixedLogits(tl.Layer):
    """Ignores its input values; returns logits that favour ``token + 1``."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self._vocab_size = vocab_size

    def forward_with_state(self, x, weights, state, rng):
        return jax.nn.one_hot((x + 1) % self._vocab_size, self._vocab_size) * 10.0, state


def _batch(tokens, mask):
    tokens = np.asarray(tokens, np.int32)
    return tokens, (tokens + 1) % 8, np.asarray(mask, np.float32)


def test_evaluator_weights_batches_by_their_total_weight():
    evaluator = Evaluator(_FixedLogits(8), {"accuracy": tl.Accuracy()})
    right = _batch([[1, 2, 3, 4]], [[1, 1, 1, 1]])
    wrong = (right[0], right[1] * 0 + 7, np.asarray([[1, 0, 0, 0]], np.float32))
    metrics = evaluator.evaluate((), (), [right, wrong])
    assert metrics["accuracy"] == pytest.approx(4 / 5)


def test_evaluator_bits_per_byte_and_empty_error():
    evaluator = Evaluator(_FixedLogits(8), {"loss": tl.WeightedCategoryCrossEntropy()},
                          byte_lm=True)
    metrics = evaluator.evaluate((), (), [_batch([[0, 1]], [[1, 1]])])
    assert metrics["bits_per_byte"] == pytest.approx(metrics["loss"] / math.log(2))
    assert bits_per_byte(math.log(2)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="0 batches"):
        evaluator.evaluate((), (), [])


def test_greedy_decoder_follows_the_model_and_slides_its_window():
    decoder = Decoder(_FixedLogits(256), length=4)
    assert decoder.decode([10], 6) == [11, 12, 13, 14, 15, 16]
    assert decode_text(decoder, "a", 3) == "bcd"


def test_sampling_is_seeded_and_decoder_checks_arguments():
    model = tl.Serial(tl.Embedding(8, 4), tl.Dense(8))
    model.init(jax.ShapeDtypeStruct((1, 4), jnp.int32))
    decoder = Decoder(model, length=4)
    first = decoder.decode([1], 5, temperature=1.0, rng=jax.random.key(1))
    assert first == decoder.decode([1], 5, temperature=1.0, rng=jax.random.key(1))
    assert all(0 <= t < 8 for t in first)
    with pytest.raises(ValueError, match="prompt is empty"):
        decoder.decode([], 3)
    with pytest.raises(ValueError, match="temperature=-1"):
        decoder.decode([1], 3, temperature=-1)


def test_eval_and_decode_functions_compile_once():
    evaluator = Evaluator(_FixedLogits(8), {"accuracy": tl.Accuracy()})
    for _ in range(3):
        evaluator.evaluate((), (), [_batch([[1, 2]], [[1, 1]]), _batch([[3, 4]], [[1, 0]])])
    assert evaluator._batch_sums._cache_size() == 1
    decoder = Decoder(_FixedLogits(256), length=3)
    decoder.decode([1, 2], 5)  # Positions 1, 2, then a full sliding window.
    assert decoder._next_logits._cache_size() == 1
