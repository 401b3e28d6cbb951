"""benchmarks/host_memory.py: runs end to end at tiny sizes, each trainer in a fresh process."""
import json

from benchmarks import harness, host_memory


def test_reports_peak_rss_and_step_time_per_trainer_and_passes_the_environment(
        quick_args, tmp_path):
    payload = host_memory.main(quick_args + ["--env", "MALLOC_ARENA_MAX=2"])
    saved = json.loads((tmp_path / "host_memory.json").read_text())
    assert saved["results"] == json.loads(json.dumps(payload["results"]))
    table = harness.by_key(saved["results"])
    assert set(table) == {("reversible", 2), ("memory_efficient", 2)}, saved["results"]
    for r in table.values():
        assert r["peak_rss_bytes"] >= r["rss_end_bytes"] > 0
        assert r["peak_rss_bytes"] >= r["rss_after_build_bytes"] > 0
        assert set(r["phase_rss_bytes"]) >= {"step_start", "loss_start", "backward_start",
                                             "step_end"}
        assert r["median_step_s"] > 0
        assert r["env"] == {"MALLOC_ARENA_MAX": "2"}  # The worker saw it.
    markdown = (tmp_path / "host_memory.md").read_text()
    assert "| MemoryEfficientTrainer | 2 |" in markdown and "MALLOC_ARENA_MAX=2" in markdown
