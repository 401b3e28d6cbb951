"""Tests of revtrain/training/run_lock.py."""
import json
import logging
import os
import shutil
import socket
import subprocess
import sys

import pytest

from revtrain.training import read_metrics
from revtrain.training.run_directory import LOCK_FILE
from revtrain.training.run_lock import RunLock, RunLockError
from revtrain.training.write_failures import RunWriteError
from tests.cli_helpers import COPY_TASK, TINY, _checkpoint, _steps


def _write_lock(directory, **owner):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, LOCK_FILE), "w") as f:
        json.dump(owner, f)


def test_second_lock_on_one_directory_is_refused_and_release_frees_it(tmp_path):
    with RunLock(str(tmp_path)):
        assert os.path.isfile(tmp_path / LOCK_FILE)
        with pytest.raises(RunLockError, match=rf"in use by process {os.getpid()} on host"):
            RunLock(str(tmp_path)).acquire()
    assert not os.path.exists(tmp_path / LOCK_FILE)
    with RunLock(str(tmp_path)):
        pass


def test_lock_of_a_dead_process_on_this_host_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(tmp_path, pid=dead.pid, host=socket.gethostname(), started=0.0)
    with caplog.at_level(logging.WARNING), RunLock(str(tmp_path)):
        with open(tmp_path / LOCK_FILE) as f:
            assert json.load(f)["pid"] == os.getpid()
    assert f"from process {dead.pid} on host" in caplog.text


def test_lock_of_a_reused_pid_is_taken_over(tmp_path):
    # Our own pid with another start time: the process that wrote it is gone.
    _write_lock(tmp_path, pid=os.getpid(), host=socket.gethostname(), started=1.0)
    with RunLock(str(tmp_path)):
        pass


def test_lock_from_another_host_says_how_to_force_it(tmp_path):
    _write_lock(tmp_path, pid=1, host="other-host.example", started=0.0)
    with pytest.raises(RunLockError, match=r"process 1 on host other-host.example; if that "
                                           r"run has ended, delete .*run.lock to force it"):
        RunLock(str(tmp_path)).acquire()


def test_output_dir_that_is_a_file_is_refused_without_writing(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    with pytest.raises(RunLockError, match="is a file, not a directory"):
        RunLock(str(path)).acquire()
    assert os.listdir(tmp_path) == ["a_file"]


@pytest.mark.parametrize("under", [False, True], ids=["the_link", "under_the_link"])
def test_output_dir_that_is_a_broken_link_names_the_link_and_its_target(tmp_path, under):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone" / "run")
    output_dir = link / "sub" if under else link
    where = f" ({link} in it)" if under else ""
    with pytest.raises(RunLockError) as e:
        RunLock(str(output_dir)).acquire()
    assert str(e.value) == (f"--output_dir={output_dir}{where} is a symbolic link to "
                            f"{tmp_path}/gone/run, which does not exist; create "
                            f"{tmp_path}/gone/run, or give a --output_dir that is not a "
                            f"broken link")
    assert os.listdir(tmp_path) == ["link"]


def test_directory_created_for_the_lock_is_removed_when_left_empty(tmp_path):
    new = tmp_path / "new" / "run"
    with RunLock(str(new)):
        assert os.path.isdir(new)
    assert os.listdir(tmp_path) == []
    with RunLock(str(new)):
        (new / "kept").write_text("x")
    assert os.listdir(new) == ["kept"]


def test_two_concurrent_trains_on_one_directory_refuse_the_second(tmp_path):
    out = str(tmp_path)
    script = shutil.which("revtrain-train", path=os.path.dirname(sys.executable))
    argv = [script, f"--config_file={COPY_TASK}", f"--output_dir={out}"]
    argv += [f"--gin_bindings={b}" for b in TINY + ["train.steps=100000",
                                                    "CheckpointConfig.every=2"]]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in first.stderr:  # Training has started: the first holds the lock.
        if " train: loss" in line:
            break
    second = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    first.terminate()
    _, err = first.communicate(timeout=120)
    assert first.returncode == 128 + 15, err
    assert second.returncode == 1
    assert second.stderr.strip().splitlines() == [
        f"revtrain-train: error: RunLockError: {out} is in use by process {first.pid} on "
        f"host {socket.gethostname()}; wait for it to end or use another --output_dir "
        f"(rerun with --traceback for details)"]
    steps = [r["step"] for r in read_metrics(out, "train")]
    assert steps == sorted(set(steps))  # One writer: no interleaved metrics.
    latest = max(_steps(out))
    assert latest >= 2 and int(_checkpoint(out, latest)["step"]) == latest
    assert not os.path.exists(os.path.join(out, LOCK_FILE))


@pytest.mark.parametrize("content, reason", [
    ("", "it is empty"), ('{"pid": 12', "it is not JSON"),
    ("[1, 2]", "it holds a JSON list, not an owner record"),
    ('{"pid": "x"}', "it names no owner"),
])
def test_unreadable_lock_file_is_taken_over_with_a_warning(tmp_path, caplog, content,
                                                           reason):
    (tmp_path / LOCK_FILE).write_text(content)
    with caplog.at_level(logging.WARNING), RunLock(str(tmp_path)):
        with open(tmp_path / LOCK_FILE) as f:
            assert json.load(f)["pid"] == os.getpid()
    [warning] = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert warning.startswith(f"took over {tmp_path / LOCK_FILE}: it was unreadable "
                              f"({reason}")
    assert not os.path.exists(tmp_path / LOCK_FILE)


def test_lock_on_a_full_disk_leaves_no_lock_file_behind(tmp_path, monkeypatch):
    import errno

    real_open = open

    def full_disk_open(path, mode="r", *args, **kwargs):
        if LOCK_FILE in os.fspath(path) and "x" in mode:  # The lock's temporary file.
            f = real_open(path, mode, *args, **kwargs)
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_disk_open)
    new = tmp_path / "run"
    with pytest.raises(RunWriteError) as error:  # The line of every file of a run.
        RunLock(str(new)).acquire()
    assert str(error.value) == (
        f"could not write {new}/run.lock: the disk is full (No space left on device); no "
        f"checkpoint is saved yet; free space and run the same command to resume")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []  # No 0-byte lock, and the new directory is gone.
