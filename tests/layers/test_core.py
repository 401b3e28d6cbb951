"""Tests for revtrain.layers.core: values vs numpy, signatures, errors, gradients."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from revtrain.layers import (
    Dense,
    Dropout,
    Embedding,
    Flatten,
    LayerError,
    LogSoftmax,
    Mean,
    PositionalEncoding,
    Relu,
    Serial,
    ShiftRight,
)
from revtrain.layers.position_tables import sinusoidal_encoding
from revtrain.models.transformer import _PositionalEncodingAt

SDS = jax.ShapeDtypeStruct


def _x(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def _check_weight_grads(layer, x, rng=None):
    """Checks d(output)/d(weights) (and d/dx for float x) against central differences, in
    float64 inside an x64 context (not enabled globally)."""
    with jax.enable_x64(True):
        to64 = lambda a: a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a
        w = jax.tree.map(lambda a: to64(np.asarray(a)), layer.weights)
        s = layer.state
        x64 = to64(np.asarray(x))
        check_grads(lambda w_: layer.pure_fn(x64, w_, s, rng)[0], (w,), order=1,
                    modes=["rev"])
        if np.issubdtype(x64.dtype, np.floating):
            check_grads(lambda x_: layer.pure_fn(x_, w, s, rng)[0], (x64,), order=1,
                        modes=["rev"])


# ---------------------------------------------------------------------------------------
# Dense.


def test_dense_values_and_weight_shapes():
    layer = Dense(3)
    w, state = layer.init(SDS((2, 4, 5), jnp.float32), rng=jax.random.key(1))
    assert [a.shape for a in w] == [(5, 3), (3,)]
    assert all(a.dtype == jnp.float32 for a in w) and state == ()
    x = _x((2, 4, 5))
    np.testing.assert_allclose(layer(x), x @ np.asarray(w[0]) + np.asarray(w[1]), rtol=1e-5,
                               atol=1e-6)


def test_dense_without_bias_has_kernel_only():
    layer = Dense(4, use_bias=False)
    w, _ = layer.init(SDS((3, 2), jnp.float32))
    assert isinstance(w, tuple) and len(w) == 1 and w[0].shape == (2, 4)
    x = _x((3, 2))
    np.testing.assert_allclose(layer(x), x @ np.asarray(w[0]), rtol=1e-5, atol=1e-6)


def test_dense_glorot_uniform_kernel_bounds_and_tiny_bias():
    d_in, n_units = 64, 32
    w, _ = Dense(n_units).init(SDS((1, d_in), jnp.float32), rng=jax.random.key(3))
    limit = math.sqrt(6.0 / (d_in + n_units))
    kernel = np.asarray(w[0])
    assert np.abs(kernel).max() <= limit
    assert abs(kernel.std() - limit / math.sqrt(3.0)) < 0.1 * limit
    assert np.abs(np.asarray(w[1])).max() < 1e-4


def test_dense_output_signature_and_dtype():
    layer = Dense(7)
    layer.init(SDS((2, 3, 4), jnp.float32))
    sig = layer.output_signature(SDS((2, 3, 4), jnp.bfloat16))
    assert sig.shape == (2, 3, 7) and sig.dtype == jnp.bfloat16
    y = layer(jnp.ones((2, 3, 4), jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and y.shape == (2, 3, 7)


def test_dense_wrong_trailing_dim_names_expected_and_received():
    layer = Dense(3)
    layer.init(SDS((2, 8), jnp.float32))
    with pytest.raises(LayerError, match=r"d_in=8.*received d_in=5"):
        layer(np.ones((2, 5), np.float32))


def test_dense_gradients_match_finite_differences():
    layer = Dense(3)
    layer.init(SDS((2, 4), jnp.float32), rng=jax.random.key(2))
    _check_weight_grads(layer, _x((2, 4)))


# ---------------------------------------------------------------------------------------
# Embedding.


def test_embedding_looks_up_rows():
    layer = Embedding(11, 6)
    table, state = layer.init(SDS((2, 5), jnp.int32))
    assert table.shape == (11, 6) and table.dtype == jnp.float32 and state == ()
    ids = np.array([[0, 3, 10, 3, 1], [2, 2, 9, 0, 5]], np.int32)
    y = layer(ids)
    assert y.shape == (2, 5, 6)
    np.testing.assert_array_equal(y, np.asarray(table)[ids])
    assert layer.output_signature(SDS((2, 5), jnp.int32)).shape == (2, 5, 6)


def test_embedding_rejects_floats_saying_integer_expected():
    layer = Embedding(5, 4)
    layer.init(SDS((1, 3), jnp.int32))
    with pytest.raises(LayerError, match="integer dtype"):
        layer(np.zeros((1, 3), np.float32))


def test_embedding_gradients_match_finite_differences():
    layer = Embedding(7, 3)
    layer.init(SDS((2, 4), jnp.int32), rng=jax.random.key(5))
    _check_weight_grads(layer, np.array([[0, 6, 6, 2], [1, 2, 3, 0]], np.int32))


# ---------------------------------------------------------------------------------------
# Dropout.


def test_dropout_same_rng_same_mask_different_rng_different_mask():
    layer = Dropout(0.5)
    x = np.ones((4, 16), np.float32)
    y1, _ = layer.pure_fn(x, (), (), jax.random.key(0))
    y2, _ = layer.pure_fn(x, (), (), jax.random.key(0))
    y3, _ = layer.pure_fn(x, (), (), jax.random.key(1))
    np.testing.assert_array_equal(y1, y2)
    assert np.any(np.asarray(y1) != np.asarray(y3))


def test_dropout_scales_kept_values_by_inverse_keep_rate():
    rate = 0.25
    x = _x((100, 100)) + 5.0
    y = np.asarray(Dropout(rate).pure_fn(x, (), (), jax.random.key(7))[0])
    kept = y != 0
    np.testing.assert_allclose(y[kept], x[kept] / (1 - rate), rtol=1e-6)
    assert abs(kept.mean() - (1 - rate)) < 0.02


def test_dropout_identity_in_eval_mode_and_at_rate_zero():
    x = _x((3, 5))
    np.testing.assert_array_equal(Dropout(0.9, mode="eval").pure_fn(x, (), (), None)[0], x)
    np.testing.assert_array_equal(Dropout(0.0).pure_fn(x, (), (), jax.random.key(0))[0], x)


def test_dropout_shared_axes_share_the_mask():
    y = np.asarray(Dropout(0.5, shared_axes=(1,)).pure_fn(
        np.ones((8, 6, 4), np.float32), (), (), jax.random.key(3))[0])
    np.testing.assert_array_equal(y, np.broadcast_to(y[:, :1], y.shape))
    assert 0 < (y != 0).mean() < 1


def test_dropout_errors():
    with pytest.raises(ValueError, match="rate=1.0"):
        Dropout(1.0)
    with pytest.raises(ValueError, match="mode='test'"):
        Dropout(0.1, mode="test")
    with pytest.raises(LayerError, match="needs an rng"):
        Dropout(0.1).pure_fn(np.ones(3, np.float32), (), (), None)


# ---------------------------------------------------------------------------------------
# PositionalEncoding.


def _pe_reference(length, d):
    pe = np.zeros((length, d))
    for pos in range(length):
        for i in range(d):
            angle = pos / 10000 ** ((i - i % 2) / d)
            pe[pos, i] = math.sin(angle) if i % 2 == 0 else math.cos(angle)
    return pe


@pytest.mark.parametrize("d", [8, 7])
def test_positional_encoding_adds_the_sinusoid_table(d):
    x = _x((2, 5, d))
    y = PositionalEncoding(max_len=16)(x)
    np.testing.assert_allclose(y, x + _pe_reference(5, d)[None], rtol=1e-5, atol=1e-5)


def test_positional_encoding_dropout_hits_the_encoding_shared_over_batch():
    x = np.zeros((3, 6, 8), np.float32)
    layer = PositionalEncoding(max_len=6, dropout=0.5)
    y = np.asarray(layer.pure_fn(x, (), (), jax.random.key(4))[0])
    np.testing.assert_array_equal(y[0], y[1])
    pe = _pe_reference(6, 8)
    kept = y[0] != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_allclose(y[0][kept], 2 * pe[kept], rtol=1e-5, atol=1e-6)
    y_eval = PositionalEncoding(max_len=6, dropout=0.5, mode="eval").pure_fn(x, (), (), None)[0]
    np.testing.assert_allclose(y_eval[0], pe, rtol=1e-5, atol=1e-6)


def _added_rows(layer, length, d, state=()):
    return np.asarray(layer.pure_fn(np.zeros((1, length, d), np.float32), (), state,
                                    None)[0][0])


def test_positional_encoding_rows_depend_on_the_position_only():
    """A position's row is computed alike at every length and when decoding (the LM's
    ``'predict'``-mode layer, from position 5 on): equal up to the float rounding of
    different programs' fusions (2 ulp of 1); all are the float64 table's to 1e-6."""
    d, max_len = 12, 64
    full = _added_rows(PositionalEncoding(max_len=max_len), max_len, d)
    np.testing.assert_allclose(_added_rows(PositionalEncoding(max_len=max_len), 7, d),
                               full[:7], rtol=0, atol=2.5e-7)
    decoding = _PositionalEncodingAt(max_len)
    np.testing.assert_allclose(_added_rows(decoding, 3, d, jnp.int32(5)), full[5:8],
                               rtol=0, atol=2.5e-7)
    np.testing.assert_allclose(full, sinusoidal_encoding(max_len, d), rtol=0, atol=1e-6)


def test_positional_encoding_puts_no_length_sized_table_in_the_program():
    """The rows are computed in the program: its text does not grow with the length (a
    [length, d] constant would add length * d numbers to it)."""
    def program_chars(length):
        x = jax.ShapeDtypeStruct((1, length, 64), jnp.float32)
        layer = PositionalEncoding(max_len=4096)
        return len(jax.jit(lambda x: layer.pure_fn(x, (), (), None)[0]).lower(x).as_text())

    assert program_chars(4096) < program_chars(16) + 1000


def test_positional_encoding_too_long_input_names_max_len():
    with pytest.raises(LayerError, match="max_len=4"):
        PositionalEncoding(max_len=4)(np.zeros((1, 5, 2), np.float32))


# ---------------------------------------------------------------------------------------
# Reshapes and shifts.


def test_flatten_mean_and_shift_right():
    x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    np.testing.assert_array_equal(Flatten()(x), x.reshape(2, 12))
    np.testing.assert_array_equal(Flatten(n_axes_to_keep=2)(x), x)
    np.testing.assert_array_equal(Mean()(x), x.mean(-1))
    np.testing.assert_array_equal(Mean(axis=(0, 1), keepdims=True)(x),
                                  x.mean((0, 1), keepdims=True))
    ids = np.array([[5, 6, 7, 8]], np.int32)
    np.testing.assert_array_equal(ShiftRight()(ids), [[0, 5, 6, 7]])
    np.testing.assert_array_equal(ShiftRight(n_positions=2)(ids), [[0, 0, 5, 6]])
    np.testing.assert_array_equal(ShiftRight(mode="predict")(ids), ids)
    with pytest.raises(LayerError, match="n_axes_to_keep=3"):
        Flatten(n_axes_to_keep=3)(x)


# ---------------------------------------------------------------------------------------
# Composition.


def test_init_from_signature_only_in_serial():
    model = Serial(Embedding(10, 8), PositionalEncoding(max_len=8), Dense(8), Relu(),
                   Dropout(0.1), Dense(10), LogSoftmax())
    sig = SDS((2, 8), jnp.int32)
    weights, _ = model.init(sig, rng=jax.random.key(0))
    assert jax.tree.map(jnp.shape, weights) == (
        (10, 8), (), ((8, 8), (8,)), (), (), ((8, 10), (10,)), ())
    out = model.output_signature(sig)
    assert out.shape == (2, 8, 10) and out.dtype == jnp.float32
    y = model(np.zeros((2, 8), np.int32))
    assert y.shape == out.shape
    np.testing.assert_allclose(np.exp(np.asarray(y)).sum(-1), 1.0, rtol=1e-5)


def test_structure_key_follows_constructor_args():
    assert Dense(4).structure_key == Dense(4).structure_key is not None
    assert Dense(4).structure_key != Dense(5).structure_key
    assert Dropout(0.1, mode="eval").structure_key != Dropout(0.1).structure_key


# --------------------------------------------------------------------------------------
# Edge cases.


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
