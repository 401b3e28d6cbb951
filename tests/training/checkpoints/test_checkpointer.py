"""Tests of revtrain/training/checkpoints/checkpointer.py: save/restore, checks, retention,
atomicity."""
import datetime
import logging
import os

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from revtrain.training.checkpoints import trees as checkpoint_trees
from revtrain.training.checkpoints.checkpointer import Checkpointer, CheckpointSaveError
from tests.tree_utils import assert_trees_close


def _tree(scale=1.0, width=3):
    weights = ((np.full((2, width), scale, np.float32), ()), (), {"b": np.arange(2.0)})
    slots = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3).init(weights)
    return {"weights": weights, "slots": jax.tree.map(np.asarray, slots),
            "step": np.asarray(7, np.int64), "rng": jax.random.key(3)}


def test_flatten_names_paths_and_round_trips_with_template():
    tree = _tree()
    flat = checkpoint_trees.flatten_tree(tree)
    assert "weights/0/0" in flat and "weights/2/b" in flat
    assert "slots/hyperparams/learning_rate" in flat
    assert flat["rng/__prng_key__"].dtype == np.uint32
    back = checkpoint_trees.unflatten_tree(flat, tree)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    np.testing.assert_array_equal(jax.random.key_data(back["rng"]),
                                  jax.random.key_data(tree["rng"]))


def test_save_restore_round_trip(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    tree = _tree(2.5)
    assert ckpt.save(10, tree)
    assert ckpt.latest_step() == 10
    restored = ckpt.restore(_tree(0.0))
    assert_trees_close(restored["weights"], tree["weights"])
    assert_trees_close(restored["slots"], tree["slots"])
    assert int(restored["step"]) == 7
    ckpt.close()


def test_restore_mismatch_names_first_path(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, _tree(width=3))
    with pytest.raises(ValueError, match=r"'weights/0/0'.*float32\[2,3\].*float32\[2,4\]"):
        ckpt.restore(_tree(width=4))
    extra = _tree()
    extra["weights"] = extra["weights"] + (np.zeros(1, np.float32),)
    with pytest.raises(ValueError, match=r"path 'weights/3'.*not in the checkpoint"):
        ckpt.restore(extra)


def test_restore_without_checkpoint_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no any checkpoint|no"):
        Checkpointer(str(tmp_path)).restore(_tree())


def test_older_step_is_skipped_with_warning(tmp_path, caplog):
    ckpt = Checkpointer(str(tmp_path))
    assert ckpt.save(20, _tree(1.0))
    with caplog.at_level(logging.WARNING):
        assert not ckpt.save(10, _tree(2.0))
    assert "older than the newest checkpoint (step 20)" in caplog.text
    assert not ckpt.save(20, _tree(3.0))  # Same step: silently not written again.
    assert ckpt.all_steps() == [20]
    assert float(ckpt.restore(_tree())["weights"][0][0][0, 0]) == 1.0


def test_retention_keeps_latest_and_every_keep_period(tmp_path):
    ckpt = Checkpointer(str(tmp_path), max_to_keep=2, keep_period=4)
    for step in range(1, 11):
        ckpt.save(step, _tree(float(step)))
    assert ckpt.all_steps() == [4, 8, 9, 10]


def test_retention_keep_time_interval_keeps_first(tmp_path):
    ckpt = Checkpointer(str(tmp_path), max_to_keep=1,
                        keep_time_interval=datetime.timedelta(hours=1))
    for step in (1, 2, 3):
        ckpt.save(step, _tree())
    assert ckpt.all_steps() == [1, 3]  # Step 1 opens the hour; 2 is neither new nor due.


@pytest.mark.parametrize("kwargs", [{"max_to_keep": 0}, {"keep_period": 0},
                                    {"keep_time_interval": -1.0}])
def test_bad_retention_arguments(tmp_path, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Checkpointer(str(tmp_path), **kwargs)


def test_crash_mid_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(5, _tree(5.0))

    def crash(self, *args, **kwargs):  # Raises whether orbax awaits finalize() or not.
        raise RuntimeError("simulated crash before the checkpoint was committed")

    monkeypatch.setattr(ocp.path.atomicity.AtomicRenameTemporaryPath, "finalize", crash)
    with pytest.raises(CheckpointSaveError, match=rf"could not save the checkpoint of step 6 "
                       rf"in {tmp_path}: RuntimeError: simulated crash .*; the newest "
                       rf"checkpoint, step 5, is intact"):
        ckpt.save(6, _tree(6.0))
    monkeypatch.undo()
    assert any("tmp" in name for name in os.listdir(tmp_path))  # The partial write is there.
    fresh = Checkpointer(str(tmp_path))
    assert fresh.latest_step() == 5
    assert float(fresh.restore(_tree())["weights"][0][0][0, 0]) == 5.0


def test_restore_values_reads_only_the_template_entries(tmp_path, monkeypatch):
    """Weights come back; the slots, step and rng arrays are never read from disk."""
    ckpt = Checkpointer(str(tmp_path))
    tree = _tree(2.5)
    ckpt.save(4, tree)
    read = []
    deserialize = ocp.type_handlers.NumpyHandler.deserialize

    async def spy(self, infos, args=None):
        read.extend(info.name for info in infos)
        return await deserialize(self, infos, args)

    monkeypatch.setattr(ocp.type_handlers.NumpyHandler, "deserialize", spy)
    template = {"weights": _tree(0.0)["weights"]}
    values = ckpt.restore_values(template, 4)
    assert list(values) == ["weights"]
    assert_trees_close(values["weights"], tree["weights"])
    assert sorted(read) == sorted(checkpoint_trees.flatten_tree(template))
    ckpt.restore(_tree(0.0), 4)  # A full restore reads the rest through the same handler.
    assert any(name.startswith("slots/") for name in read)
    with pytest.raises(checkpoint_trees.CheckpointMismatchError, match=r"'weights/0/0'"):
        ckpt.restore_values({"weights": _tree(width=4)["weights"]}, 4)
    ckpt.close()


def test_a_created_directory_gets_no_cleanup_thread_to_race_its_removal(tmp_path,
                                                                         monkeypatch):
    # orbax (0.12) lists the directory for a crashed save's temporaries in a thread that
    # its close() does not wait for; a directory this Checkpointer creates holds none,
    # and close() removes it while empty: the listing raced that (a FileNotFoundError).
    asked = []
    real = ocp.CheckpointManagerOptions

    def options(**kwargs):
        asked.append(kwargs.get("cleanup_tmp_directories", False))
        return real(**kwargs)

    monkeypatch.setattr(ocp, "CheckpointManagerOptions", options)
    fresh = tmp_path / "fresh"
    for _ in range(20):
        Checkpointer(str(fresh), cleanup_tmp=True).close()
        assert not fresh.exists()
    assert asked == [False] * 20
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "4.orbax-checkpoint-tmp-1700000000").mkdir()  # A crashed save's.
    Checkpointer(str(existing), cleanup_tmp=True).close()
    assert asked[-1] is True  # An existing directory is still cleaned.
