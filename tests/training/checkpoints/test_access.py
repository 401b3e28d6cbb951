"""Tests of revtrain/training/checkpoints/access.py: a step directory this user may not
read is named with its permission problem, and a run that saves refuses it before it
trains.

The tests often run as root, whom file modes do not stop: `_deny` chmods the directory
and, as root, also makes ``os.access`` answer for it as it would for another user (the
check's only question to the file system), so the same test holds for both.
"""
import json
import logging
import os

import numpy as np
import pytest

from revtrain.training.checkpoints import Checkpointer, CheckpointPermissionError
from revtrain.training.checkpoints.access import access_problem, check_checkpoint_access
from tests.cli_helpers import _steps, _train


def _deny(monkeypatch, path):
    """Takes every right on ``path`` (and, as root, everything under it) from this user."""
    path = os.path.abspath(path)
    mode = os.stat(path).st_mode
    os.chmod(path, 0)
    if os.geteuid() == 0:
        real = os.access

        def access(entry, mode, *args, **kwargs):
            entry = os.path.abspath(entry)
            if entry == path or entry.startswith(path + os.sep):
                return False
            return real(entry, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", access)
    return lambda: os.chmod(path, mode)


def test_access_problem_names_the_entry_and_its_mode(tmp_path, monkeypatch):
    step = tmp_path / "checkpoints" / "4"
    (step / "default").mkdir(parents=True)
    assert access_problem(str(step), write=True) is None
    assert access_problem(str(tmp_path / "none")) is None
    restore = _deny(monkeypatch, step / "default")
    try:
        problem = access_problem(str(step))
        assert problem.startswith(f"permission denied: this user needs read and search "
                                  f"rights (r-x) on {step}/default (mode d---------, owner "
                                  f"uid "), problem
        with pytest.raises(CheckpointPermissionError) as e:
            check_checkpoint_access(str(tmp_path / "checkpoints"))
        assert str(e.value).startswith(f"the checkpoint {step} cannot be read or replaced: "
                                       f"permission denied")
        assert str(e.value).endswith(f"or move it out of {tmp_path}/checkpoints, then run "
                                     f"the same command; nothing was trained")
    finally:
        restore()


@pytest.fixture
def run_to_4(tmp_path):
    out = tmp_path / "run"
    assert _train(out, "train.steps=4", "CheckpointConfig.every=2") == 0
    assert _steps(out) == [2, 4]
    return out


def test_an_unreadable_newest_step_stops_training_before_a_step(run_to_4, monkeypatch,
                                                                 capsys):
    metrics = (run_to_4 / "metrics.jsonl").read_text()
    restore = _deny(monkeypatch, run_to_4 / "checkpoints" / "4")
    capsys.readouterr()
    try:
        assert _train(run_to_4, "train.steps=8", "CheckpointConfig.every=2") == 1
    finally:
        restore()
        monkeypatch.undo()
    [line] = capsys.readouterr().err.strip().splitlines()
    step_dir = run_to_4 / "checkpoints" / "4"
    assert line.startswith(f"revtrain-train: error: CheckpointPermissionError: the checkpoint "
                           f"{step_dir} cannot be read or replaced: permission denied: this "
                           f"user needs read, write and search rights (rwx) on {step_dir} "
                           f"(mode d---------"), line
    assert "empty or partly deleted" not in line
    assert (run_to_4 / "metrics.jsonl").read_text() == metrics  # Nothing trained.
    assert _steps(run_to_4) == [2, 4]
    assert not (run_to_4 / "run.lock").exists()
    assert _train(run_to_4, "train.steps=6", "CheckpointConfig.every=2") == 0  # Fixed.
    assert [json.loads(m)["step"] for m in (run_to_4 / "metrics.jsonl").read_text(
        ).splitlines()][-1] == 6


def test_a_reader_skips_an_unreadable_step_naming_the_permission_problem(
        tmp_path, monkeypatch, caplog):
    """A read-only reader (revtrain-eval, revtrain-decode, a warm start's source) changes
    nothing, so it takes the previous step, with the true reason."""
    directory = tmp_path / "checkpoints"
    writer = Checkpointer(str(directory))
    for step in (1, 2):
        writer.save(step, {"w": np.full((2,), step, np.float32)})
    writer.close()
    restore = _deny(monkeypatch, directory / "2")
    try:
        reader = Checkpointer(str(directory), read_only=True)
        with caplog.at_level(logging.WARNING):
            tree = reader.restore({"w": np.zeros((2,), np.float32)})
        reader.close()
    finally:
        restore()
    assert reader.restored_step == 1 and tree["w"].tolist() == [1.0, 1.0]
    assert (f"skipping the checkpoint {directory}/2: it cannot be read (CheckpointPermission"
            f"Error: permission denied: this user needs read and search rights (r-x) on "
            f"{directory}/2 (mode d---------") in caplog.text
    assert "empty or partly deleted" not in caplog.text


@pytest.mark.parametrize("entry", ["tensorboard/train", "metrics.jsonl"])
def test_a_run_file_this_user_may_not_write_stops_training_before_a_step(
        run_to_4, monkeypatch, capsys, entry):
    metrics = (run_to_4 / "metrics.jsonl").read_text()
    restore = _deny(monkeypatch, run_to_4 / entry)
    capsys.readouterr()
    try:
        assert _train(run_to_4, "train.steps=8", "CheckpointConfig.every=2") == 1
    finally:
        restore()
        monkeypatch.undo()
    [line] = capsys.readouterr().err.strip().splitlines()
    rights = "read, write and search rights (rwx)" if "/" in entry else \
        "read and write rights (rw-)"
    assert line.startswith(f"revtrain-train: error: CheckpointPermissionError: the run "
                           f"directory {run_to_4} cannot be written: permission denied: this "
                           f"user needs {rights} on {run_to_4}/{entry} (mode "), line
    assert (run_to_4 / "metrics.jsonl").read_text() == metrics
    assert _steps(run_to_4) == [2, 4]
