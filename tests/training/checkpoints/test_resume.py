"""Tests of revtrain/training/checkpoints/resume.py: restoring a run and warm starts."""
import jax

from revtrain import trainers
from revtrain.training import CheckpointConfig, EvalConfig, LogConfig, build_loop
from revtrain.training.checkpoints.resume import resume
from tests.training.checkpoints.test_restore_templates import _record_reads
from tests.training.test_loop import _ckpt_run, _loop


def test_without_a_checkpoint_the_run_starts_at_step_0():
    with _loop(None, trainers.Trainer, eval_steps=0) as loop:
        rng = jax.random.key(5)
        step, same, restored = resume(loop.trainer, None, None, CheckpointConfig(), rng)
    assert (step, restored) == (0, None) and same is rng


def test_weights_only_warm_start_leaves_the_slots_where_they_are(tmp_path, monkeypatch):
    source = str(tmp_path / "source")
    with build_loop(_ckpt_run(), EvalConfig(steps=0), CheckpointConfig(every=1),
                    LogConfig(progress=False), source) as loop:
        loop.run(1)
    read = _record_reads(monkeypatch, type(loop.trainer))
    with build_loop(_ckpt_run(), EvalConfig(steps=0),
                    CheckpointConfig(init_checkpoint_dir=source), LogConfig(progress=False),
                    str(tmp_path / "warm")) as loop:
        assert loop.step == 0
    assert ("host_values", "slots") not in read
