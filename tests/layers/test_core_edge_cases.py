"""Edge cases of revtrain.layers.core: integer inputs, out-of-range axes, bad ranks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    Dense,
    Dropout,
    LayerError,
    LogSoftmax,
    Mean,
    PositionalEncoding,
    ShiftRight,
    Softmax,
)

IDS = jnp.arange(12, dtype=jnp.int32).reshape(2, 3, 2)


def test_dropout_of_integer_ids_is_an_error_not_truncated_scaling():
    layer = Dropout(0.1)
    with pytest.raises(LayerError, match=r"dropout needs float inputs but received int32"):
        layer.pure_fn(IDS, (), (), jax.random.key(0))
    # Eval mode (and rate 0) pass anything through unchanged.
    np.testing.assert_array_equal(Dropout(0.1, mode="eval")(IDS), IDS)


def test_dropout_shared_axes_out_of_range_is_an_error_not_wrapped():
    x = jnp.ones((4, 4))
    with pytest.raises(LayerError, match=r"shared_axes=\(5,\) are out of range for rank-2"):
        Dropout(0.5, shared_axes=(5,)).pure_fn(x, (), (), jax.random.key(0))
    y, _ = Dropout(0.5, shared_axes=(-1,)).pure_fn(x, (), (), jax.random.key(0))
    # One mask value per row: every row is all zeros or all 2s.
    assert set(np.unique(np.asarray(y).std(axis=1))) == {0.0}


def test_positional_encoding_of_integer_ids_is_an_error():
    with pytest.raises(LayerError, match=r"expects float embeddings but received int32; put "
                                         r"an Embedding layer before it"):
        PositionalEncoding(8)(IDS)


@pytest.mark.parametrize("layer,expected", [
    (LogSoftmax(), np.log(np.full((2, 3), 1 / 3))),
    (Softmax(), np.full((2, 3), 1 / 3)),
])
def test_softmaxes_of_integer_inputs_are_float32(layer, expected):
    y = layer(jnp.ones((2, 3), jnp.int32))
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, expected, rtol=1e-6)


def test_mean_axis_out_of_range_names_axis_and_shape():
    with pytest.raises(LayerError, match=r"Mean axis=3 is out of range for inputs of shape "
                                         r"\(2, 3\)"):
        Mean(axis=3)(jnp.ones((2, 3)))
    np.testing.assert_allclose(Mean(axis=(0, -1))(jnp.ones((2, 3)) * 2), 2.0)


def test_shift_right_of_rank_one_is_a_clear_error():
    with pytest.raises(LayerError, match=r"ShiftRight expects inputs \[batch, length, ...\]; "
                                         r"got shape \(3,\)"):
        ShiftRight()(jnp.ones(3))


def test_dense_init_on_a_scalar_is_a_clear_error():
    with pytest.raises(LayerError, match=r"Dense expects inputs \[..., d_in\] of rank >= 1"):
        Dense(3).init(jax.ShapeDtypeStruct((), jnp.float32))
