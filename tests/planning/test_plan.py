"""Tests of revtrain.planning.plan: what fits is kept under the budget, the global batch is
kept by accumulation, and a budget nothing fits says what would."""
import jax
import pytest

from revtrain.planning import estimate
from revtrain.planning.cost import DeviceRates
from revtrain.planning.plan import Candidate, plan
from revtrain.trainers import ReversibleSerialTrainer, Trainer
from tests.planning.test_estimate import BATCH, _abstract_model, _optimizer

RATES = DeviceRates(flops_per_s=1e10, elements_per_s=1e9, dispatch_s=1e-4,
                    host_bytes_per_s=1e9, device="test")
CANDIDATES = (Candidate("Trainer", Trainer),
              Candidate("ReversibleSerialTrainer", ReversibleSerialTrainer))


def _plan(budget, **options):
    model, loss, signature = _abstract_model()
    return plan(model, loss, signature, _optimizer, budget, candidates=CANDIDATES,
                rates=RATES, **options)


@pytest.fixture(scope="module")
def generous():
    return _plan(1 << 30)


@pytest.fixture(scope="module")
def smallest():
    return _plan(1 << 30, fixed_batch=False, max_batch=1)


def test_a_generous_budget_keeps_the_batch_and_ranks_by_predicted_speed(generous):
    result = generous
    assert result.pick is not None and all(c.fits for c in result.choices)
    assert [c.accumulate_steps for c in result.choices] == [1, 1]
    assert [c.global_batch for c in result.choices] == [BATCH, BATCH]
    speeds = [c.tokens_per_second for c in result.choices]
    assert speeds == sorted(speeds, reverse=True)
    assert "| Trainer | 8 x 1 |" in result.table()


def test_a_tight_budget_accumulates_micro_batches_that_fit(generous, smallest):
    trainer = next(c for c in generous.choices if c.candidate.trainer_class is Trainer)
    floor = max(c.estimate.peak_bytes for c in smallest.choices)
    budget = int((floor + trainer.estimate.peak_bytes) / 2 / 0.9)  # Between the two.
    result = _plan(budget)
    for choice in result.choices:
        assert choice.fits and choice.estimate.peak_bytes <= result.limit_bytes
        assert choice.global_batch == BATCH
        assert choice.estimate.batch_size * choice.accumulate_steps == BATCH
    accumulated = next(c for c in result.choices if c.candidate.trainer_class is Trainer)
    assert accumulated.accumulate_steps > 1


def test_the_largest_batch_that_fits_is_under_the_budget(generous):
    budget = max(c.estimate.peak_bytes for c in generous.choices) * 2
    result = _plan(budget, fixed_batch=False, max_batch=64, margin=0.0)
    for choice in result.choices:
        assert choice.fits and choice.estimate.peak_bytes <= budget
        assert BATCH <= choice.estimate.batch_size <= 64
    trainer = next(c for c in result.choices if c.candidate.trainer_class is Trainer)
    rows = trainer.estimate.batch_size
    assert rows < 64  # Its activations grow fastest: the budget, not max_batch, bounds it.
    model, loss, signature = _abstract_model()
    unit = jax.device_count()  # The batch splits over all (4) devices.
    above = estimate(model, loss, signature, _optimizer, Trainer, batch_size=rows + unit)
    assert above.peak_bytes > budget


def test_a_budget_nothing_fits_names_the_smallest_peak_and_what_would_fit():
    result = _plan(1 << 16, fixed_batch=False, max_batch=BATCH)
    assert result.pick is None and not any(c.fits for c in result.choices)
    line = result.nothing_fits()
    assert "\n" not in line and "64.0 KiB" in line and "smallest predicted peak" in line
    assert "shorter length" in line and "more devices" in line


@pytest.mark.parametrize("budget, margin, match", [
    (0, 0.1, "memory_budget=0 must be a positive number of bytes"),
    (-5, 0.1, "memory_budget=-5"), (1.5e9, 0.1, "memory_budget=1500000000.0"),
    (True, 0.1, "memory_budget=True"), (1 << 30, 1.0, "margin=1.0 must be in"),
])
def test_bad_budgets_and_margins_are_refused(budget, margin, match):
    with pytest.raises(ValueError, match=match):
        _plan(budget, margin=margin)
