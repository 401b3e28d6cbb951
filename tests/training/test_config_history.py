"""Tests of revtrain/training/config_history.py: every run's config is kept."""
import datetime
import os

import pytest

from revtrain.training.config_history import write_run_config
from revtrain.training.run_directory import HISTORY_DIR
from revtrain.training.write_failures import RunWriteError
from tests.cli_helpers import _train
from tests.full_disk import fill_disk


def test_history_keeps_each_run_and_config_gin_is_the_latest(tmp_path):
    first = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    write_run_config(str(tmp_path), "a = 1\n", first)
    write_run_config(str(tmp_path), "a = 2\n", first + datetime.timedelta(seconds=1))
    history = sorted(os.listdir(tmp_path / HISTORY_DIR))
    assert history == ["20260102T030405.000000Z.gin", "20260102T030406.000000Z.gin"]
    assert [(tmp_path / HISTORY_DIR / h).read_text() for h in history] == ["a = 1\n",
                                                                          "a = 2\n"]
    assert (tmp_path / "config.gin").read_text() == "a = 2\n"


def test_resumed_run_with_other_bindings_keeps_the_earlier_config(tmp_path):
    out = str(tmp_path)
    assert _train(out, "train.steps=2", "EvalConfig.steps=0") == 0
    assert _train(out, "train.steps=4", "EvalConfig.steps=0") == 0
    texts = [(tmp_path / HISTORY_DIR / h).read_text()
             for h in sorted(os.listdir(tmp_path / HISTORY_DIR))]
    assert ["train.steps = 2" in t for t in texts] == [True, False]
    assert "train.steps = 4" in texts[1]
    assert (tmp_path / "config.gin").read_text() == texts[1]


@pytest.mark.parametrize("full, path", [
    ("Z.gin", "config_history/20260102T030405.000000Z.gin"), ("config.gin", "config.gin")])
def test_a_full_disk_is_one_line_and_config_gin_is_kept(tmp_path, monkeypatch, full, path):
    write_run_config(str(tmp_path), "a = 1\n")
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    fill_disk(monkeypatch, full)
    with pytest.raises(RunWriteError) as error:
        write_run_config(str(tmp_path), "a = 2\n",
                         datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC))
    assert str(error.value) == (
        f"could not write {tmp_path}/{path}: the disk is full (No space left on device); "
        f"the newest checkpoint, step 4, is intact; free space and run the same command to "
        f"resume")
    assert (tmp_path / "config.gin").read_text() == "a = 1\n"
