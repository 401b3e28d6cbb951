"""Tests of gradient accumulation in the training loop (``RunConfig.accumulate_steps``):
revtrain/training/loop.py and builder.py with revtrain/training/accumulation.py."""
import dataclasses
import functools
import os

import gin
import jax
import numpy as np
import pytest

from revtrain import configurables, trainers
from revtrain.data import CopyTask
from revtrain.training import (
    CheckpointConfig,
    CheckpointMismatchError,
    EvalConfig,
    LogConfig,
    RunConfig,
    build_loop,
    read_metrics,
)
from revtrain.training.loop_metrics import Window
from tests.training.tiny_models import tiny_reversible_lm
from tests.tree_utils import assert_trees_close

TRAINERS = [trainers.Trainer, trainers.ReversibleSerialTrainer,
            trainers.MemoryEfficientTrainer]
# No dropout, so the micro-batches' keys do not matter and k = 1 is the reference.
DETERMINISTIC = functools.partial(tiny_reversible_lm, dropout=0.0)


def _run(accumulate_steps, trainer_class=trainers.ReversibleSerialTrainer, batch_size=8,
         model=DETERMINISTIC):
    # CopyTask scores the same positions of every row: equal weight per micro-batch.
    inputs = CopyTask(vocab_size=16, length=4, batch_size=batch_size, seed=1)
    return RunConfig(model=model, inputs=inputs, trainer_class=trainer_class, schedule=3e-3,
                     accumulate_steps=accumulate_steps)


def _loop(run, output_dir=None, checkpoint_every=0, log_every=None):
    return build_loop(run, EvalConfig(every=0, steps=0), CheckpointConfig(every=checkpoint_every),
                      LogConfig(every=log_every, progress=False), output_dir)


def test_accumulating_loop_equals_the_loop_on_whole_batches(tmp_path):
    """Same steps, learning rates and metrics records; weights to float rounding."""
    results = {}
    for k in (1, 2):
        out = str(tmp_path / f"k{k}")
        with _loop(_run(k), out, log_every=1) as loop:
            loop.run(3)
            results[k] = loop.step, loop.trainer.weights, read_metrics(out, "train")
    (step1, weights1, train1), (step2, weights2, train2) = results[1], results[2]
    assert step1 == step2 == 3
    assert_trees_close(weights2, weights1, rtol=1e-5, atol=1e-6)
    assert [r["step"] for r in train2] == [r["step"] for r in train1] == [1, 2, 3]
    for a, b in zip(train1, train2, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["learning_rate"] == pytest.approx(a["learning_rate"])


@pytest.mark.parametrize("trainer_class", TRAINERS, ids=lambda c: c.__name__)
def test_resume_with_accumulation_equals_an_uninterrupted_run(tmp_path, trainer_class):
    run = _run(2, trainer_class, model=tiny_reversible_lm)  # Dropout on: keys matter too.
    with _loop(run, str(tmp_path / "a"), checkpoint_every=2) as loop:
        loop.run(2)
    with _loop(run, str(tmp_path / "a"), checkpoint_every=2) as resumed:
        assert resumed.step == 2
        resumed.run(4)
    with _loop(run, str(tmp_path / "b"), checkpoint_every=2) as straight:
        straight.run(4)
    assert_trees_close(resumed.trainer.weights, straight.trainer.weights, rtol=1e-6, atol=0)
    assert_trees_close(resumed.trainer.slots, straight.trainer.slots, rtol=1e-6, atol=0)


def test_a_checkpoint_without_accumulation_is_refused_with_it(tmp_path):
    """The optimizer state gains MultiSteps' fields: the restore names the first path."""
    with _loop(_run(1), str(tmp_path), checkpoint_every=1) as loop:
        loop.run(1)
    with pytest.raises(CheckpointMismatchError, match="slots"):
        _loop(_run(2), str(tmp_path))


def test_a_batch_that_does_not_split_is_refused_before_anything_is_written(tmp_path):
    out = str(tmp_path / "run")
    with pytest.raises(ValueError, match=(
            r"^CopyTask's batch size 4 does not split into RunConfig.accumulate_steps=2 "
            r"micro-batches over 4 devices: it must be a multiple of 2 x 4 = 8; set "
            r"CopyTask.batch_size to a multiple of 8 or change RunConfig.accumulate_steps$")):
        _loop(_run(2, batch_size=4), out)
    assert not os.path.exists(out)


def test_each_step_runs_k_micro_steps_with_folded_keys_and_no_implicit_transfer():
    with _loop(_run(2)) as loop:
        calls = []

        def one_step(batch, rng, step=0, learning_rate=None):  # Device values only.
            calls.append((batch, rng, step, learning_rate))
            return jax.device_put(np.float32(len(calls))), {"weights_l2": len(calls)}

        loop.trainer.one_step = one_step
        stream = loop.inputs.train_stream(start_step=0)
        batches = [next(loop.inputs.train_stream(start_step=s)) for s in range(2)]
        window = Window()
        with jax.transfer_guard("disallow"):
            loop._train_step(stream, window)
            loop._train_step(stream, window)
        assert loop.step == 2
        assert [c[2] for c in calls] == [0, 0, 1, 1]
        assert [c[3] for c in calls] == pytest.approx([3e-3] * 4)
        for n, (micro, rng, step, _) in enumerate(calls):
            i = n % 2
            for leaf, whole in zip(micro, batches[step], strict=True):
                np.testing.assert_array_equal(leaf, whole[4 * i:4 * i + 4])
            expected = jax.random.fold_in(jax.random.fold_in(loop._rng, step), i)
            np.testing.assert_array_equal(jax.random.key_data(rng),
                                          jax.random.key_data(expected))
        # A step's loss is the mean of its micro-steps' (1, 2 then 3, 4); stats the last's.
        assert [float(x) for x in window.losses] == [1.5, 3.5]
        assert window.stats["weights_l2"] == 4


def test_clip_global_norm_bound_on_the_trainer_is_refused_before_anything_is_written(
        tmp_path):
    """Bound in gin on the trainer class, the option is seen only in the built trainer."""
    gin.clear_config()
    try:
        gin.parse_config(["RunConfig.trainer_class = @ReversibleSerialTrainer",
                          "ReversibleSerialTrainer.clip_global_norm = 1.0",
                          "RunConfig.accumulate_steps = 2"])
        bound = configurables.run_configs()["run"]
        run = dataclasses.replace(bound, model=DETERMINISTIC, inputs=_run(1).inputs)
        out = str(tmp_path / "run")
        with pytest.raises(ValueError, match=(
                r"^RunConfig.accumulate_steps=2 with clip_global_norm=1.0 in "
                r"ReversibleSerialTrainer's options would clip each micro-batch's gradient, "
                r"not the accumulated one; bind optimizer_fn.clip_gradient_norm instead")):
            _loop(run, out)
        assert not os.path.exists(out)
    finally:
        gin.clear_config()
