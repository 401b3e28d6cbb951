"""Edge cases of revtrain.layers.metrics: class-index targets outside the classes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import CrossEntropyLoss, WeightedCategoryCrossEntropy

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
