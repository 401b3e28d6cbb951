"""Tests for revtrain.layers.dropout_masks: quantised rates, realised rates, purity."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import Dropout, LayerError, PositionalEncoding
from revtrain.layers.attention.causal import CausalAttention
from revtrain.layers.dropout_masks import drop_threshold, keep_mask, quantised_rate


@pytest.mark.parametrize("rate,bits,expected", [
    (0.1, 16, 6554 / 65536), (0.1, 8, 26 / 256), (0.25, 8, 0.25), (0.5, 16, 0.5),
    (0.001, 8, 0.0), (0.9999999, 8, 255 / 256), (0.0, 16, 0.0)])
def test_quantised_rate(rate, bits, expected):
    assert quantised_rate(rate, bits) == expected
    assert abs(quantised_rate(rate, bits) - rate) <= 2.0 ** -(bits + 1) + 1e-12 or rate > 0.99
    assert drop_threshold(rate, bits) == round(expected * 2 ** bits)


def _binomial_z(kept: np.ndarray, rate: float) -> float:
    """Standard score of the number of dropped elements under Binomial(n, rate)."""
    n = kept.size
    return ((~kept).sum() - n * rate) / math.sqrt(n * rate * (1 - rate))


@pytest.mark.parametrize("rate,bits", [(0.1, 16), (0.1, 8), (0.25, 8), (0.5, 16), (0.3, 16)])
def test_realised_drop_rate_is_the_quantised_rate(rate, bits):
    kept = np.asarray(keep_mask(jax.random.key(3), (64, 1001), rate, bits))
    assert kept.dtype == bool and kept.shape == (64, 1001)
    # 64k draws: the count of drops is within 4.5 standard deviations of n * realised rate.
    assert abs(_binomial_z(kept, quantised_rate(rate, bits))) < 4.5
    if bits == 8 and rate == 0.1:  # 26/256 = 0.1016 is distinguishable from 0.1 at 4M draws
        big = np.asarray(keep_mask(jax.random.key(4), (4096, 1024), rate, bits))
        assert abs(_binomial_z(big, quantised_rate(rate, bits))) < 4.5
        assert _binomial_z(big, rate) > 4.5


def test_mask_bits_are_independent_across_lanes_and_positions():
    kept = np.asarray(keep_mask(jax.random.key(5), (512, 512), 0.5, 8)).astype(np.float64)
    # Neighbouring elements share a 32-bit word; their agreement must still be 1/2.
    for shift in (1, 2, 3, 4):
        agree = (kept[:, :-shift] == kept[:, shift:]).mean()
        assert abs(agree - 0.5) < 0.01, (shift, agree)


def test_mask_is_a_pure_function_of_the_key_and_differs_between_keys():
    a = keep_mask(jax.random.key(0), (7, 9), 0.5)
    b = jax.jit(keep_mask, static_argnums=(1, 2, 3))(jax.random.key(0), (7, 9), 0.5, 16)
    np.testing.assert_array_equal(a, b)
    assert np.any(np.asarray(a) != np.asarray(keep_mask(jax.random.key(1), (7, 9), 0.5)))


def test_odd_sizes_and_scalars():
    for shape in [(), (1,), (3,), (5, 3)]:
        assert keep_mask(jax.random.key(0), shape, 0.5, 8).shape == shape


def test_dropout_scale_keeps_the_mean_with_the_quantised_rate():
    x = jnp.ones((256, 256), jnp.float32)
    y = np.asarray(Dropout(0.1, mask_bits=8).pure_fn(x, (), (), jax.random.key(2))[0])
    np.testing.assert_allclose(y[y != 0], 1 / (1 - 26 / 256), rtol=1e-6)


def test_dropout_of_a_rate_that_quantises_to_zero_is_the_identity():
    x = jnp.ones((4, 4), jnp.float32)
    np.testing.assert_array_equal(
        Dropout(0.001, mask_bits=8).pure_fn(x, (), (), jax.random.key(0))[0], x)


@pytest.mark.parametrize("bits", [0, 32, True, "8", 8.0, np.float32(16)])
@pytest.mark.parametrize("make", [
    lambda bits: Dropout(0.1, mask_bits=bits),
    lambda bits: PositionalEncoding(16, dropout=0.1, mask_bits=bits),
    lambda bits: CausalAttention(4, n_heads=2, dropout=0.1, mask_bits=bits)])
def test_mask_bits_must_be_the_integer_8_or_16(make, bits):
    with pytest.raises(ValueError, match=rf"mask_bits={re.escape(repr(bits))} is not one of"):
        make(bits)


def test_bad_mask_bits_are_errors():
    with pytest.raises(ValueError, match="mask_bits=12"):
        Dropout(0.1, mask_bits=12)
    with pytest.raises(ValueError, match="mask_bits=32"):
        keep_mask(jax.random.key(0), (3,), 0.1, 32)
    with pytest.raises(LayerError, match="needs an rng"):
        Dropout(0.1).pure_fn(np.ones(3, np.float32), (), (), None)


def test_mask_bits_is_part_of_the_structure_key():
    assert Dropout(0.1, mask_bits=8).structure_key != Dropout(0.1).structure_key
    assert Dropout(0.1, mask_bits=16).structure_key == Dropout(0.1).structure_key
