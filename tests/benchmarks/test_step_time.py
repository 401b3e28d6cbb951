"""benchmarks/step_time.py: runs end to end at tiny sizes; ratios and targets."""
import json

import pytest

from benchmarks import harness, phases, report, step_time

pytestmark = pytest.mark.slow


def test_runs_every_trainer_in_worker_processes_and_writes_outputs(quick_args, tmp_path):
    step_time.main(quick_args)
    saved = json.loads((tmp_path / "step_time.json").read_text())
    table = report.by_key(saved["results"])
    assert set(table) == {(kind, 2) for kind in harness.DEFAULT_TRAINERS}, saved["results"]
    config = saved["config"]
    n_flat_layers = 1 + 4 * 2 + 1  # embedding block, 2 x (2 half-residuals + 2 swaps), loss
    for kind, r in table.items():
        assert r["median_step_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(
            config["batch_size"] * config["seq_len"] / r["median_step_s"])
        assert r["first_step_s"] > 0 and r["first_step_compile_s"] > 0  # summed over threads
        assert r["n_compiles_after_first_step"] == 0
        assert r["ratio_to_trainer"] == pytest.approx(
            r["median_step_s"] / table[("trainer", 2)]["median_step_s"])
        n_swaps = 2 * 2  # Their forward reorders the stack on the host: no dispatch.
        expected = 1 if kind[0].startswith("trainer") else 2 * n_flat_layers - 1 - n_swaps
        if kind[0] == "reversible" and config["scan_layers"]:  # One program each way.
            expected = 5
        assert r["n_dispatches_per_step"] == expected
    assert table[("trainer", 2)]["ratio_to_trainer"] == 1.0
    for kind, r in table.items():  # The phase breakdown and the masks alone.
        expected = {"step"} if kind[0].startswith("trainer") else {"forward", "loss",
                                                                    "backward"}
        assert set(r["phase_s"]) == expected and min(r["phase_s"].values()) >= 0
        assert r["mask_s"] > 0 and r["mask_bernoulli_s"] > 0
    assert "| ReversibleSerialTrainer | 2 |" in (tmp_path / "step_time.md").read_text().split(
        "forward (s)")[1]
    assert "| MemoryEfficientTrainer | 2 |" in (tmp_path / "step_time.md").read_text()
    assert (tmp_path / "step_time.png").read_bytes()[:4] == b"\x89PNG"


def test_targets_use_depth_16_for_ratios_and_the_deepest_for_first_steps():
    def result(trainer, depth, ratio, first):
        return {"trainer": trainer, "depth": depth, "median_step_s": ratio,
                "ratio_to_trainer": ratio, "first_step_s": first}
    results = [result("trainer", 16, 1.0, 30.0), result("trainer", 32, 1.0, 60.0),
               result("reversible", 16, 1.3, 6.0), result("reversible", 32, 1.3, 9.5),
               result("memory_efficient", 16, 2.5, 7.0), result("memory_efficient", 32, 2, 12)]
    checks = {c["target"]: (c["value"], c["met"]) for c in step_time.targets(results)}
    assert checks == {
        "ReversibleSerialTrainer first step (compile included) at depth 32 <= 10 s":
            ("9.5 s", True),
        "MemoryEfficientTrainer first step (compile included) at depth 32 <= 10 s":
            ("12.0 s", False),
        "ReversibleSerialTrainer first step at depth 32 <= 1.3x its first step at depth 16":
            ("1.58x", False),
        "ReversibleSerialTrainer step time at depth 16 <= 1.4x Trainer's": ("1.30x", True),
        "MemoryEfficientTrainer step time at depth 16 <= 2.0x Trainer's": ("2.50x", False)}


def test_rounds_pool_their_steps_and_keep_errors():
    def run(trainer, steps, first, round_):
        return {"trainer": trainer, "depth": 4, "round": round_, "batch_size": 2,
                "seq_len": 8, "step_times_s": steps, "cpu_times_s": [2 * t for t in steps],
                "others_cpu_times_s": [0.0] * len(steps), "median_step_s": steps[0],
                "first_step_s": first, "first_step_compile_s": first / 2,
                "n_compiles_after_first_step": 0}
    results = [run("trainer", [1.0, 3.0], 10.0, 0), run("reversible", [2.0], 6.0, 0),
               run("trainer", [2.0, 2.5], 20.0, 1),
               {"trainer": "memory_efficient", "depth": 4, "round": 0, "error": "boom"}]
    merged = {r["trainer"]: r for r in step_time.merge_rounds(results)}
    trainer = merged["trainer"]
    assert trainer["step_times_s"] == [1.0, 3.0, 2.0, 2.5]
    assert trainer["median_step_s"] == 2.25 and trainer["tokens_per_s"] == 16 / 2.25
    assert trainer["first_step_s"] == 15.0 and trainer["first_steps_s"] == [10.0, 20.0]
    assert trainer["n_rounds"] == 2 and "round" not in trainer
    assert merged["reversible"]["n_rounds"] == 1
    assert merged["memory_efficient"]["error"] == "boom"
    step_time.add_ratios(list(merged.values()))
    assert merged["reversible"]["ratio_to_trainer"] == 2.0 / 2.25


def test_medians_use_quiet_steps_and_ratios_compare_like_with_like():
    def result(trainer, walls, others):
        return {"trainer": trainer, "depth": 8, "batch_size": 2, "seq_len": 8,
                "step_times_s": walls, "cpu_times_s": [2 * w for w in walls],
                "others_cpu_times_s": others, "first_step_s": 9.0,
                "first_step_compile_s": 4.0, "n_dispatches_per_step": 1}
    # Two quiet steps (others used <= 10% of a core) and one contended step.
    trainer = result("trainer", [2.0, 2.2, 4.0], [0.1, 0.0, 3.9])
    reversible = result("reversible", [3.0, 3.2, 6.0], [0.0, 0.2, 5.0])
    contended = result("memory_efficient", [5.0, 7.0], [4.0, 6.0])
    results = [trainer, reversible, contended]
    step_time.add_ratios(results)
    assert trainer["median_step_s"] == 2.1 and trainer["median_step_all_s"] == 2.2
    assert trainer["n_quiet_steps"] == 2 and contended["n_quiet_steps"] == 0
    assert reversible["median_step_s"] == 3.1
    assert reversible["ratio_to_trainer"] == pytest.approx(3.1 / 2.1)
    assert reversible["cpu_ratio_to_trainer"] == pytest.approx(3.1 / 2.1)
    # No quiet step: all-step medians on both sides.
    assert contended["median_step_s"] == 6.0
    assert contended["ratio_to_trainer"] == pytest.approx(6.0 / 2.2)
    assert "6.000*" in step_time.markdown({
        "results": results, "targets": [], "config": {**trainer, **_SETTINGS},
        "machine": {"processor": "cpu", "cpu_count": 2}})


_SETTINGS = {"d_model": 8, "d_ff": 16, "n_heads": 2, "vocab_size": 16, "dropout": 0.0,
             "steps": 3, "warmup": 1}


def test_trax_reformer_preset_sets_the_sizes_no_flag_sets():
    args = step_time.apply_preset(harness.parse_flags(
        ["--preset", "trax_reformer", "--seq_len", "16", "--dropout", "0"], steps=5,
        warmup=2))
    assert (args.batch_size, args.seq_len, args.d_model, args.d_ff, args.vocab_size) == (
        8, 16, 256, 1024, 256)
    assert args.dropout == 0.0
    plain = step_time.apply_preset(harness.parse_flags([], steps=5, warmup=2))
    assert plain.preset is None and plain.seq_len == harness.MODEL_DEFAULTS["seq_len"]


def test_phase_timer_books_time_to_the_phase_each_dispatch_waits_in(monkeypatch):
    class Clock:  # The timer's clock, advanced by hand: no sleeps to match under load.
        now = 100.0

        @classmethod
        def perf_counter(cls):
            return cls.now

    monkeypatch.setattr(phases, "time", Clock)
    timer = phases.PhaseTimer()
    for label, pause in [("step_start", 0.0), ("dispatch", 0.02), ("dispatch", 0.01),
                         ("loss_start", 0.0), ("dispatch", 0.03), ("backward_start", 0.0),
                         ("dispatch", 0.04)]:
        Clock.now += pause
        if label == "dispatch":
            timer.on_dispatch("op", None, ())
        else:
            timer.on_phase(label)
    Clock.now += 0.05
    timer.finish(())
    got = dict(timer.seconds)
    # Before the loss dispatch: the forward layers (booked to "step", named forward by
    # profile_phases); waiting at the loss dispatch ends them, its own time ends at the
    # first backward dispatch.
    assert set(got) == {"step", "loss", "backward"}
    assert got["step"] == pytest.approx(0.06, abs=1e-9)
    assert got["loss"] == pytest.approx(0.04, abs=1e-9)
    assert got["backward"] == pytest.approx(0.05, abs=1e-9)


def test_mask_timing_covers_every_dropout_site_and_skips_rate_zero():
    config = {"batch_size": 2, "seq_len": 4, "d_model": 8, "d_ff": 16, "n_heads": 2,
              "depth": 3, "dropout": 0.1}
    sites = phases.mask_sites(config)
    assert len(sites) == 2 + 3 * 3 and ((2, 2, 4, 4), 0.1) in sites
    assert phases.time_masks(config | {"dropout": 0.0}) == {"mask_s": 0.0,
                                                            "mask_bernoulli_s": 0.0}
    timed = phases.time_masks(config, repeats=1)
    assert timed["mask_s"] > 0 and timed["mask_bernoulli_s"] > 0
