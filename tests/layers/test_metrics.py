"""Tests for revtrain.layers.metrics: losses and accuracy vs hand-computed values."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    Accuracy,
    CrossEntropyLoss,
    L2Loss,
    LayerError,
    WeightedCategoryCrossEntropy,
    weighted_mean,
)

# Two sequences of two positions over a vocabulary of 3.


PROBS = np.array([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]],
                  [[0.25, 0.5, 0.25], [0.3, 0.3, 0.4]]], np.float32)
TARGETS = np.array([[0, 1], [1, 2]], np.int32)
WEIGHTS = np.array([[1.0, 1.0], [1.0, 0.0]], np.float32)


def _run(layer, *inputs):
    y, state = layer.pure_fn(tuple(inputs), (), (), None)
    assert state == () and y.shape == () and y.dtype == jnp.float32
    return float(y)


def test_cross_entropy_is_weighted_mean_nll_with_masking():
    loss = _run(CrossEntropyLoss(), np.log(PROBS), TARGETS, WEIGHTS)
    expected = -(math.log(0.7) + math.log(0.1) + math.log(0.5)) / 3
    assert loss == pytest.approx(expected, rel=1e-6)
    # Masked position (weight 0) does not matter even if its log-prob is -inf.
    log_probs = np.log(PROBS).copy()
    log_probs[1, 1, 2] = -np.inf
    assert _run(CrossEntropyLoss(), log_probs, TARGETS, WEIGHTS) == pytest.approx(expected)


def test_cross_entropy_non_uniform_weights():
    weights = np.array([[2.0, 0.0], [1.0, 1.0]], np.float32)
    expected = -(2 * math.log(0.7) + math.log(0.5) + math.log(0.4)) / 4
    loss = _run(CrossEntropyLoss(), np.log(PROBS), TARGETS, weights)
    assert loss == pytest.approx(expected, rel=1e-6)


def test_all_zero_weights_give_zero_not_nan():
    zeros = np.zeros_like(WEIGHTS)
    for layer in (CrossEntropyLoss(), WeightedCategoryCrossEntropy(), Accuracy()):
        assert _run(layer, np.log(PROBS), TARGETS, zeros) == 0.0
    grad = jax.grad(lambda lp: CrossEntropyLoss().pure_fn((lp, TARGETS, zeros), (), (),
                                                          None)[0])(np.log(PROBS))
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad) == 0)


def test_weighted_category_cross_entropy_from_logits():
    logits = np.log(PROBS) + np.array([3.0, -1.0], np.float32)[:, None, None]  # shift/row
    loss = _run(WeightedCategoryCrossEntropy(), logits, TARGETS, WEIGHTS)
    assert loss == pytest.approx(-(math.log(0.7) + math.log(0.1) + math.log(0.5)) / 3,
                                 rel=1e-5)
    loss_bf16 = _run(WeightedCategoryCrossEntropy(), jnp.asarray(logits, jnp.bfloat16),
                     TARGETS, WEIGHTS)
    assert loss_bf16 == pytest.approx(loss, rel=2e-2)


def test_label_smoothing_mixes_in_uniform_targets():
    s = 0.3
    loss = _run(WeightedCategoryCrossEntropy(label_smoothing=s), np.log(PROBS), TARGETS,
                WEIGHTS)
    expected = 0.0
    for b, t in [(0, 0), (0, 1), (1, 0)]:
        q = np.full(3, s / 3)
        q[TARGETS[b, t]] += 1 - s
        expected -= np.sum(q * np.log(PROBS[b, t])) / 3
    assert loss == pytest.approx(expected, rel=1e-5)


def test_accuracy_weighted():
    # argmax: [[0, 2], [1, 2]] vs targets [[0, 1], [1, 2]]: right, wrong, right, (masked).
    assert _run(Accuracy(), PROBS, TARGETS, WEIGHTS) == pytest.approx(2 / 3)
    assert _run(Accuracy(), PROBS, TARGETS, np.ones_like(WEIGHTS)) == pytest.approx(3 / 4)


def test_l2_loss_weighted_mean_squared_error():
    p = np.array([[1.0, 2.0], [3.0, 5.0]], np.float32)
    t = np.array([[0.0, 2.0], [1.0, 0.0]], np.float32)
    w = np.array([[1.0, 1.0], [0.5, 0.0]], np.float32)
    assert _run(L2Loss(), p, t, w) == pytest.approx((1 + 0 + 0.5 * 4) / 2.5)
    # Per-row weights broadcast over the last axis when given as [batch, 1].
    assert _run(L2Loss(), p, t, np.array([[1.0], [0.0]], np.float32)) == pytest.approx(0.5)


def test_weighted_mean_helper():
    assert float(weighted_mean(jnp.array([1.0, 3.0]), jnp.array([1.0, 3.0]))) == 2.5
    assert float(weighted_mean(jnp.array([1.0, 3.0]), jnp.array(0.0))) == 0.0
    with pytest.raises(ValueError, match="do not broadcast"):
        weighted_mean(jnp.ones((2, 3)), jnp.ones(2))


def test_metric_layers_take_three_inputs_and_reject_bad_targets():
    for layer in (CrossEntropyLoss(), WeightedCategoryCrossEntropy(), Accuracy(), L2Loss()):
        assert (layer.n_in, layer.n_out) == (3, 1)
    with pytest.raises(LayerError, match="integer class-index targets"):
        CrossEntropyLoss().pure_fn((PROBS, TARGETS.astype(np.float32), WEIGHTS), (), (), None)
    with pytest.raises(LayerError, match=r"must have shape \(2, 2\)"):
        Accuracy().pure_fn((PROBS, TARGETS[:, :1], WEIGHTS), (), (), None)
    with pytest.raises(LayerError, match="differ"):
        L2Loss().pure_fn((PROBS, PROBS[..., :2], WEIGHTS), (), (), None)


def test_losses_jit_and_output_signature():
    layer = CrossEntropyLoss()
    sig = (jax.ShapeDtypeStruct((2, 2, 3), jnp.float32), jax.ShapeDtypeStruct((2, 2), jnp.int32),
           jax.ShapeDtypeStruct((2, 2), jnp.float32))
    out = layer.output_signature(sig)
    assert out.shape == () and out.dtype == jnp.float32
    jitted = jax.jit(lambda x: layer.pure_fn(x, (), (), None)[0])
    assert float(jitted((np.log(PROBS), TARGETS, WEIGHTS))) == pytest.approx(
        -(math.log(0.7) + math.log(0.1) + math.log(0.5)) / 3, rel=1e-6)


# --------------------------------------------------------------------------------------
# Edge cases.


LOG_PROBS = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (2, 3, 5)))


ONES = jnp.ones((2, 3))


@pytest.mark.parametrize("loss", [CrossEntropyLoss(), WeightedCategoryCrossEntropy(),
                                  WeightedCategoryCrossEntropy(label_smoothing=0.1)])
@pytest.mark.parametrize("bad", [-1, 5])
def test_target_outside_the_classes_is_nan_not_wrapped_or_dropped(loss, bad):
    targets = jnp.zeros((2, 3), jnp.int32).at[1, 2].set(bad)
    assert np.isnan(float(loss((LOG_PROBS, targets, ONES))))


@pytest.mark.parametrize("loss", [CrossEntropyLoss(), WeightedCategoryCrossEntropy(0.1)])
def test_padding_id_minus_one_with_weight_zero_is_skipped_with_finite_gradients(loss):
    targets = jnp.zeros((2, 3), jnp.int32).at[1, 2].set(-1)
    weights = ONES.at[1, 2].set(0.0)
    value = loss((LOG_PROBS, targets, weights))
    expected = loss((LOG_PROBS[:1], targets[:1], ONES[:1])) * 3 / 5 + loss(
        (LOG_PROBS[1:, :2], targets[1:, :2], ONES[1:, :2])) * 2 / 5
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    grads = jax.grad(lambda lp: loss.pure_fn((lp, targets, weights), (), (), None)[0])(
        LOG_PROBS)
    assert np.isfinite(np.asarray(grads)).all()
    assert float(jnp.abs(grads[1, 2]).max()) == 0.0
