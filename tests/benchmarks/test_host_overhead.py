"""Tests for benchmarks/host_overhead.py: it measures what it says, on public API only."""
from benchmarks import host_overhead


def test_measure_reports_medians_for_the_flat_layers_of_the_model():
    result = host_overhead.measure(depth=2, d_model=8, steps=2, warmup=1, n_devices=2,
                                   trainer_kind="reversible")
    assert result["n_flat_layers"] == 1 + 4 * 2 + 1
    assert 0 < result["median_dispatch_s"] <= result["median_step_s"]
    assert result["median_dispatch_thread_cpu_s"] > 0
    assert result["revtrain"].endswith("revtrain/__init__.py")
    # Embedding block, one scan each way over the 2 x 4 reversible layers, the loss.
    assert result["scan_layers"] and result["n_dispatches_per_step"] == 5


def test_memory_efficient_trainer_is_measured_too():
    result = host_overhead.measure(depth=1, d_model=8, steps=1, warmup=1, n_devices=1,
                                   trainer_kind="memory_efficient")
    assert result["trainer"] == "memory_efficient" and result["median_step_s"] > 0
