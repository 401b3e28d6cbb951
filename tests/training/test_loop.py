"""Tests of revtrain/training/loop.py with a tiny reversible LM on the copy task."""
import functools
import json
import os
import signal

import jax
import numpy as np
import pytest

from revtrain import trainers
from revtrain.data import CopyTask, StreamInputs
from revtrain.training import (
    CheckpointConfig,
    Checkpointer,
    CheckpointMismatchError,
    EvalConfig,
    LogConfig,
    NonFiniteLossError,
    RunConfig,
    build_loop,
    optimizer_fn,
    read_metrics,
)
from tests.training.tiny_models import tiny_reversible_lm
from tests.tree_utils import assert_trees_close

TRAINERS = [trainers.Trainer, trainers.ReversibleSerialTrainer]
if hasattr(trainers, "MemoryEfficientTrainer"):
    TRAINERS.append(trainers.MemoryEfficientTrainer)


def _inputs():
    return CopyTask(vocab_size=16, length=4, batch_size=4, seed=1)


def _loop(output_dir, trainer_class=trainers.ReversibleSerialTrainer, model=tiny_reversible_lm,
          inputs=None, eval_every=10, eval_steps=1, checkpoint_every=10, learning_rate=3e-3,
          log_every=None, progress=False, eval_train=False):
    run = RunConfig(model=model, inputs=inputs or _inputs(), trainer_class=trainer_class,
                    schedule=learning_rate)
    return build_loop(run, EvalConfig(every=eval_every, steps=eval_steps,
                                      eval_train=eval_train),
                      CheckpointConfig(every=checkpoint_every),
                      LogConfig(every=log_every, progress=progress), output_dir)


@pytest.mark.parametrize("trainer_class", TRAINERS, ids=lambda c: c.__name__)
def test_resume_20_then_10_equals_30(tmp_path, trainer_class):
    with _loop(str(tmp_path / "a"), trainer_class) as loop:
        loop.run(20)
    with _loop(str(tmp_path / "a"), trainer_class) as resumed:
        assert resumed.step == 20
        resumed.run(30)
        assert resumed.step == 30
    with _loop(str(tmp_path / "b"), trainer_class) as straight:
        straight.run(30)
    assert_trees_close(resumed.trainer.weights, straight.trainer.weights, rtol=1e-6, atol=0)
    assert_trees_close(resumed.trainer.slots, straight.trainer.slots, rtol=1e-6, atol=0)
    assert Checkpointer(str(tmp_path / "a" / "checkpoints")).all_steps() == [10, 20, 30]


def test_trainers_agree_on_weights_after_steps(tmp_path):
    results = []
    for trainer_class in TRAINERS:
        with _loop(None, trainer_class, eval_steps=0) as loop:
            loop.run(3)
            results.append(loop.trainer.weights)
    for weights in results[1:]:
        assert_trees_close(weights, results[0], rtol=1e-4, atol=1e-6)


def test_metrics_jsonl_and_tensorboard_written(tmp_path):
    with _loop(str(tmp_path), log_every=5, eval_every=10) as loop:
        metrics = loop.run(10)
    train = read_metrics(str(tmp_path), "train")
    evals = read_metrics(str(tmp_path), "eval")
    assert [r["step"] for r in train] == [5, 10]
    assert [r["step"] for r in evals] == [10]
    assert evals[0]["loss"] == pytest.approx(metrics["loss"])
    assert 0.0 <= evals[0]["accuracy"] <= 1.0
    for key in ("loss", "learning_rate", "steps_per_second", "tokens_per_second",
                "gradients_l2", "weights_l2"):
        assert train[0][key] > 0, key
    assert train[0]["learning_rate"] == pytest.approx(3e-3)
    for split in ("train", "eval"):
        files = os.listdir(tmp_path / "tensorboard" / split)
        assert any(name.startswith("events.out.tfevents") for name in files)


def test_schedule_sets_learning_rate_each_step(tmp_path):
    with _loop(str(tmp_path), learning_rate=lambda step: 1e-3 * (step + 1), log_every=1,
               eval_steps=0) as loop:
        loop.run(3)
    rates = [r["learning_rate"] for r in read_metrics(str(tmp_path), "train")]
    np.testing.assert_allclose(rates, [1e-3, 2e-3, 3e-3], rtol=1e-6)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    schedule = lambda step: 3e-3 if step < 4 else 1e30  # Weights blow up after step 5.
    with _loop(str(tmp_path), learning_rate=schedule, checkpoint_every=2, eval_steps=0) as loop:
        with pytest.raises(NonFiniteLossError, match=r"at step \d+; stopped without saving"):
            loop.run(10)
        assert loop.step >= 5
    ckpt = Checkpointer(str(tmp_path / "checkpoints"))
    assert ckpt.all_steps() == [2, 4]
    with _loop(str(tmp_path)) as resumed:
        assert resumed.step == 4
        assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(resumed.trainer.weights))


def test_restore_into_different_model_names_path(tmp_path):
    with _loop(str(tmp_path), eval_steps=0) as loop:
        loop.run(2)
    wider = functools.partial(tiny_reversible_lm, d_model=12)
    with pytest.raises(ValueError, match=r"at path 'weights/0/0': saved float32\[16,8\], "
                                         r"model float32\[16,12\]"):
        _loop(str(tmp_path), model=wider)


def test_sigterm_saves_and_stops_after_current_step(tmp_path):
    base = _inputs()

    def train_stream(start_step=0):
        for step, batch in enumerate(base.train_stream(start_step), start_step):
            if step == 3:
                signal.raise_signal(signal.SIGTERM)  # Handled before it returns.
            yield batch

    inputs = StreamInputs(train_stream, base.eval_stream, vocab_size=16)
    loop = _loop(str(tmp_path), inputs=inputs, eval_steps=0, checkpoint_every=0)
    loop.run(10)
    loop.close()
    assert loop.interrupted_by == signal.SIGTERM
    assert loop.step == 4
    assert Checkpointer(str(tmp_path / "checkpoints")).all_steps() == [4]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_eval_metrics_are_bits_per_byte_for_byte_lm(tmp_path):
    base = _inputs()
    # Bits per byte follow the data's byte_level property, not the vocabulary size.
    for byte_level in (True, False):
        inputs = StreamInputs(base.train_stream, base.eval_stream, vocab_size=256,
                              byte_level=byte_level)
        model = functools.partial(tiny_reversible_lm, vocab_size=256)
        with _loop(None, model=model, inputs=inputs, eval_steps=2) as loop:
            metrics = loop.evaluate()
        assert ("bits_per_byte" in metrics) == byte_level
    assert metrics["loss"] > 0


def test_schedule_none_keeps_the_optimizers_rate(tmp_path):
    run = RunConfig(model=tiny_reversible_lm, inputs=_inputs(),
                    optimizer=lambda: optimizer_fn("sgd", learning_rate=0.25))
    with build_loop(run, EvalConfig(steps=0), log=LogConfig(every=1, progress=False),
                    output_dir=str(tmp_path)) as loop:
        loop.run(2)
    rates = [r["learning_rate"] for r in read_metrics(str(tmp_path), "train")]
    np.testing.assert_allclose(rates, [0.25, 0.25])


def test_eval_train_and_named_splits_write_their_own_records(tmp_path):
    run = RunConfig(model=tiny_reversible_lm, inputs=_inputs(), schedule=1e-3)
    other = CopyTask(vocab_size=16, length=4, batch_size=4, seed=7)
    eval_config = EvalConfig(every=2, steps=1, splits={"other": other}, eval_train=True)
    with build_loop(run, eval_config, log=LogConfig(progress=False),
                    output_dir=str(tmp_path)) as loop:
        loop.run(2)
    for split in ("eval", "other", "eval_train"):
        assert [r["step"] for r in read_metrics(str(tmp_path), split)] == [2], split
        assert os.path.isdir(tmp_path / "tensorboard" / split)


def test_progress_bar_does_not_break_run(tmp_path, capsys):
    with _loop(None, progress=True, eval_steps=0) as loop:
        loop.run(2)
    assert "train" in capsys.readouterr().err
    assert json.dumps(loop.last_eval_metrics) == "{}"


def test_loop_steps_do_not_recompile_the_trainer():
    schedule = lambda step: 1e-3 / (step + 1)  # A new rate every step must not retrace.
    with _loop(None, trainers.Trainer, learning_rate=schedule, eval_steps=0) as loop:
        loop.run(5)
    assert loop.trainer.trace_counts() == {"train_step": 1}


def test_evaluation_reads_the_trainers_values_not_the_layer_objects():
    with _loop(None, eval_steps=1) as loop:
        initial = jax.tree.map(np.array, loop.model.weights)
        before = loop.evaluate(write=False)
        loop.run(5)
        # The layer objects keep their initial values; the trainer owns the trained ones.
        assert_trees_close(loop.model.weights, initial, rtol=0, atol=0)
        after = loop.evaluate(write=False)
        assert after["loss"] < before["loss"]
        weights, _ = loop.model_values()
        loop.trainer.sync_to()
        assert_trees_close(loop.model.weights, weights, rtol=0, atol=0)
        assert loop.evaluate(write=False) == after


# Checkpoint handling beyond resume: warm start, chosen step, crashed saves, async, shapes.

def _ckpt_run(model=tiny_reversible_lm, inputs=None):
    inputs = inputs or CopyTask(vocab_size=16, length=4, batch_size=4, seed=1)
    return RunConfig(model=model, inputs=inputs, schedule=3e-3)


def _ckpt_loop(output_dir, run=None, **checkpoint):
    return build_loop(run or _ckpt_run(), EvalConfig(steps=0), CheckpointConfig(**checkpoint),
                      LogConfig(progress=False), output_dir)


def test_warm_start_weights_only_and_full_state(tmp_path):
    source = str(tmp_path / "source")
    with _ckpt_loop(source, every=3) as loop:
        loop.run(3)
        trained = loop.trainer.train_state
    with _ckpt_loop(None) as fresh:
        initial_slots = fresh.trainer.train_state.slots
    with _ckpt_loop(str(tmp_path / "weights"), init_checkpoint_dir=source) as loop:
        assert loop.step == 0 and loop.restored_step is None
        assert_trees_close(loop.trainer.train_state.weights, trained.weights, rtol=0, atol=0)
        assert_trees_close(loop.trainer.train_state.slots, initial_slots, rtol=0, atol=0)
    with _ckpt_loop(str(tmp_path / "full"), init_checkpoint_dir=source,
               init_weights_only=False) as loop:
        assert loop.step == 3
        assert_trees_close(loop.trainer.train_state.slots, trained.slots, rtol=0, atol=0)


def test_warm_start_from_another_model_names_the_first_mismatching_path(tmp_path):
    source = str(tmp_path / "source")
    with _ckpt_loop(source) as loop:
        loop.run(1)
    wider = _ckpt_run(model=lambda mode: tiny_reversible_lm(d_model=12, mode=mode))
    with pytest.raises(CheckpointMismatchError, match=r"at path 'weights/0/0': saved "
                                                      r"float32\[16,8\], model float32\[16,12\]"):
        _ckpt_loop(str(tmp_path / "b"), wider, init_checkpoint_dir=source)


def test_restore_step_and_stale_temporary_checkpoint(tmp_path):
    out = str(tmp_path)
    with _ckpt_loop(out, every=1, max_to_keep=None) as loop:
        loop.run(3)
        weights_at_3 = loop.trainer.train_state.weights
    stale = tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-1700000000"
    stale.mkdir()  # What a save that crashed would leave.
    with _ckpt_loop(out, restore_step=2) as loop:
        assert loop.step == 2 and loop.restored_step == 2
        assert not stale.exists()
        loop.run(3)  # Step 3 retrained from step 2: the same weights (deterministic).
        assert_trees_close(loop.trainer.train_state.weights, weights_at_3, rtol=1e-6,
                           atol=1e-7)
    with pytest.raises(FileNotFoundError, match="no checkpoint of step 9"):
        _ckpt_loop(out, restore_step=9)


def test_async_saves_are_complete_after_close(tmp_path):
    with _ckpt_loop(str(tmp_path), every=2, async_save=True) as loop:
        loop.run(4)
    assert Checkpointer(str(tmp_path / "checkpoints")).all_steps() == [2, 4]


def test_a_changed_batch_shape_is_an_error_naming_both(tmp_path):
    base = CopyTask(vocab_size=16, length=4, batch_size=4, seed=1)

    def train_stream(start_step=0):
        for step, batch in enumerate(base.train_stream(start_step), start_step):
            yield tuple(x[:, :-1] for x in batch) if step == 2 else batch

    run = _ckpt_run(inputs=StreamInputs(train_stream, base.eval_stream, vocab_size=16))
    with _ckpt_loop(None, run) as loop, pytest.raises(
            ValueError, match=r"batch of step 3 is \(int32\[4, 7\], int32\[4, 7\], "
                              r"float32\[4, 7\]\); the first batch was \(int32\[4, 8\]"):
        loop.run(4)
    assert loop.step == 2


def test_profile_steps_write_a_trace(tmp_path):
    log = LogConfig(progress=False, profile_steps=(2, 2))
    with build_loop(_ckpt_run(), EvalConfig(steps=0), log=log, output_dir=str(tmp_path)) as loop:
        loop.run(3)
    assert any(files for _, _, files in os.walk(tmp_path / "profile"))
    with pytest.raises(ValueError, match="LogConfig.profile_steps=\\(3, 2\\) must be"):
        LogConfig(profile_steps=(3, 2))


def test_losses_are_read_back_only_on_logging_and_checkpoint_steps(tmp_path):
    reads = []

    class CountedLoss:
        """A loss that records when the loop reads it back (a device sync)."""

        def __init__(self, value, step):
            self.value, self.step = value, step

        def __float__(self):
            reads.append((self.step, loop.step))  # (the loss's step, when it is read)
            return float(self.value)

    with _ckpt_loop(str(tmp_path), every=3) as loop:
        one_step = loop.trainer.one_step

        def counted(batch, rng, step=0, learning_rate=None):
            loss, stats = one_step(batch, rng, step=step, learning_rate=learning_rate)
            return CountedLoss(loss, step + 1), stats

        loop.trainer.one_step = counted
        loop.log_every = 5
        loop.run(5)
    # Steps 1-3 are read at the checkpoint of step 3, steps 4-5 at the log of step 5.
    assert reads == [(1, 3), (2, 3), (3, 3), (4, 5), (5, 5)]


def test_ordinary_steps_make_no_implicit_transfer(tmp_path):
    from revtrain.training import warmup_cosine_decay
    from revtrain.training.loop_metrics import Window
    schedule = warmup_cosine_decay(1e-3, warmup_steps=2, decay_steps=10)
    with _loop(None, eval_every=0, eval_steps=0, checkpoint_every=0, log_every=100,
               learning_rate=schedule) as loop:
        loss = jax.device_put(np.float32(1.0))
        rngs = []

        def one_step(batch, rng, step=0, learning_rate=None):  # Device values only.
            rngs.append(rng)
            return loss, {}

        loop.trainer.one_step = one_step
        stream, window = loop.inputs.train_stream(start_step=0), Window()
        bar = loop._progress_bar(100)
        with jax.transfer_guard("disallow"):
            for _ in range(3):
                loop._train_step(stream, window)
                loop._after_step(100, window, bar)
        loop.step = 7  # Set from outside (as a restore does): the counter follows.
        loop._train_step(stream, window)
    for step, rng in zip([0, 1, 2, 7], rngs, strict=True):
        np.testing.assert_array_equal(jax.random.key_data(rng), jax.random.key_data(
            jax.random.fold_in(loop._rng, step)))
