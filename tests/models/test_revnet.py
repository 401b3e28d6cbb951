"""Tests for revtrain.models.revnet: shapes, validation, BatchNorm state, reversal."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    CrossEntropyLoss,
    ReversibleSerial,
    Serial,
    ShapeDtype,
    reconstruction_error,
)
from revtrain.models import RevNet
from tests.tree_utils import assert_trees_close

BATCH, SIZE, CHANNELS, CLASSES = 4, 8, 3, 5


def _images(seed=0):
    return jax.random.normal(jax.random.key(seed), (BATCH, SIZE, SIZE, CHANNELS))


def _revnet(**kwargs):
    return RevNet(n_classes=CLASSES, widths=(4, 8), n_blocks_per_stage=(1, 2), **kwargs)


def _init(model, x, seed=1):
    model.init(jax.tree.map(lambda a: ShapeDtype(a.shape, a.dtype), x), jax.random.key(seed))
    return model


def _batch_norm_counts(tree):
    """The ``n_batches`` counters of every BatchNorm state in ``tree``."""
    leaves = jax.tree.leaves(tree)
    return [int(a) for a in leaves if jnp.issubdtype(a.dtype, jnp.integer) and a.ndim == 0]


def test_log_probs_shape():
    model = _init(_revnet(), _images())
    y = model(_images())
    assert y.shape == (BATCH, CLASSES) and y.dtype == jnp.float32
    np.testing.assert_allclose(jax.scipy.special.logsumexp(y, axis=-1), 0.0, atol=1e-5)


def test_structure_has_reversible_stages_with_downsampling_between():
    model = _revnet()
    names = [s.name for s in model.sublayers]
    assert names[:4] == ["Conv", "Split", "ReversibleSerial", "Concatenate"]
    assert names[4:7] == ["BatchNorm", "Relu", "Conv"]  # non-reversible downsampling
    stages = [s for s in model.sublayers if isinstance(s, ReversibleSerial)]
    assert [len(s.sublayers) for s in stages] == [4, 8]


@pytest.mark.parametrize("widths,blocks", [((4, 7), (1, 1)), ((4, 8), (1,))])
def test_invalid_widths_raise(widths, blocks):
    with pytest.raises(ValueError, match="RevNet"):
        RevNet(widths=widths, n_blocks_per_stage=blocks)


def test_downsampling_halves_the_spatial_size():
    model = _init(_revnet(), _images())
    stem = Serial(*model.sublayers[:7])
    out = stem(_images(), weights=stem.weights, state=stem.state)
    assert out.shape == (BATCH, SIZE // 2, SIZE // 2, 8)


def test_batch_norm_updated_once_per_forward_and_not_by_reconstruction():
    images = _images()
    model = _init(_revnet(), images)
    counts = _batch_norm_counts(model.state)
    assert counts and set(counts) == {0}
    loss = Serial(model, CrossEntropyLoss())
    batch = (images, jnp.arange(BATCH) % CLASSES, jnp.ones((BATCH,)))
    errors = reconstruction_error(loss, batch, jax.random.key(2))
    print(f"RevNet reconstruction errors: max {max(errors):.2e}")
    assert len(errors) == 12 and max(errors) < 1e-5
    assert set(_batch_norm_counts(model.state)) == {0}  # reconstruction is pure
    model(images)
    assert set(_batch_norm_counts(model.state)) == {1}


def test_stage_reverse_and_grad_with_train_mode_batch_norm():
    images = _images()
    model = _init(_revnet(), images)
    stem = Serial(*model.sublayers[:2])
    streams = stem(images, weights=stem.weights, state=stem.state)
    stage = model.sublayers[2]
    rng = jax.random.key(4)
    y, new_state = stage.pure_fn(streams, stage.weights, stage.state, rng)
    assert set(_batch_norm_counts(new_state)) == {1}
    ct = jax.tree.map(jnp.sin, y)
    x, grads = stage.reverse_and_grad(y, ct, stage.weights, stage.state, new_state, rng)
    assert_trees_close(x, streams, atol=1e-5)
    _, vjp_fn = jax.vjp(lambda x, w: stage.pure_fn(x, w, stage.state, rng)[0], streams,
                        stage.weights)
    expected = vjp_fn(ct)
    # Relative to the largest gradient: conv biases before a BatchNorm have a zero gradient
    # (the normalisation removes them), so theirs are rounding noise.
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(expected))
    assert_trees_close(grads, expected, rtol=1e-4, atol=1e-5 * scale)


def test_eval_mode_uses_moving_statistics():
    images = _images()
    train, evaluate = _init(_revnet(), images), _init(_revnet(mode="eval"), images)
    assert_trees_close(evaluate.weights, train.weights, rtol=0, atol=0)
    assert not np.allclose(train(images), evaluate(images), atol=1e-3)
    again = evaluate(images)
    assert_trees_close(evaluate(images), again)  # eval does not change the state


def test_every_layer_has_a_structure_key_so_trainers_share_compiled_blocks():
    def layers(layer):
        yield layer
        for sub in layer.sublayers:
            yield from layers(sub)

    assert [layer.name for layer in layers(_revnet()) if layer.structure_key is None] == []


# --------------------------------------------------------------------------------------
# Edge cases.


def test_negative_block_count_is_rejected():
    with pytest.raises(ValueError, match=r"n_blocks_per_stage=\(1, -1\) must be >= 0"):
        RevNet(widths=(4, 8), n_blocks_per_stage=(1, -1))


def test_uint8_images_give_the_same_log_probs_as_float_images():
    model = RevNet(n_classes=3, widths=(4,), n_blocks_per_stage=(1,), mode="eval")
    pixels = (np.arange(48) * 7 % 256).astype(np.uint8).reshape(1, 4, 4, 3)
    model.init(pixels, rng=jax.random.key(0))
    np.testing.assert_allclose(model(pixels), model(pixels.astype(np.float32)), rtol=1e-5)
