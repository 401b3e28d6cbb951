"""Tests of revtrain/training/run_files.py: whole files or none."""
import errno
import os

import pytest

from revtrain.training.run_files import UnreadableFileError, read_json, write_atomic


def test_write_replaces_whole_and_leaves_no_temporary_file(tmp_path):
    path = str(tmp_path / "f.json")
    write_atomic(path, '{"a": 1}')
    write_atomic(path, '{"a": 2}')
    assert read_json(path) == {"a": 2} and os.listdir(tmp_path) == ["f.json"]


def test_exclusive_write_never_replaces(tmp_path):
    path = str(tmp_path / "f")
    write_atomic(path, "first", overwrite=False)
    with pytest.raises(FileExistsError):
        write_atomic(path, "second", overwrite=False)
    assert open(path).read() == "first" and os.listdir(tmp_path) == ["f"]


def test_empty_text_is_refused(tmp_path):
    with pytest.raises(ValueError, match="refusing to write an empty"):
        write_atomic(str(tmp_path / "f"), "")
    assert os.listdir(tmp_path) == []


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = str(tmp_path / "f")
    write_atomic(path, "old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, "new")
    assert open(path).read() == "old" and os.listdir(tmp_path) == ["f"]


@pytest.mark.parametrize("content, reason", [("", "is empty"), ("{", "is not JSON")])
def test_unreadable_json_names_the_file(tmp_path, content, reason):
    (tmp_path / "f").write_text(content)
    with pytest.raises(UnreadableFileError, match=f"{tmp_path}/f {reason}"):
        read_json(str(tmp_path / "f"))
