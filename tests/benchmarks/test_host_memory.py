"""benchmarks/host_memory.py: runs end to end at tiny sizes, each trainer in a fresh process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags

from benchmarks import harness, host_memory, report

pytestmark = pytest.mark.slow


def test_reports_peak_rss_and_step_time_per_trainer_and_passes_the_environment(
        quick_args, tmp_path):
    payload = host_memory.main(quick_args + ["--env", "MALLOC_ARENA_MAX=2"])
    saved = json.loads((tmp_path / "host_memory.json").read_text())
    assert saved["results"] == json.loads(json.dumps(payload["results"]))
    table = report.by_key(saved["results"])
    assert set(table) == {("reversible", 2), ("memory_efficient", 2)}, saved["results"]
    for r in table.values():
        assert r["peak_rss_bytes"] >= r["rss_end_bytes"] > 0
        assert r["peak_rss_bytes"] >= r["rss_after_build_bytes"] > 0
        assert set(r["phase_rss_bytes"]) >= {"step_start", "loss_start", "backward_start",
                                             "step_end"}
        assert r["median_step_s"] > 0
        assert r["env"] == {"MALLOC_ARENA_MAX": "2"}  # The worker saw it...
        assert r["host_allocator"] == "system"  # ...and left the allocator to it.
    assert saved["config"]["host_allocator"] == "system"
    markdown = (tmp_path / "host_memory.md").read_text()
    assert "| MemoryEfficientTrainer | 2 |" in markdown and "MALLOC_ARENA_MAX=2" in markdown
    assert "host allocator system, ReversibleSerialTrainer's runs scanned" in markdown


def test_the_recorded_host_allocator_is_what_the_workers_did():
    config = {"d_model": 32, "host_allocator": "tuned"}  # What the parent asked for.
    failed = {"error": "timeout"}
    assert harness.with_workers_host_allocator(
        config, [{"host_allocator": "system"}, failed]) == {"d_model": 32,
                                                             "host_allocator": "system"}
    assert harness.with_workers_host_allocator(
        config, [{"host_allocator": "tuned"}, {"host_allocator": "system"}]
    )["host_allocator"] == "system, tuned"
    assert harness.with_workers_host_allocator(config, [failed]) == config
    assert harness.with_workers_host_allocator(  # A result from before the field: system.
        config, [{"host_allocator": "tuned"}, {"depth": 2}])["host_allocator"] == "system, tuned"
    assert config["host_allocator"] == "tuned"  # Not modified in place.


def test_a_bad_host_allocator_is_one_line_before_any_worker_starts():
    script = Path(host_memory.__file__)
    env = dict(os.environ, REVTRAIN_HOST_ALLOCATOR="fast")
    done = subprocess.run([sys.executable, str(script), "--quick"], env=env,
                          capture_output=True, text=True, timeout=120,
                          cwd=script.parent.parent)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("host_memory.py: error: REVTRAIN_HOST_ALLOCATOR='fast'")
    assert done.stderr.strip().count("\n") == 0, done.stderr


@pytest.mark.parametrize("item, message", [
    ("FOO", "'FOO' is not NAME=VALUE"),
    ("REVTRAIN_HOST_ALLOCATOR=fast", "REVTRAIN_HOST_ALLOCATOR='fast' is not 'tuned'")])
def test_a_bad_worker_environment_is_a_flag_error_before_any_worker_starts(
        item, message, tmp_path):
    with pytest.raises(flags.IllegalFlagValueError, match=message):
        host_memory.main(["--quick", "--env", item, "--out_dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())
