"""Tests for revtrain.layers.chunked_loss and the chunked metric layers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import Accuracy, CrossEntropyLoss, WeightedCategoryCrossEntropy
from revtrain.layers.chunked_loss import AUTO_CHUNK_ELEMENTS, chunk_count

B, S, V = 3, 8, 11


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, S, V)).astype(np.float32) * 3
    targets = rng.integers(0, V, size=(B, S)).astype(np.int32)
    weights = (rng.random((B, S)) > 0.3).astype(np.float32)
    targets[0, 0], weights[0, 0] = -1, 0.0  # an out-of-range pad id of weight 0
    return logits, targets, weights


def _value_and_grad(layer, logits, targets, weights):
    return jax.jit(jax.value_and_grad(
        lambda x: layer.pure_fn((x, targets, weights), (), (), None)[0]))(logits)


@pytest.mark.parametrize("make", [
    lambda n: WeightedCategoryCrossEntropy(n_chunks=n),
    lambda n: WeightedCategoryCrossEntropy(label_smoothing=0.1, n_chunks=n),
    lambda n: CrossEntropyLoss(n_chunks=n)])
@pytest.mark.parametrize("n_chunks", [5, 24])
def test_chunked_loss_and_gradient_equal_the_unchunked(make, n_chunks):
    logits, targets, weights = _inputs()
    if isinstance(make(1), CrossEntropyLoss):
        logits = np.asarray(jax.nn.log_softmax(logits))
    loss1, grad1 = _value_and_grad(make(1), logits, targets, weights)
    loss, grad = _value_and_grad(make(n_chunks), logits, targets, weights)
    assert np.isfinite(float(loss1))
    np.testing.assert_allclose(loss, loss1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, grad1, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(grad)[0, 0] == 0)  # the weight-0 position gets no gradient


def test_chunked_accuracy_equals_the_unchunked():
    logits, targets, weights = _inputs(1)
    full = Accuracy(n_chunks=1).pure_fn((logits, targets, weights), (), (), None)[0]
    assert 0 < float(full) < 1
    for n in (2, 3, 8):
        np.testing.assert_allclose(
            Accuracy(n_chunks=n).pure_fn((logits, targets, weights), (), (), None)[0], full,
            rtol=1e-6)


def test_all_padding_gives_zero_and_weights_broadcast():
    logits, targets, _ = _inputs()
    layer = WeightedCategoryCrossEntropy(n_chunks=4)
    assert float(layer.pure_fn((logits, targets, np.zeros((B, S), np.float32)), (), (),
                               None)[0]) == 0.0
    ones = layer.pure_fn((logits, np.maximum(targets, 0), np.float32(1.0)), (), (), None)[0]
    full = layer.pure_fn((logits, np.maximum(targets, 0), np.ones((B, S), np.float32)), (),
                         (), None)[0]
    np.testing.assert_allclose(ones, full, rtol=1e-6)


def test_chunk_count():
    assert chunk_count(2048, 256, None) == 1  # a byte-level model stays unchunked
    assert chunk_count(2048, 32000, None) == 16
    assert chunk_count(2048, 32000, None) * AUTO_CHUNK_ELEMENTS >= 2048 * 32000
    assert chunk_count(24, 5, 5) == 4  # lowered to a divisor of the positions
    assert chunk_count(7, 5, 100) == 7
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="n_chunks"):
            chunk_count(8, 8, bad)
    with pytest.raises(ValueError, match="n_chunks=0"):
        WeightedCategoryCrossEntropy(n_chunks=0)


def test_jitted_chunked_loss_does_not_recompile():
    traces = []
    layer = WeightedCategoryCrossEntropy(n_chunks=4)

    def loss(x, t, w):
        traces.append(x.shape)
        return layer.pure_fn((x, t, w), (), (), None)[0]

    f = jax.jit(jax.value_and_grad(loss))
    logits, targets, weights = _inputs()
    first = f(logits, targets, weights)
    second = f(logits + 1.0, (targets + 1) % V, weights)
    assert len(traces) == 1 and float(first[0]) != float(second[0])


def _peak_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.temp_size_in_bytes + m.output_size_in_bytes + m.argument_size_in_bytes
            - m.alias_size_in_bytes)


def test_chunking_lowers_the_loss_steps_peak_over_given_logits():
    b, s, v = 4, 64, 2048
    sig = (jax.ShapeDtypeStruct((b, s, v), jnp.float32), jax.ShapeDtypeStruct((b, s), jnp.int32),
           jax.ShapeDtypeStruct((b, s), jnp.float32))
    logits_bytes = b * s * v * 4

    def peak(n):
        layer = WeightedCategoryCrossEntropy(n_chunks=n)
        step = jax.jit(jax.value_and_grad(lambda *x: layer.pure_fn(x, (), (), None)[0]))
        return _peak_bytes(step.lower(*sig).compile()) / logits_bytes

    unchunked, chunked = peak(1), peak(8)
    # Input and its gradient are 2 buffers; unchunked keeps about 2 more.
    assert chunked < unchunked - 1.0
    assert chunked < 2.5
