"""Tests of revtrain/training/write_failures.py: one line for every failed write of a run."""
import errno

import pytest

from revtrain.training.write_failures import (
    RunWriteError,
    is_disk_full,
    reporting_write_failures,
    write_failure,
)
from tests.full_disk import no_space


def test_the_line_names_what_the_cause_the_newest_intact_checkpoint_and_the_fix(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for name in ("2", "6", "8.orbax-checkpoint-tmp-1"):  # A save in progress is no step.
        (checkpoints / name).mkdir(parents=True)
    assert write_failure("write x", no_space(), str(checkpoints)) == (
        "could not write x: the disk is full (No space left on device); the newest "
        "checkpoint, step 6, is intact; free space and run the same command to resume")
    assert write_failure("save y", no_space(), str(checkpoints), before_step=6,
                         then="retry") == (
        "could not save y: the disk is full (No space left on device); the newest "
        "checkpoint, step 2, is intact; free space and retry")
    denied = PermissionError(errno.EACCES, "Permission denied")
    assert write_failure("write x", denied, str(tmp_path / "none")) == (
        "could not write x: PermissionError: [Errno 13] Permission denied; no checkpoint is "
        "saved yet; fix the cause and run the same command to resume")


def test_a_full_disk_is_recognised_in_tensorstore_text_too():
    assert is_disk_full(no_space())
    assert is_disk_full(ValueError("OUT_OF_RANGE: ... No space left on device [source..."))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))


def test_reporting_turns_an_oserror_into_one_run_write_error_and_passes_the_rest(tmp_path):
    with pytest.raises(RunWriteError, match="^could not write f: the disk is full") as error:
        with reporting_write_failures("write f", str(tmp_path)):
            raise no_space()
    assert isinstance(error.value.__cause__, OSError)
    with pytest.raises(RunWriteError, match="^inner$"):  # Reported once, not twice.
        with reporting_write_failures("write outer", str(tmp_path)):
            raise RunWriteError("inner")
    with pytest.raises(ValueError, match="^not a write$"):
        with reporting_write_failures("write f", str(tmp_path)):
            raise ValueError("not a write")
