"""benchmarks/provenance.py: every result set records when, where and by what command."""
import sys

import pytest

from benchmarks import provenance, report

pytestmark = pytest.mark.slow


def test_machine_info_records_date_machine_versions_commit_and_command():
    info = provenance.machine_info("python benchmarks/step_time.py --depths 16")
    assert info["date"].endswith("+00:00") and info["cpu_count"] >= 1
    assert {"platform", "processor", "python", "jax", "revtrain", "commit"} <= set(info)
    assert info["command"] == "python benchmarks/step_time.py --depths 16"
    assert "command" not in provenance.machine_info()


def test_command_line_is_the_shell_command_or_the_in_process_call(monkeypatch):
    script = str(provenance.ROOT / "benchmarks" / "step_time.py")
    monkeypatch.setattr(sys, "argv", [script, "--depths", "16", "--trainers", "a,b c"])
    assert provenance.command_line(None) == (
        "python benchmarks/step_time.py --depths 16 --trainers 'a,b c'")
    assert provenance.command_line(["--quick"]) == "main(['--quick'])"


def test_settings_line_says_whether_the_runs_were_scanned():
    base = {"d_model": 8, "d_ff": 16, "n_heads": 2, "seq_len": 4, "batch_size": 2,
            "vocab_size": 32, "dropout": 0.0}
    assert report.settings_line(base | {"scan_layers": True}).endswith(
        "ReversibleSerialTrainer's runs scanned")
    assert report.settings_line(base | {"scan_layers": False}).endswith(
        "ReversibleSerialTrainer one program per layer (--noscan_layers)")
    # A result set from before the switch existed says nothing rather than guess.
    assert "ReversibleSerialTrainer" not in report.settings_line(base)


def test_settings_line_labels_only_the_modes_of_trainers_that_ran():
    base = {"d_model": 8, "d_ff": 16, "n_heads": 2, "seq_len": 4, "batch_size": 2,
            "vocab_size": 16, "dropout": 0.0, "scan_layers": True, "scan_window": 2}
    both = report.settings_line(base)
    assert "runs scanned" in both and "windows of 2" in both
    windows_only = report.settings_line(base, ["memory_efficient", "trainer"])
    assert "ReversibleSerialTrainer" not in windows_only and "windows of 2" in windows_only
    scan_only = report.settings_line(base, ["reversible_fsdp"])
    assert "runs scanned" in scan_only and "windows" not in scan_only
