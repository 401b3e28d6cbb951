"""Tests of revtrain/training/schedules.py."""
import numpy as np
import pytest

from revtrain.training import constant, warmup_cosine_decay, warmup_rsqrt_decay


def test_warmup_rsqrt_decay_values():
    schedule = warmup_rsqrt_decay(peak_value=1e-3, warmup_steps=100)
    values = [float(schedule(s)) for s in (0, 50, 100, 400, 1600)]
    np.testing.assert_allclose(values, [0.0, 5e-4, 1e-3, 5e-4, 2.5e-4], rtol=1e-6)


def test_warmup_rsqrt_decay_without_warmup_starts_at_peak():
    schedule = warmup_rsqrt_decay(peak_value=2.0, warmup_steps=0)
    np.testing.assert_allclose([float(schedule(s)) for s in (0, 1, 4)], [2.0, 2.0, 1.0])


def test_warmup_cosine_decay_values():
    schedule = warmup_cosine_decay(peak_value=1.0, warmup_steps=10, decay_steps=110,
                                   end_value=0.1)
    np.testing.assert_allclose([float(schedule(s)) for s in (0, 5, 10, 60, 110, 500)],
                               [0.0, 0.5, 1.0, 0.55, 0.1, 0.1], rtol=1e-5)


def test_constant():
    assert float(constant(3e-4)(12345)) == pytest.approx(3e-4)


@pytest.mark.parametrize("call, match", [
    (lambda: warmup_rsqrt_decay(peak_value=-1.0), "peak_value=-1.0"),
    (lambda: warmup_rsqrt_decay(warmup_steps=-5), "warmup_steps=-5"),
    (lambda: warmup_cosine_decay(warmup_steps=10, decay_steps=10), "decay_steps=10"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
