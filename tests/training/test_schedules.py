"""Tests of revtrain/training/schedules.py."""
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.training import RunConfig, constant, warmup_cosine_decay, warmup_rsqrt_decay
from revtrain.training.schedules import check_schedule


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
    (lambda: warmup_rsqrt_decay(peak_value=float("inf")),
     "warmup_rsqrt_decay.peak_value=inf must be a finite .* change the gin binding "
     "warmup_rsqrt_decay.peak_value"),
    (lambda: warmup_rsqrt_decay(peak_value=float("nan")), "peak_value=nan must be a finite"),
    (lambda: warmup_rsqrt_decay(peak_value=1e39), r"peak_value=1e\+39 must be a finite "
                                                  r"\(float32\) number > 0"),
    (lambda: warmup_cosine_decay(peak_value=0.0), "warmup_cosine_decay.peak_value=0.0"),
    (lambda: warmup_cosine_decay(end_value=float("inf")), "warmup_cosine_decay.end_value=inf"),
    (lambda: constant(float("inf")), "constant.value=inf must be a finite"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("schedule, match", [
    (lambda step: 1e-3 / jnp.float32(abs(step - 1)), "gives the learning rate inf at step 1"),
    (lambda step: step * float("nan"), "gives the learning rate nan at step 0"),
    (lambda step: -1e-3, "gives the learning rate -0.001 at step 0"),
    (lambda step: 1e39, "gives the learning rate inf at step 0"),  # Rates are float32.
    (lambda step: 0.0, r"gives the learning rate 0 at steps \[0, 1, 2, 3\]"),
])
def test_a_schedule_is_evaluated_at_its_first_steps_when_the_run_is_configured(schedule,
                                                                               match):
    with pytest.raises(ValueError, match=f"RunConfig.schedule {match}"):
        RunConfig(schedule=schedule)
    check_schedule(warmup_rsqrt_decay(warmup_steps=100))  # Starts at 0, then grows.
