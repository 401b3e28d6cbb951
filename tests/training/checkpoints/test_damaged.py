"""A damaged checkpoint is skipped with a warning and the previous one restored."""
import glob
import logging
import os
import shutil

import numpy as np
import pytest

from revtrain.training import Checkpointer, CheckpointUnreadableError


def _tree(value):
    return {"weights": (np.full((3, 2), value, np.float32),), "step": np.asarray(value)}


def _saved(tmp_path, steps=(1, 2, 3)):
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"), max_to_keep=None)
    for step in steps:
        checkpointer.save(step, _tree(step))
    checkpointer.close()
    return str(tmp_path / "checkpoints")


def _damage(directory, step, how):
    item = os.path.join(directory, str(step), "default")
    if how == "metadata":
        os.remove(os.path.join(item, "_METADATA"))
    else:
        for path in glob.glob(os.path.join(item, "d", "*")):
            os.remove(path)


@pytest.mark.parametrize("how, reason", [
    ("metadata", "its metadata (_METADATA) is missing or unreadable"),
    ("data", "NOT_FOUND"),
])
def test_newest_unreadable_checkpoint_is_skipped_with_a_warning(tmp_path, caplog, capfd,
                                                                how, reason):
    directory = _saved(tmp_path)
    _damage(directory, 3, how)
    checkpointer = Checkpointer(directory)
    with caplog.at_level(logging.WARNING):
        tree = checkpointer.restore(_tree(0))
    checkpointer.close()
    assert int(tree["step"]) == 2
    np.testing.assert_array_equal(tree["weights"][0], np.full((3, 2), 2, np.float32))
    warning = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(warning) == 1 and f"checkpoint {directory}/3: it cannot be read" in warning[0]
    assert reason in warning[0] and "\n" not in warning[0]
    assert not [r for r in caplog.records if "was found in the checkpoint" in r.getMessage()]
    assert checkpointer.unreadable_steps == [3]
    assert sorted(os.listdir(directory)) == ["1", "2", "3"]  # Nothing deleted.
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("how", ["metadata", "data"])
def test_restore_values_of_the_newest_skips_an_unreadable_one_as_restore_does(tmp_path,
                                                                            caplog, how):
    directory = _saved(tmp_path)
    _damage(directory, 3, how)
    checkpointer = Checkpointer(directory, read_only=True)
    with caplog.at_level(logging.WARNING):
        values = checkpointer.restore_values({"weights": _tree(0)["weights"]})
    checkpointer.close()
    np.testing.assert_array_equal(values["weights"][0], np.full((3, 2), 2, np.float32))
    assert checkpointer.restored_step == 2 and checkpointer.unreadable_steps == [3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings  # orbax's "Item "default" was found ..." is not.
    assert warnings[0].startswith(f"skipping the checkpoint {directory}/3: it cannot be read")


def test_next_save_moves_the_unreadable_checkpoint_aside(tmp_path):
    directory = _saved(tmp_path)
    _damage(directory, 3, "data")
    checkpointer = Checkpointer(directory, max_to_keep=2)
    checkpointer.restore(_tree(0))
    assert checkpointer.save(3, _tree(30))
    checkpointer.close()
    assert sorted(os.listdir(directory)) == ["2", "3"]
    assert os.listdir(directory + "_unreadable") == ["3"]
    assert int(Checkpointer(directory).restore(_tree(0))["step"]) == 30


def test_no_readable_checkpoint_names_the_directory_and_first_failure(tmp_path, capfd):
    directory = _saved(tmp_path, steps=(1, 2))
    _damage(directory, 2, "metadata")
    _damage(directory, 1, "data")
    checkpointer = Checkpointer(directory)
    with pytest.raises(CheckpointUnreadableError,
                       match=rf"none of the 2 checkpoints in {directory} can be read; the "
                             rf"newest, {directory}/2, fails with FileNotFoundError: its "
                             rf"metadata \(_METADATA\) is missing"):
        checkpointer.restore(_tree(0))
    checkpointer.close()
    assert sorted(os.listdir(directory)) == ["1", "2"]
    assert "Traceback" not in capfd.readouterr().err


def test_eval_of_a_damaged_run_exits_cleanly(tmp_path):
    import shutil
    import subprocess
    import sys

    from revtrain import cli

    out = str(tmp_path)
    config = os.path.join(os.path.dirname(os.path.dirname(cli.__file__)), "configs",
                          "copy_task.gin")
    tiny = ["ReversibleTransformerLM.vocab_size=8", "ReversibleTransformerLM.d_model=8",
            "ReversibleTransformerLM.d_ff=16", "ReversibleTransformerLM.n_layers=1",
            "ReversibleTransformerLM.n_heads=2", "CopyTask.vocab_size=8", "CopyTask.length=4",
            "CopyTask.batch_size=4", "LogConfig.progress=False", "train.steps=4",
            "CheckpointConfig.every=2", "EvalConfig.steps=0"]
    argv = ["revtrain-train", f"--config_file={config}", f"--output_dir={out}"]
    assert cli.train_main(argv + [f"--gin_bindings={b}" for b in tiny]) == 0
    _damage(os.path.join(out, "checkpoints"), 4, "data")
    script = shutil.which("revtrain-eval", path=os.path.dirname(sys.executable))
    run = subprocess.run([script, f"--output_dir={out}", "--eval_steps=1"], capture_output=True,
                         text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("eval at step 2: loss"), run.stderr
    assert f"skipping the checkpoint {out}/checkpoints/4: it cannot be read" in run.stderr
    assert "Traceback" not in run.stderr and "Event loop" not in run.stderr
    os.remove(os.path.join(out, "metrics.jsonl"))  # Both steps are to evaluate again.
    _damage(os.path.join(out, "checkpoints"), 2, "metadata")
    run = subprocess.run([script, f"--output_dir={out}", "--eval_steps=1"], capture_output=True,
                         text=True,
                         timeout=120)
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert run.returncode == 1 and len(errors) == 1, run.stderr
    assert errors[0].startswith("revtrain-eval: error: CheckpointUnreadableError: none of "
                                f"the 2 checkpoints to evaluate in {out}/checkpoints can be "
                                f"read")
    assert "Traceback" not in run.stderr and "Event loop" not in run.stderr


def _damage_part(directory, part):
    """Damages one part of the checkpoint of step 10 (or adds a stray empty step 14)."""
    step = os.path.join(directory, "10")
    if part == "_CHECKPOINT_METADATA":
        with open(os.path.join(step, "_CHECKPOINT_METADATA"), "w") as f:
            f.write('{"item_handlers": ')  # Cut short.
    elif part == "default/_METADATA":
        with open(os.path.join(step, "default", "_METADATA"), "w") as f:
            f.write("")
    elif part == "data file":
        [data] = glob.glob(os.path.join(step, "default", "d", "*"))[:1]
        with open(data, "r+b") as f:
            f.truncate(3)
    elif part == "empty step directory":
        shutil.rmtree(step)
        os.makedirs(step)
    else:  # A stray empty directory newer than every checkpoint.
        os.makedirs(os.path.join(directory, "14"))


@pytest.mark.parametrize("part, restored", [
    ("_CHECKPOINT_METADATA", 8), ("default/_METADATA", 8), ("data file", 8),
    ("empty step directory", 8), ("stray empty directory", 10),
])
def test_each_step_is_tried_on_its_own_and_the_newest_complete_one_restored(
        tmp_path, caplog, part, restored):
    directory = _saved(tmp_path, steps=(6, 8, 10))
    _damage_part(directory, part)
    checkpointer = Checkpointer(directory)
    with caplog.at_level(logging.WARNING):
        tree = checkpointer.restore(_tree(0))
    checkpointer.close()
    assert int(tree["step"]) == restored
    np.testing.assert_array_equal(tree["weights"][0], np.full((3, 2), restored, np.float32))
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    broken = "14" if part == "stray empty directory" else "10"
    assert len(skipped) == 1 and f"{directory}/{broken}:" in skipped[0], skipped
    assert "\n" not in skipped[0]
