"""Tests of revtrain/training/eval_program.py: evaluating a run's checkpoints."""
import json
import os
import shutil
import subprocess
import sys

import jax
import pytest

from revtrain.data import CopyTask
from revtrain.training import (
    CheckpointConfig,
    CheckpointEvaluator,
    EvalConfig,
    LogConfig,
    RunConfig,
    build_loop,
    read_metrics,
)
from tests.training.tiny_models import tiny_reversible_lm

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs")
TINY = [  # configs/copy_task.gin shrunk to seconds on CPU.
    "ReversibleTransformerLM.vocab_size=8", "ReversibleTransformerLM.d_model=8",
    "ReversibleTransformerLM.d_ff=16", "ReversibleTransformerLM.n_layers=1",
    "ReversibleTransformerLM.n_heads=2", "ReversibleTransformerLM.max_len=16",
    "CopyTask.vocab_size=8", "CopyTask.length=4", "CopyTask.batch_size=4",
    "LogConfig.progress=False",
]


def _run():
    return RunConfig(model=tiny_reversible_lm,
                     inputs=CopyTask(vocab_size=16, length=4, batch_size=4, seed=1),
                     schedule=1e-3)


def _train(output_dir, steps):
    with build_loop(_run(), EvalConfig(steps=0), CheckpointConfig(every=1, max_to_keep=None),
                    LogConfig(progress=False), output_dir) as loop:
        loop.run(steps)


def test_each_checkpoint_is_evaluated_once_in_step_order(tmp_path):
    out = str(tmp_path)
    _train(out, 3)
    evaluator = CheckpointEvaluator(_run(), EvalConfig(steps=1), out)
    try:
        assert [step for step, _ in evaluator.run()] == [1, 2, 3]
        assert list(evaluator.run()) == []  # Re-running evaluates nothing twice.
        assert [r["step"] for r in read_metrics(out, "eval")] == [1, 2, 3]
        assert os.path.isdir(tmp_path / "tensorboard" / "eval")
    finally:
        evaluator.close()


def test_follow_skips_a_checkpoint_deleted_after_listing(tmp_path):
    out = str(tmp_path)
    _train(out, 2)
    evaluator = CheckpointEvaluator(_run(), EvalConfig(steps=1), out)
    listed = evaluator.pending_steps

    def list_then_delete(step=None):
        steps = listed(step)
        shutil.rmtree(os.path.join(out, "checkpoints", "1"), ignore_errors=True)
        return steps

    evaluator.pending_steps = list_then_delete
    try:
        assert [step for step, _ in evaluator.follow(final_step=2, poll_seconds=1)] == [2]
        with pytest.raises(ValueError, match="poll_seconds=0 must be in"):
            next(evaluator.follow(final_step=2, poll_seconds=0))
    finally:
        evaluator.close()


class _Slept(Exception):
    pass


def _no_sleep(seconds):
    raise _Slept(seconds)


def test_follow_with_a_step_waits_for_that_step_alone(tmp_path):
    # revtrain-eval --step=N --wait: N's checkpoint is evaluated once it appears; a step
    # not saved yet is waited for, not refused; one the run went past is one line.
    out = str(tmp_path)
    _train(out, 3)
    evaluator = CheckpointEvaluator(_run(), EvalConfig(steps=1), out)
    try:
        assert [s for s, _ in evaluator.follow(3, 1, _no_sleep, step=2)] == [2]
        assert list(evaluator.follow(3, 1, _no_sleep, step=2)) == []  # Done before.
        with pytest.raises(_Slept):  # Step 5 is not saved yet: it waits.
            list(evaluator.follow(6, 1, _no_sleep, step=5))
        with pytest.raises(ValueError, match="--step=7 is after the run's final step 6"):
            list(evaluator.follow(6, 1, _no_sleep, step=7))
        shutil.rmtree(os.path.join(out, "checkpoints", "1"))
        with pytest.raises(ValueError, match=r"--step=1: the run went past that step "
                                             r"without saving it; its checkpoints are \[2, 3\]"):
            list(evaluator.follow(3, 1, _no_sleep, step=1))
        assert [r["step"] for r in read_metrics(out, "eval")] == [2]
    finally:
        evaluator.close()


def _commit_time(checkpoint_dir):
    """When orbax committed a checkpoint (seconds since the epoch)."""
    with open(os.path.join(checkpoint_dir, "_CHECKPOINT_METADATA")) as f:
        return json.load(f)["commit_timestamp_nsecs"] / 1e9


def test_evaluator_process_follows_a_training_process(tmp_path):
    """Two real processes, revtrain-eval --wait and revtrain-train, kept in step by
    tests/training/follow_programs.py: one checkpoint is saved during an evaluation."""
    out, events = str(tmp_path / "run"), str(tmp_path / "events.jsonl")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    program = [sys.executable, "-m", "tests.training.follow_programs"]
    bindings = TINY + ["train.steps=12", "CheckpointConfig.every=3",
                       "CheckpointConfig.max_to_keep=None", "EvalConfig.steps=0",
                       "LogConfig.every=3"]
    evaluator = subprocess.Popen(
        [*program, "eval", events, f"--output_dir={out}", "--wait", "--poll_seconds=0.2",
         "--eval_steps=1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    trainer = subprocess.run(
        [*program, "train", events, f"--config_file={os.path.join(CONFIGS, 'copy_task.gin')}",
         f"--output_dir={out}", *[f"--gin_bindings={b}" for b in bindings]],
        capture_output=True, text=True, timeout=300, env=env)
    assert trainer.returncode == 0, trainer.stderr[-2000:]
    stdout, stderr = evaluator.communicate(timeout=300)
    assert evaluator.returncode == 0, stderr[-2000:]
    checkpoints = os.path.join(out, "checkpoints")
    saved = sorted(int(d) for d in os.listdir(checkpoints) if d.isdigit())
    assert saved == [3, 6, 9, 12]
    # A checkpoint was saved while the evaluator was evaluating another one...
    with open(events) as f:
        records = [json.loads(line) for line in f]
    spans = {r["step"]: [r["time"]] for r in records if r["event"] == "eval_start"}
    for r in records:
        if r["event"] == "eval_end":
            spans[r["step"]].append(r["time"])
    during = [(s, t) for s in saved for t, (start, end) in spans.items()
              if s != t and start < _commit_time(os.path.join(checkpoints, str(s))) < end]
    assert during, f"no save inside an evaluation: {spans}"
    # ...and every saved step, that one included, was evaluated exactly once, in order.
    evals = read_metrics(out, "eval")
    assert [r["step"] for r in evals] == saved
    assert sorted(spans) == saved and all(len(span) == 2 for span in spans.values())
    assert stdout.strip().splitlines()[-1].startswith("eval at step 12:")  # Then it exits.


def test_the_eval_program_builds_the_model_from_shapes_only(tmp_path):
    out = str(tmp_path)
    _train(out, 1)
    evaluator = CheckpointEvaluator(_run(), EvalConfig(steps=1), out)
    try:
        assert all(isinstance(leaf, jax.ShapeDtypeStruct)
                   for leaf in jax.tree.leaves(evaluator.built.model.weights))
        assert [step for step, _ in evaluator.run()] == [1]
    finally:
        evaluator.close()
