"""Tests for revtrain.layers.projected_loss: equality with Dense + cross entropy, memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    Dense,
    LayerError,
    ProjectedCrossEntropy,
    Serial,
    WeightedCategoryCrossEntropy,
)

B, S, D, V = 2, 6, 5, 13
SDS = jax.ShapeDtypeStruct


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(B, S, D)).astype(np.float32)
    targets = rng.integers(0, V, size=(B, S)).astype(np.int32)
    weights = (rng.random((B, S)) > 0.25).astype(np.float32)
    return features, targets, weights


def _signature(b=B, s=S, d=D):
    return (SDS((b, s, d), jnp.float32), SDS((b, s), jnp.int32), SDS((b, s), jnp.float32))


@pytest.mark.parametrize("n_chunks,label_smoothing", [(1, None), (4, None), (12, 0.1)])
def test_equals_dense_then_cross_entropy_with_gradients(n_chunks, label_smoothing):
    fused = ProjectedCrossEntropy(V, label_smoothing=label_smoothing, n_chunks=n_chunks)
    fused.init(_signature(), rng=jax.random.key(0))
    reference = Serial(Dense(V), WeightedCategoryCrossEntropy(label_smoothing, n_chunks=1))
    features, targets, weights = _inputs()

    def loss(layer, params, x):
        return layer.pure_fn((x, targets, weights), params, layer.state if layer is fused
                             else ((), ()), None)[0]

    got = jax.jit(jax.value_and_grad(lambda p, x: loss(fused, p, x), argnums=(0, 1)))(
        fused.weights, features)
    want = jax.value_and_grad(lambda p, x: loss(reference, (p, ()), x), argnums=(0, 1))(
        fused.weights, features)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_weights_are_a_dense_heads():
    fused = ProjectedCrossEntropy(V)
    fused.init(_signature(), rng=jax.random.key(3))
    dense = Dense(V)
    dense.init(SDS((B, S, D), jnp.float32), rng=jax.random.key(3))
    for a, b in zip(fused.weights, dense.weights, strict=True):
        np.testing.assert_array_equal(a, b)


def test_errors_name_the_inputs():
    fused = ProjectedCrossEntropy(V)
    fused.init(_signature())
    features, targets, weights = _inputs()
    with pytest.raises(LayerError, match="integer class-index targets"):
        fused((features, targets.astype(np.float32), weights))
    with pytest.raises(LayerError, match=r"must have shape \(2, 5, 5\)"):
        fused((features, targets[:, :5], weights[:, :5]))
    with pytest.raises(ValueError, match="vocab_size=0"):
        ProjectedCrossEntropy(0)
    with pytest.raises(ValueError, match="n_chunks=-2"):
        ProjectedCrossEntropy(V, n_chunks=-2)


def test_loss_steps_peak_is_below_one_and_a_half_logits_buffers_and_shrinks_with_chunks():
    b, s, d, v = 4, 64, 32, 2048
    logits_bytes = b * s * v * 4

    def peak(n):
        layer = ProjectedCrossEntropy(v, n_chunks=n)
        layer.init(_signature(b, s, d))
        step = jax.jit(jax.value_and_grad(
            lambda p, *x: layer.pure_fn(x, p, (), None)[0], argnums=(0, 1)))
        m = step.lower(layer.weights, *_signature(b, s, d)).compile().memory_analysis()
        return (m.temp_size_in_bytes + m.output_size_in_bytes + m.argument_size_in_bytes
                - m.alias_size_in_bytes) / logits_bytes

    unchunked, four, sixteen = peak(1), peak(4), peak(16)
    assert unchunked > 2.0  # logits, log-softmax and gradient buffers
    assert four <= 1.5 and sixteen < four
