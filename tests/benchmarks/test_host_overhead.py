"""Tests for benchmarks/host_overhead.py: it measures what it says, on public API only."""
import json
import subprocess
import sys

import pytest

from benchmarks import host_overhead
from benchmarks.harness import RESULTS_DIR
from tests.subprocesses import ROOT, child_env

pytestmark = pytest.mark.slow


def test_measure_reports_medians_for_the_flat_layers_of_the_model():
    result = host_overhead.measure(depth=2, d_model=8, steps=2, warmup=1, n_devices=2,
                                   trainer_kind="reversible")
    assert result["n_flat_layers"] == 1 + 4 * 2 + 1
    assert 0 < result["median_dispatch_s"] <= result["median_step_s"]
    assert result["median_dispatch_thread_cpu_s"] > 0
    assert result["revtrain"].endswith("revtrain/__init__.py")
    # Embedding block, one scan each way over the 2 x 4 reversible layers, the loss.
    assert result["scan_layers"] and result["n_dispatches_per_step"] == 5


def test_memory_efficient_windows_dispatch_fewer_programs():
    kind, options = host_overhead.VARIANTS["memory_efficient_window2"]
    per_layer = host_overhead.measure(depth=4, d_model=8, steps=1, warmup=1, n_devices=1,
                                      trainer_kind="memory_efficient")
    windows = host_overhead.measure(depth=4, d_model=8, steps=1, warmup=1, n_devices=1,
                                    trainer_kind=kind, **options)
    assert per_layer["scan_window"] is None and windows["scan_window"] == 2
    # Per layer 6 * depth + 3; two windows of two repetitions: 2 scans each way, the
    # embedding block's two ops and the loss.
    assert (per_layer["n_dispatches_per_step"], windows["n_dispatches_per_step"]) == (27, 7)


def _row(depth, dispatch_ms, programs, variant="reversible"):
    return {"variant": variant, "depth": depth, "n_dispatches_per_step": programs,
            "median_dispatch_s": dispatch_ms / 1e3, "median_dispatch_thread_cpu_s": 1e-3}


def test_targets_hold_only_when_every_depth_is_fast_and_the_count_is_flat():
    met = host_overhead.targets([_row(16, 2.5, 5), _row(32, 2.9, 5),
                                 _row(16, 90.0, 99, "memory_efficient")])
    assert [c["met"] for c in met] == [True, True, True]
    assert "16/32" in met[0]["target"] and met[0]["value"] == "5 / 5"
    missed = host_overhead.targets([_row(16, 2.5, 5), _row(32, 3.1, 7)])
    assert [c["met"] for c in missed] == [False, True, False]


def test_the_committed_result_set_is_this_scripts_output():
    payload = json.loads((RESULTS_DIR / "host_overhead.json").read_text())
    assert {r["variant"] for r in payload["results"]} == set(host_overhead.VARIANTS)
    assert payload["targets"] == host_overhead.targets(payload["results"])


def test_the_script_writes_json_and_markdown(tmp_path):
    out = subprocess.run(
        [sys.executable, "benchmarks/host_overhead.py", "--depths=2", "--variants=reversible",
         "--d_model=8", "--steps=1", "--warmup=1", f"--out_dir={tmp_path}"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    payload = json.loads((tmp_path / "host_overhead.json").read_text())
    (row,) = payload["results"]
    assert row["variant"] == "reversible" and row["n_dispatches_per_step"] == 5
    assert "ReversibleSerialTrainer" in (tmp_path / "host_overhead.md").read_text()
    for variants in ("adam", "", "reversible,reversible"):
        bad = subprocess.run([sys.executable, "benchmarks/host_overhead.py",
                              f"--variants={variants}", f"--out_dir={tmp_path / 'bad'}"],
                             cwd=ROOT, env=child_env(), capture_output=True, text=True,
                             timeout=300)
        assert bad.returncode != 0 and f"--variants={variants} must name" in bad.stderr
        assert not (tmp_path / "bad").exists()
