"""Tests of revtrain/training/checkpoints/readable.py: reading beside a run that saves."""
import logging
import os

import numpy as np
import pytest

from revtrain.training import Checkpointer
from revtrain.training.checkpoints.readable import (
    CheckpointUnreadableError,
    CheckpointVanishedError,
    newest_readable,
)


def _tree(value):
    return {"weights": (np.full((3, 2), value, np.float32),), "state": (),
            "step": np.asarray(value)}


def _saving_during_reads(monkeypatch, reader, writer, steps):
    """Each of the reader's first reads lets ``writer`` (max_to_keep=1) save the next of
    ``steps`` first, deleting the checkpoint being read: a training run beside it."""
    pending = list(steps)
    restore = reader._manager.restore

    def save_then_restore(step, *args, **kwargs):
        if pending:
            writer.save(pending.pop(0), _tree(10))
        return restore(step, *args, **kwargs)

    monkeypatch.setattr(reader._manager, "restore", save_then_restore)


@pytest.mark.parametrize("read", ["restore", "restore_values"])
def test_a_checkpoint_deleted_while_read_makes_the_directory_listed_again(
        tmp_path, monkeypatch, caplog, read):
    directory = str(tmp_path / "checkpoints")
    writer = Checkpointer(directory, max_to_keep=1)
    writer.save(1, _tree(1))
    reader = Checkpointer(directory, max_to_keep=None, read_only=True)
    _saving_during_reads(monkeypatch, reader, writer, [2, 3])
    with caplog.at_level(logging.WARNING):
        if read == "restore":
            tree = reader.restore(_tree(0))
        else:
            tree = reader.restore_values({"weights": _tree(0)["weights"]})
    assert reader.restored_step == 3 and reader.unreadable_steps == []
    np.testing.assert_array_equal(tree["weights"][0], np.full((3, 2), 10, np.float32))
    vanished = [r.getMessage() for r in caplog.records if "deleted while" in r.getMessage()]
    assert vanished == [f"the checkpoint {directory}/{s} was deleted while it was read; "
                        f"reading the newest one again" for s in (1, 2)]
    reader.close()
    writer.close()


def test_damaged_steps_are_skipped_and_reported_and_endless_deletions_bounded(tmp_path):
    directory = str(tmp_path)

    def read(step):
        if step == 3:
            raise ValueError("cut short")
        return {"step": step}

    assert newest_readable(directory, lambda: [1, 2, 3], read) == (2, {"step": 2}, [3])
    with pytest.raises(CheckpointUnreadableError, match=r"none of the 2 checkpoints in .* "
                       r"can be read; the newest, .*/3, fails with ValueError: cut short"):
        newest_readable(directory, lambda: [2, 3], lambda step: read(3))
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        newest_readable(directory, list, read)
    listed = iter(range(1000))

    def vanish(step):
        raise CheckpointVanishedError(os.path.join(directory, str(step)))

    with pytest.raises(CheckpointUnreadableError, match="deletes them faster than they can "
                       "be read; pass the step of a kept checkpoint"):
        newest_readable(directory, lambda: [next(listed)], vanish)
