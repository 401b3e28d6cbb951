"""benchmarks/first_step.py: every part runs end to end at tiny sizes; ratios and targets."""
import json

import pytest
from absl import flags

from benchmarks import first_step, first_step_worker, harness
from tests.benchmarks.conftest import TINY

pytestmark = pytest.mark.slow


def test_quick_run_writes_every_part(tmp_path):
    first_step.main(TINY + ["--depths", "1,2", "--kinds", "reversible", "--scan_depths", "1",
                            "--scan_rounds", "2", "--serial_layers", "2,4", "--jobs", "2",
                            "--out_dir", str(tmp_path)])
    saved = json.loads((tmp_path / "first_step.json").read_text())
    assert saved["config"]["quick"] and saved["parts"] == list(first_step.PARTS)
    rows = {(r["depth"], r["cache"]): r for r in saved["first_step"]}
    assert set(rows) == {(d, c) for d in (1, 2) for c in ("cold", "warm")}, saved["first_step"]
    for (depth, cache), r in rows.items():
        assert r["trainer"] == "reversible" and r["cache_enabled"]
        assert r["total_s"] == pytest.approx(
            r["model_s"] + r["init_s"] + r["trainer_s"] + r["first_step_s"])
        assert min(r[f"{p}_s"] for p in first_step_worker.PHASES) > 0
        assert set(r["compile_s"]) == set(r["n_compiles"]) == set(first_step_worker.PHASES)
        assert r["compile_total_s"] == pytest.approx(
            sum(r["compile_s"][p] for p in first_step_worker.PHASES[:4]))
        assert r["n_compiles"]["first_step"] > 0 and r["n_compiles"]["second_step"] == 0
        assert r["compile_times"]["n_programs"] > 0 and r["compile_times"]["run_s"] > 0
        assert len(r["loadavg_before"]) == len(r["loadavg_after"]) == 3
        assert r["n_layers"] == 1 + 4 * depth + 1 and r["cache_bytes"] > 0
        compiles = sum(r["n_compiles"].values())
        if cache == "cold":  # Everything compiled and written; the warm process loads it all.
            assert (r["cache_hits"], r["cache_misses"]) == (0, compiles)
        else:
            assert (r["cache_hits"], r["cache_misses"]) == (compiles, 0)
            assert r["warm_over_cold_first_step"] == pytest.approx(
                r["first_step_s"] / rows[(depth, "cold")]["first_step_s"])
            assert r["losses"] == rows[(depth, "cold")]["losses"]
    ratios = {d["cache"]: d for d in saved["depth_ratios"]}
    assert ratios["cold"]["total"] == pytest.approx(
        rows[(2, "cold")]["total_s"] / rows[(1, "cold")]["total_s"])
    (scan,) = saved["scan"]
    steps = {kind: s["step_times_s"] for kind, s in scan["kinds"].items()}
    assert {kind: len(s) for kind, s in steps.items()} == {"trainer": 2, "trainer_unrolled": 2}
    assert scan["ratio"] == pytest.approx(scan["kinds"]["trainer"][scan["ratio_from"]] /
                                          scan["kinds"]["trainer_unrolled"][scan["ratio_from"]])
    serial = {r["depth"]: r for r in saved["deep_serial"]}
    assert set(serial) == {2, 4} and serial[2]["per_layer_ratio"] == 1.0
    for n, r in serial.items():
        assert r["n_layers"] == n + 2 and r["cache_hits"] == 0 and not r["cache_enabled"]
        assert r["compile_per_layer_s"] == pytest.approx(r["compile_total_s"] / n)
    assert len(saved["targets"]) == 4  # depth, warm/cold, scan at depth 1, the Serial
    markdown = (tmp_path / "first_step.md").read_text()
    assert "| ReversibleSerialTrainer | 2 | warm |" in markdown
    assert "Serial of 4 Dense(2)" in markdown
    assert (tmp_path / "first_step.png").read_bytes()[:4] == b"\x89PNG"


def _row(kind, depth, cache, total, first):
    return {"trainer": kind, "depth": depth, "cache": cache, "total_s": total,
            "first_step_s": first, "compile_total_s": total / 2}


def _scan(depth, scanned, unrolled, quiet=1):
    def kind(median):
        return {"median_step_s": median, "median_step_all_s": 2 * median,
                "median_cpu_s": median, "n_quiet_steps": quiet}
    return {"depth": depth, "kinds": {"trainer": kind(scanned),
                                      "trainer_unrolled": kind(unrolled)}}


def test_ratios_and_targets():
    payload = {"first_step": [
        _row("trainer", 2, "cold", 10.0, 8.0), _row("trainer", 32, "cold", 12.0, 9.0),
        _row("trainer", 2, "warm", 3.0, 2.0), _row("trainer", 32, "warm", 4.0, 3.6),
        _row("trainer_unrolled", 2, "cold", 10.0, 8.0),
        _row("trainer_unrolled", 32, "cold", 40.0, 36.0),
        {"trainer": "reversible", "depth": 2, "cache": "cold", "error": "boom"}],
        "scan": [_scan(2, 1.04, 1.0), _scan(32, 1.2, 1.0, quiet=0)],
        "deep_serial": [{"depth": 100, "compile_total_s": 2.0},
                        {"depth": 800, "compile_total_s": 20.0}]}
    first_step.derive(payload)
    checks = {c["target"]: (c["value"], c["met"]) for c in payload["targets"]}
    assert checks == {
        "Trainer build + init + first step, cold cache, depth 32 <= 1.25x depth 2":
            ("1.20x", True),
        "Trainer first step, warm cache <= 0.3x cold, every depth":
            ("0.40x (worst: depth 32)", False),
        "Trainer step time, scan_layers=True within 5% of False, depth 2":
            ("1.040x (CPU time 1.040x)", True),
        "Trainer step time, scan_layers=True within 5% of False, depth 32":
            ("1.200x (CPU time 1.200x)", False),
        "Trainer on Serial of 800 Dense(2): compile seconds per layer <= 2.0x those of "
        "100 layers": ("1.25x", True)}  # The unrolled Trainer is there for comparison.
    unrolled = [d for d in payload["depth_ratios"] if d["trainer"] == "trainer_unrolled"]
    assert [(d["cache"], d["total"]) for d in unrolled] == [("cold", 4.0)]
    assert payload["scan"][1]["ratio_from"] == "median_step_all_s"  # No quiet steps.


def test_sizes_default_to_the_issue_and_quick_keeps_harness_sizes():
    args = first_step.parse([])
    assert (args.d_model, args.d_ff, args.seq_len, args.batch_size, args.dropout) == (
        128, 512, 128, 8, 0.1)
    assert (args.depths, args.scan_depths, args.serial_layers) == ([2, 8, 32], [2, 32],
                                                                   [100, 800])
    quick = first_step.parse(["--quick", "--scan_rounds", "3"])
    assert (quick.d_model, quick.depths) == (harness.QUICK["d_model"], [2, 4])
    assert (quick.serial_layers, quick.scan_rounds, quick.steps) == ([10, 80], 3, 1)
    with pytest.raises(flags.IllegalFlagValueError, match="--parts must name"):
        first_step.parse(["--parts", "first_step,warm"])
