"""Sharded checkpoints: device values saved as they live, restored onto any device count
or ``fsdp`` setting (orbax reads each device's slices into the target sharding).

Parametrised by trainer; a trainer that does not take ``fsdp`` yet is skipped, naming it.
Dropout is off so the next-step losses of different device counts are comparable.
"""
import jax
import numpy as np
import pytest

from revtrain.trainers.common.protocols import TrainState
from revtrain.training import (
    CheckpointConfig,
    Checkpointer,
    EvalConfig,
    LogConfig,
    RunConfig,
    build_loop,
)
from revtrain.training.checkpoints.trees import flatten_tree, restore_targets
from tests.fsdp_models import TRAINERS, build
from tests.trainers.conftest import make_batch
from tests.training.tiny_models import tiny_reversible_lm
from tests.tree_utils import assert_trees_close

PARTS = TrainState._fields


def _save(trainer, directory, step):
    checkpointer = Checkpointer(directory)
    checkpointer.save(step, {part: trainer.saved_values(part) for part in PARTS})
    checkpointer.close()


def _restore(trainer, directory):
    """Restores into the trainer's own shardings; returns the restored tree."""
    template = {part: restore_targets(trainer.saved_values(part),
                                      trainer.value_shardings(part)) for part in PARTS}
    checkpointer = Checkpointer(directory)
    tree = checkpointer.restore(template)
    checkpointer.close()
    trainer.restore(TrainState(*(tree[part] for part in PARTS)))
    return tree


@pytest.mark.parametrize("saved_with,restored_with", [((4, True), (2, False)),
                                                      ((2, False), (4, True))],
                         ids=["4fsdp-to-2", "2-to-4fsdp"])
@pytest.mark.parametrize("trainer_name", list(TRAINERS))
def test_a_checkpoint_restores_onto_another_device_count_and_fsdp(tmp_path, trainer_name,
                                                                  saved_with, restored_with):
    first, second = make_batch(seed=0), make_batch(seed=1)
    source = build(trainer_name, saved_with[1], saved_with[0], dropout=0.0)
    source.one_step(first, jax.random.key(0))
    _save(source, str(tmp_path), 1)
    target = build(trainer_name, restored_with[1], restored_with[0], dropout=0.0)
    tree = _restore(target, str(tmp_path))
    for part in ("weights", "slots"):
        for leaf, sharding in zip(jax.tree.leaves(tree[part]),
                                  jax.tree.leaves(target.value_shardings(part),
                                                  is_leaf=lambda x: x is None), strict=True):
            assert sharding is None or leaf.sharding == sharding
    assert_trees_close(target.train_state, source.train_state, rtol=0, atol=0)
    losses = [float(t.one_step(second, jax.random.key(1))[0]) for t in (source, target)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert_trees_close(target.weights, source.weights, rtol=1e-5, atol=1e-6)


def test_a_host_checkpoint_restores_into_a_sharded_trainer(tmp_path):
    """A checkpoint of host arrays (what every trainer saved before FSDP) still restores."""
    batch = make_batch()
    source = build("Trainer", False, 1, dropout=0.0)
    source.one_step(batch, jax.random.key(0))
    checkpointer = Checkpointer(str(tmp_path))
    checkpointer.save(1, source.train_state._asdict())
    checkpointer.close()
    target = build("Trainer", True, 4, dropout=0.0)
    _restore(target, str(tmp_path))
    assert_trees_close(target.train_state, source.train_state, rtol=0, atol=0)


def test_flatten_keeps_device_arrays_and_abstract_targets():
    trainer = build("Trainer", True, 4, dropout=0.0)
    weights = trainer.saved_values("weights")
    flat = flatten_tree({"weights": weights, "step": 3})
    assert all(isinstance(v, jax.Array) for k, v in flat.items() if k != "step")
    assert isinstance(flat["step"], np.ndarray)
    targets = restore_targets(weights, trainer.value_shardings("weights"))
    assert all(isinstance(t, jax.ShapeDtypeStruct) and t.sharding == a.sharding
               for t, a in zip(jax.tree.leaves(targets), jax.tree.leaves(weights),
                               strict=True))
    with pytest.raises(ValueError, match=r"shardings for"):
        restore_targets(weights, (None,))


def test_a_run_with_fsdp_resumes_without_it_on_fewer_devices(tmp_path):
    """The loop saves sharded values and resumes them with another setting."""
    from revtrain.data import CopyTask

    def loop(n_devices, fsdp):
        run = RunConfig(model=lambda mode="train": tiny_reversible_lm(d_model=64, mode=mode),
                        inputs=CopyTask(vocab_size=16, length=4, batch_size=4, seed=1),
                        schedule=3e-3, n_devices=n_devices, fsdp=fsdp,
                        trainer_class=TRAINERS["Trainer"])
        return build_loop(run, EvalConfig(steps=0), CheckpointConfig(every=2),
                          LogConfig(progress=False), str(tmp_path))

    with loop(4, True) as sharded:
        sharded.run(2)
        saved = sharded.trainer.train_state
    with loop(2, False) as resumed:
        assert resumed.step == 2
        assert_trees_close(resumed.trainer.train_state, saved, rtol=0, atol=0)
        resumed.run(3)


def test_an_async_save_is_not_disturbed_by_the_next_steps_donating_the_arrays(tmp_path):
    trainer = build("Trainer", True, 4, dropout=0.0)
    batch = make_batch()
    trainer.one_step(batch, jax.random.key(0))
    expected = trainer.train_state
    checkpointer = Checkpointer(str(tmp_path), async_save=True)
    checkpointer.save(1, {part: trainer.saved_values(part) for part in PARTS})
    for step in range(1, 3):  # Donates (deletes) the buffers the save was given.
        trainer.one_step(batch, jax.random.key(step))
    checkpointer.close()
    _restore(trainer, str(tmp_path))
    assert_trees_close(trainer.train_state, expected, rtol=0, atol=0)


def test_a_run_on_one_mesh_resumes_on_other_mesh_shapes(tmp_path):
    """Saved on (data, fsdp, seq) = (1, 4, 1) (weights sharded 4 ways), resumed on (2, 1, 2)
    (replicated, the length split) and on one device: the same values, the same step."""
    from revtrain.data import CopyTask

    def loop(**devices):
        run = RunConfig(model=lambda mode="train": tiny_reversible_lm(d_model=64, dropout=0.0,
                                                                      mode=mode),
                        inputs=CopyTask(vocab_size=16, length=4, batch_size=4, seed=1),
                        schedule=3e-3, trainer_class=TRAINERS["Trainer"], **devices)
        return build_loop(run, EvalConfig(steps=0), CheckpointConfig(every=2),
                          LogConfig(progress=False), str(tmp_path))

    with loop(mesh_shape={"fsdp": 4}) as saved:
        saved.run(2)
        assert saved.trainer.fsdp and saved.trainer.device_footprint().weights_bytes < (
            sum(np.asarray(w).nbytes for w in jax.tree.leaves(saved.trainer.weights)) / 3)
        expected = saved.trainer.train_state
    batch, losses = make_batch(4), []
    for devices in ({"mesh_shape": {"data": 2, "seq": 2}}, {"n_devices": 1}):
        with loop(**devices) as resumed:
            assert resumed.step == 2
            assert_trees_close(resumed.trainer.train_state, expected, rtol=0, atol=0)
            losses.append(float(resumed.trainer.one_step(batch, jax.random.key(5))[0]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def _adam_or_sgd_run(tmp_path, name, optimizer, rate, steps, **devices):
    """Trains the tiny copy-task LM to ``steps`` in ``tmp_path/name`` (resuming what is
    there); returns its weights and the train losses by step."""
    import functools

    from revtrain.data import CopyTask
    from revtrain.models import ReversibleTransformerLM
    from revtrain.training import optimizer_fn, read_metrics

    model = functools.partial(ReversibleTransformerLM, vocab_size=8, d_model=8, d_ff=16,
                              n_layers=1, n_heads=2, max_len=16, dropout=0.0)
    run = RunConfig(model=model, inputs=CopyTask(vocab_size=8, length=4, batch_size=4),
                    optimizer=functools.partial(optimizer_fn, name=optimizer),
                    schedule=rate, trainer_class=TRAINERS["Trainer"], **devices)
    out = str(tmp_path / name)
    with build_loop(run, EvalConfig(steps=0), CheckpointConfig(every=0),
                    LogConfig(every=1, progress=False), out) as loop:
        loop.run(steps)
        weights = [np.asarray(w) for w in jax.tree.leaves(loop.trainer.host_values("weights"))]
    return weights, {r["step"]: r["loss"] for r in read_metrics(out, "train")}


@pytest.mark.parametrize("optimizer, rate", [("sgd", 0.1), ("adam", 1e-3)])
def test_a_run_resumed_on_another_mesh_stays_within_the_documented_tolerance(
        tmp_path, optimizer, rate):
    """docs/training.md: saved on data x fsdp = 2 x 2, resumed on one device and on seq=4
    and trained 10 more steps, against the run that never stopped: with SGD the weights
    agree to float32 rounding; with Adam a weight whose true gradient is 0 (the attention
    keys' bias) takes rounding noise as a gradient, which Adam scales up to the learning
    rate a step, so it drifts by at most ``rate`` per step; the losses agree to float32
    rounding either way."""
    import shutil

    saved_on, more = {"mesh_shape": {"data": 2, "fsdp": 2}}, 10
    straight, straight_losses = _adam_or_sgd_run(tmp_path, "straight", optimizer, rate,
                                                 2 + more, **saved_on)
    _adam_or_sgd_run(tmp_path, "saved", optimizer, rate, 2, **saved_on)
    for name, resumed_on in (("1 device", {"n_devices": 1}),
                             ("seq=4", {"mesh_shape": {"seq": 4}})):
        shutil.copytree(tmp_path / "saved", tmp_path / name)
        resumed, losses = _adam_or_sgd_run(tmp_path, name, optimizer, rate, 2 + more,
                                           **resumed_on)
        drift = max(float(np.max(np.abs(a - b))) for a, b in zip(resumed, straight,
                                                                   strict=True))
        assert drift <= (1e-6 if optimizer == "sgd" else rate * more), (name, drift)
        for step in range(3, 3 + more):
            assert losses[step] == pytest.approx(straight_losses[step], rel=1e-5), (name,
                                                                                    step)
