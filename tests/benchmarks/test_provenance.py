"""benchmarks/provenance.py: every result set records when, where and by what command."""
import sys

from benchmarks import provenance


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
