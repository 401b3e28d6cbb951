"""Tests of revtrain/training/checkpoints/retention.py: resumed runs keep earlier runs' promises."""
import datetime

import numpy as np
import pytest

from revtrain.training import Checkpointer
from revtrain.training.checkpoints.retention import (
    promised_steps,
    read_promises,
    record_promise,
)
from revtrain.training.write_failures import RunWriteError
from tests.cli_helpers import _steps, _train
from tests.full_disk import fill_disk


def _tree(value=0.0):
    return {"weights": (np.full((2,), value, np.float32),)}


def _run(directory, steps, **retention):
    checkpointer = Checkpointer(str(directory), **retention)
    for step in steps:
        checkpointer.save(step, _tree(step))
    kept = checkpointer.all_steps()
    checkpointer.close()
    return kept


@pytest.mark.parametrize("resumed, kept", [
    ({"max_to_keep": 1}, [2, 4, 7]),  # The README's resume command: no keep_period.
    ({"max_to_keep": 1, "keep_period": 3}, [2, 4, 6, 7]),
    ({"max_to_keep": 2, "keep_time_interval": 3600.0}, [2, 4, 6, 7]),
])
def test_resumed_run_with_other_retention_keeps_what_was_promised(tmp_path, resumed, kept):
    assert _run(tmp_path, range(1, 6), max_to_keep=1, keep_period=2) == [2, 4, 5]
    assert _run(tmp_path, [6, 7], **resumed) == kept


def test_time_interval_promise_keeps_the_checkpoints_it_covered(tmp_path):
    first = _run(tmp_path, [1, 2, 3], max_to_keep=1,
                 keep_time_interval=datetime.timedelta(hours=1))
    assert first == [1, 3]
    assert _run(tmp_path, [4, 5], max_to_keep=1) == [1, 3, 5]
    assert read_promises(str(tmp_path)) == [
        {"keep_period": None, "keep_time_interval": 3600.0, "last_step": 3}]


def test_promised_steps_stop_at_the_promising_run_last_step():
    promises = [{"keep_period": 2, "keep_time_interval": None, "last_step": 5}]
    assert promised_steps(promises, [1, 2, 4, 5, 6, 8]) == [2, 4]


def test_cli_resume_without_keep_period_keeps_permanent_checkpoints(tmp_path):
    out = str(tmp_path)
    first = ("train.steps=5", "CheckpointConfig.every=1", "EvalConfig.steps=0",
             "CheckpointConfig.max_to_keep=1")
    assert _train(out, *first, "CheckpointConfig.keep_period=2") == 0
    assert _steps(out) == [2, 4, 5]
    assert _train(out, "train.steps=7", *first[1:]) == 0
    assert _steps(out) == [2, 4, 7]


@pytest.mark.parametrize("damage, reason", [
    ("", "is empty"),
    ('{"promises": [{"keep_period": 2, "last', "is not JSON"),
    ('{"promises": [{"keep_period": 2}]}', "is not a retention record (KeyError"),
    ("[]", "is not a retention record (TypeError"),
    # Values CheckpointConfig refuses (a keep_period of 0 divided by zero).
    ('{"promises": [{"keep_period": 0, "keep_time_interval": null, "last_step": 5}]}',
     "is not a retention record (ValueError: keep_period=0 must be an integer >= 1"),
    ('{"promises": [{"keep_period": null, "keep_time_interval": -1, "last_step": 5}]}',
     "is not a retention record (ValueError: keep_time_interval=-1.0 seconds must be > 0"),
    ('{"promises": [{"keep_period": 2, "keep_time_interval": null, "last_step": -1}]}',
     "is not a retention record (ValueError: last_step=-1 must be >= 0"),
])
def test_damaged_record_keeps_every_checkpoint_warns_and_is_rebuilt(tmp_path, caplog,
                                                                    damage, reason):
    import logging

    assert _run(tmp_path, range(1, 6), max_to_keep=1, keep_period=2) == [2, 4, 5]
    record = tmp_path / "retention.json"
    record.write_text(damage)
    with caplog.at_level(logging.WARNING):
        assert _run(tmp_path, [6, 7], max_to_keep=1) == [2, 4, 5, 7]
    [warning] = [r.getMessage() for r in caplog.records if "retention.json" in r.getMessage()]
    assert warning.startswith(f"{record} {reason}") and "up to step 5" in warning, warning
    assert read_promises(str(tmp_path)) == [
        {"keep_period": None, "keep_time_interval": None, "keep_all": True, "last_step": 5}]
    assert _run(tmp_path, [8], max_to_keep=1) == [2, 4, 5, 8]  # Read back without warning.


def test_a_full_disk_while_recording_a_promise_is_one_line_and_the_record_is_kept(
        tmp_path, monkeypatch):
    assert _run(tmp_path, [2, 4], max_to_keep=None, keep_period=2) == [2, 4]
    before = (tmp_path / "retention.json").read_text()
    fill_disk(monkeypatch, "retention.json")
    with pytest.raises(RunWriteError) as error:
        record_promise(str(tmp_path), read_promises(str(tmp_path)), 2, None, 6)
    assert str(error.value) == (
        f"could not write {tmp_path}/retention.json: the disk is full (No space left on "
        f"device); the newest checkpoint, step 4, is intact; free space and run the same "
        f"command to resume")
    assert (tmp_path / "retention.json").read_text() == before
