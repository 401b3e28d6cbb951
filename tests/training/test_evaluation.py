"""Tests of revtrain/training/evaluation.py: weighted, sharded, exact-pass evaluation."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain import layers as tl
from revtrain.data import StreamInputs
from revtrain.training import Evaluator, bits_per_byte
from revtrain.training.evaluation import eval_batches


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
    evaluator = Evaluator(_FixedLogits(8), {"accuracy": tl.Accuracy()}, n_devices=1)
    right = _batch([[1, 2, 3, 4]], [[1, 1, 1, 1]])
    wrong = (right[0], right[1] * 0 + 7, np.asarray([[1, 0, 0, 0]], np.float32))
    metrics = evaluator.evaluate((), (), [right, wrong])
    assert metrics["accuracy"] == pytest.approx(4 / 5)


def test_evaluator_bits_per_byte_and_empty_error():
    evaluator = Evaluator(_FixedLogits(8), {"loss": tl.WeightedCategoryCrossEntropy()},
                          byte_level=True, n_devices=1)
    metrics = evaluator.evaluate((), (), [_batch([[0, 1]], [[1, 1]])])
    assert metrics["bits_per_byte"] == pytest.approx(metrics["loss"] / math.log(2))
    assert bits_per_byte(math.log(2)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="0 batches"):
        evaluator.evaluate((), (), [])


def _ten_examples(batch_size):
    """A finite split of 10 examples: example i has token i and is right iff i is even."""
    tokens = np.arange(10, dtype=np.int32)[:, None] % 8
    targets = ((tokens[:, 0] + np.where(np.arange(10) % 2 == 0, 1, 2)) % 8)[:, None]

    def one_pass():
        for start in range(0, 10, batch_size):
            rows = slice(start, start + batch_size)
            n = len(tokens[rows])
            pad = batch_size - n
            yield (np.pad(tokens[rows], ((0, pad), (0, 0))),
                   np.pad(targets[rows].astype(np.int32), ((0, pad), (0, 0))),
                   np.pad(np.ones((n, 1), np.float32), ((0, pad), (0, 0))))
    return StreamInputs(lambda start=0: iter(()), eval_pass=one_pass)


@pytest.mark.parametrize("n_devices", [1, 4])
def test_one_exact_pass_counts_each_example_once(n_devices):
    """10 examples in batches of 4: the last batch has 2 padding rows, masked out."""
    inputs = _ten_examples(batch_size=4)
    assert [b[0].shape[0] for b in eval_batches(inputs, None)] == [4, 4, 4]
    evaluator = Evaluator(_FixedLogits(8), {"accuracy": tl.Accuracy()}, n_devices=n_devices)
    metrics = evaluator.evaluate((), (), eval_batches(inputs, None))
    assert metrics["accuracy"] == pytest.approx(5 / 10)  # Not 5/12 or 7/12 (padding).


def test_sharded_evaluation_does_not_depend_on_the_device_count():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 8, (8, 3)).astype(np.int32)
    mask = (rng.random((8, 3)) < 0.5).astype(np.float32)
    mask[:2] = 0  # Devices with no weight at all must count nothing.
    batch = (tokens, rng.integers(0, 8, (8, 3)).astype(np.int32), mask)
    model = tl.Serial(tl.Embedding(8, 4), tl.Dense(8), tl.LogSoftmax())
    model.init(jax.ShapeDtypeStruct((8, 3), jnp.int32))
    results = [Evaluator(model, {"loss": tl.WeightedCategoryCrossEntropy()}, n_devices=n)
               .evaluate(model.weights, model.state, [batch]) for n in (1, 2, 4)]
    for other in results[1:]:
        assert other["loss"] == pytest.approx(results[0]["loss"], rel=1e-6)


def test_exact_pass_of_endless_data_is_an_error():
    inputs = StreamInputs(lambda start=0: iter(()))
    with pytest.raises(ValueError, match="eval data has no end.*set EvalConfig.steps"):
        next(eval_batches(inputs, None))


def test_evaluation_compiles_once():
    evaluator = Evaluator(_FixedLogits(8), {"accuracy": tl.Accuracy()}, n_devices=2)
    for _ in range(3):
        evaluator.evaluate((), (), [_batch([[1, 2], [3, 4]], [[1, 1], [1, 0]])])
    assert evaluator._batch_sums._cache_size() == 1


def test_evaluation_puts_the_weights_on_the_devices_once_not_per_batch():
    model = tl.Serial(tl.Embedding(8, 4), tl.Dense(8))
    model.init(jax.ShapeDtypeStruct((2, 4), jnp.int32))
    evaluator = Evaluator(model, {"loss": tl.WeightedCategoryCrossEntropy()}, n_devices=2)
    weights = jax.tree.map(np.asarray, model.weights)  # Host values, as a checkpoint's.
    batches = [_batch([[1, 2, 3, 4], [5, 6, 7, 0]], np.ones((2, 4)))] * 3
    state = jax.tree.map(np.asarray, model.state)
    expected = evaluator.evaluate(weights, state, batches)
    with jax.transfer_guard_host_to_device("disallow"):  # Explicit puts only.
        assert evaluator.evaluate(weights, state, batches) == expected


def test_bits_per_byte_with_token_bytes_divides_by_the_bytes_of_the_scored_text():
    """Subword tokens: the summed loss over the UTF-8 bytes the scored targets stand for."""
    token_bytes = np.arange(1, 9, dtype=np.int32)  # Token t stands for t + 1 bytes.
    loss = tl.WeightedCategoryCrossEntropy()
    evaluator = Evaluator(_FixedLogits(8), {"loss": loss}, n_devices=1,
                          token_bytes=token_bytes)
    first = _batch([[0, 1, 2]], [[1, 1, 0]])  # Targets 1, 2 scored (2 + 3 bytes).
    second = (np.asarray([[5, 6, 7]], np.int32), np.asarray([[3, 3, 3]], np.int32),
              np.asarray([[1, 0, 0]], np.float32))  # Target 3 scored, mispredicted.
    metrics = evaluator.evaluate((), (), [first, second])
    right = -jax.nn.log_softmax(jnp.eye(8)[1] * 10.0)[1]
    wrong = -jax.nn.log_softmax(jnp.eye(8)[6] * 10.0)[3]
    total_nats, n_bytes = 2 * float(right) + float(wrong), 2 + 3 + 4
    assert metrics["loss"] == pytest.approx(total_nats / 3, rel=1e-5)
    assert metrics["bits_per_byte"] == pytest.approx(total_nats / n_bytes / math.log(2),
                                                     rel=1e-5)
    assert bits_per_byte(metrics["loss"], 3 / n_bytes) == pytest.approx(
        metrics["bits_per_byte"])
    # Bytes as tokens: token_bytes is ignored and the figure is loss / ln 2, as before.
    by_bytes = Evaluator(_FixedLogits(8), {"loss": loss}, byte_level=True, n_devices=1,
                         token_bytes=token_bytes).evaluate((), (), [first, second])
    assert by_bytes["bits_per_byte"] == bits_per_byte(by_bytes["loss"])
    with pytest.raises(ValueError, match="bits per byte needs a 'loss' metric"):
        Evaluator(_FixedLogits(8), {"accuracy": tl.Accuracy()}, token_bytes=token_bytes)
