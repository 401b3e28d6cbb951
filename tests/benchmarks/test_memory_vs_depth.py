"""benchmarks/memory_vs_depth.py: runs end to end at tiny sizes; targets and tables."""
import json

import pytest
from absl import flags

from benchmarks import harness, memory_vs_depth, report

pytestmark = pytest.mark.slow


def test_runs_every_trainer_in_worker_processes_and_writes_outputs(quick_args, tmp_path):
    # A batch that splits over the FSDP devices, and kernels big enough to be sharded.
    payload = memory_vs_depth.main(quick_args + ["--batch_size", "4", "--d_model", "32",
                                                 "--d_ff", "64"])
    saved = json.loads((tmp_path / "memory_vs_depth.json").read_text())
    assert saved["results"] == json.loads(json.dumps(payload["results"]))
    table = report.by_key(saved["results"])
    assert set(table) == {(kind, 2) for kind in harness.available_trainers()}, saved["results"]
    assert set(harness.FSDP_KINDS) <= set(harness.available_trainers())
    for r in table.values():
        assert r["method"] == "ledger"
        assert r["peak_bytes"] > 0 and r["weights_and_slots_bytes"] > 0 and r["rest_bytes"] > 0
        assert r["weights_and_slots_bytes"] + r["rest_bytes"] == r["peak_bytes"]
        assert r["peak_rss_bytes"] > r["peak_bytes"]
    # Trainer and ReversibleSerialTrainer hold the whole model; MemoryEfficientTrainer a few
    # layers of it.
    for kind in ("trainer", "reversible"):
        r = table[(kind, 2)]
        assert r["weights_and_slots_bytes"] == r["model_weights_and_slots_bytes"]
    met = table[("memory_efficient", 2)]
    assert met["weights_and_slots_bytes"] < met["model_weights_and_slots_bytes"]
    assert table[("reversible", 2)]["peak_bytes"] < table[("trainer", 2)]["peak_bytes"]
    # FSDP on 4 devices: a quarter of the sharded weights and slots, and of the batch.
    fsdp = table[("trainer_fsdp", 2)]
    assert fsdp["n_devices"] == harness.FSDP_DEVICES
    assert fsdp["weights_and_slots_bytes"] < 0.5 * table[("trainer", 2)]["weights_and_slots_bytes"]
    assert fsdp["peak_bytes"] < table[("trainer", 2)]["peak_bytes"]
    markdown = (tmp_path / "memory_vs_depth.md").read_text()
    assert "| ReversibleSerialTrainer | 2 |" in markdown
    assert (tmp_path / "memory_vs_depth.png").read_bytes()[:4] == b"\x89PNG"


def _result(trainer, depth, peak, rest):
    return {"trainer": trainer, "depth": depth, "peak_bytes": peak, "rest_bytes": rest,
            "weights_and_slots_bytes": peak - rest, "peak_rss_bytes": 2 * peak,
            "method": "ledger"}


def test_targets_compare_the_shallowest_and_deepest_depths():
    results = [_result("trainer", 2, 1000, 800), _result("trainer", 32, 10_000, 9000),
               _result("reversible", 2, 300, 100), _result("reversible", 32, 2400, 109),
               _result("memory_efficient", 2, 100, 90), _result("memory_efficient", 32, 130, 95)]
    checks = {c["target"]: c for c in memory_vs_depth.targets(results)}
    ratio = checks["ReversibleSerialTrainer peak <= 0.25x Trainer's at depth 32"]
    assert ratio["value"] == "0.240x" and ratio["met"]
    growth = checks["ReversibleSerialTrainer non-weight part grows < 10% from depth 2 to 32"]
    assert growth["value"] == "+9.0%" and growth["met"]
    flat = checks["MemoryEfficientTrainer peak at depth 32 <= 1.2x depth 2"]
    assert flat["value"] == "1.300x" and not flat["met"]
    sharded = memory_vs_depth.targets(results + [_result("trainer_fsdp", 32, 3000, 2500)])
    fsdp = {c["target"]: c for c in sharded}[
        "Trainer + FSDP weights+slots per device <= 0.3x Trainer's at depth 32"]
    assert fsdp["value"] == "0.500x" and not fsdp["met"]


def test_failed_worker_is_reported_not_raised(tmp_path):
    config = {"trainer": "reversible", "depth": 1, "d_model": 6, "d_ff": 8, "n_heads": 4,
              "seq_len": 4, "batch_size": 2, "vocab_size": 8, "dropout": 0.0, "steps": 1,
              "warmup": 1, "seed": 0, "n_devices": 1, "compilation_cache_dir": None}
    result = harness.run_worker(memory_vs_depth.__file__, config, timeout=120)
    assert "d_feature=6 is not divisible by n_heads=4" in result["error"]
    payload = {"results": [result], "config": config, "targets": [],
               "machine": {"processor": "cpu", "cpu_count": 2}}
    assert "ReversibleSerialTrainer depth 1: worker exited" in memory_vs_depth.markdown(payload)


def test_quick_defaults_and_explicit_flags(tmp_path):
    args = harness.parse_flags(["--quick", "--d_model", "64"], steps=1, warmup=1)
    assert (args.depths, args.d_model, args.d_ff, args.seq_len) == ([2, 4], 64, 64, 32)
    assert args.out_dir == harness.QUICK_RESULTS_DIR and args.steps == 1
    args = harness.parse_flags(["--depths", "2,32", "--trainers", "reversible"], 5, 2)
    assert (args.depths, args.trainers, args.d_model) == ([2, 32], ["reversible"], 256)
    assert (args.steps, args.warmup, args.quick) == (5, 2, False)  # Nothing left over.
    for bad in (["--trainers", "adam"], ["--depths", "2,0"], ["--jobs", "0"], ["--nope"]):
        with pytest.raises(flags.Error):
            harness.parse_flags(bad, steps=1, warmup=1)


def test_rendering_records_the_host_allocator_the_workers_used(tmp_path):
    # A run whose workers did not all tune the allocator (here: the first four rows of the
    # committed run, marked as if a worker had found MALLOC_ARENA_MAX set) says both.
    saved = json.loads((harness.RESULTS_DIR / "memory_vs_depth.json").read_text())
    for row in saved["results"][:4]:
        row["host_allocator"] = "system"
    saved["config"]["host_allocator"] = "tuned"  # What the parent asked for.
    saved["config"]["scan_layers"] = True
    (tmp_path / "memory_vs_depth.json").write_text(json.dumps(saved))
    payload = memory_vs_depth.main(["--render_only", "--out_dir", str(tmp_path)])
    assert payload["config"]["host_allocator"] == "system, tuned"
    markdown = (tmp_path / "memory_vs_depth.md").read_text()
    assert "host allocator system, tuned," in markdown
    assert "ReversibleSerialTrainer's runs scanned;" in markdown  # config["scan_layers"]
