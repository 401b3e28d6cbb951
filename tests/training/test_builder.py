"""Tests of revtrain/training/builder.py: a run's programs are checked before they write."""
import functools
import os

import pytest

from revtrain.data import CopyTask
from revtrain.layers import LSHCausalAttention
from revtrain.models import ReversibleTransformerLM
from revtrain.training import CheckpointConfig, EvalConfig, LogConfig, RunConfig, build_loop
from tests.fsdp_models import TRAINERS


@pytest.mark.parametrize("trainer_name", list(TRAINERS))
def test_a_layer_that_refuses_the_seq_split_is_found_before_anything_is_written(
        tmp_path, trainer_name):
    model = functools.partial(ReversibleTransformerLM, vocab_size=8, d_model=8, d_ff=16,
                              n_layers=1, n_heads=2, max_len=16,
                              attention_type=LSHCausalAttention)
    run = RunConfig(model=model, inputs=CopyTask(vocab_size=8, length=4, batch_size=4),
                    trainer_class=TRAINERS[trainer_name],
                    mesh_shape={"data": 2, "seq": 2})
    out = str(tmp_path / "run")
    with pytest.raises(ValueError) as error:
        build_loop(run, EvalConfig(steps=0), CheckpointConfig(), LogConfig(progress=False),
                   out)
    assert str(error.value).startswith(
        "RunConfig.mesh_shape={'data': 2, 'seq': 2} splits the length over seq=2, but "
        "LSHCausalAttention sorts positions into hash buckets along the length, which "
        "sequence_sharded(axis_name='seq', n_shards=2, length=8) splits over devices; use "
        "attention_type=CausalAttention")
    assert not os.path.exists(out)  # No config.gin, config_history/ or tensorboard/.


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_every_trainer_builds_itself_from_a_model_and_matches_its_constructor(name):
    """`build_trainer` asks the class (``from_model``), with no type test; the result is
    the trainer its constructor builds from the same layers: the same loss and weights
    after a step."""
    import jax

    from revtrain import layers as tl
    from revtrain.training import build_trainer
    from tests.fsdp_models import blocks_and_loss, build
    from tests.trainers.conftest import adam, make_batch
    from tests.tree_utils import assert_trees_close

    blocks, loss = blocks_and_loss(dropout=0.0)
    model = tl.Serial(*[layer for std, revs in blocks for layer in (std, *revs)])
    built = build_trainer(TRAINERS[name], model, loss, adam, n_devices=2)
    direct = build(name, fsdp=False, n_devices=2, dropout=0.0, model=(blocks, loss))
    assert type(built) is TRAINERS[name]
    results = [trainer.one_step(make_batch(), jax.random.key(0))[0] for trainer in
               (built, direct)]
    assert float(results[0]) == pytest.approx(float(results[1]), rel=1e-6)
    assert_trees_close(built.host_values("weights"), direct.host_values("weights"))


def test_build_trainer_refuses_a_class_without_from_model():
    from revtrain.training import build_trainer

    class Custom:
        def __init__(self, *args, **kwargs):
            pass

    with pytest.raises(TypeError, match=r"has no from_model\(model, loss_layer, "):
        build_trainer(Custom, object(), object(), None)


def _step_jaxpr(trainer, batch):
    """The text of the jaxpr of the trainer's step, traced for the arguments it gets."""
    import jax

    class Recorder:
        text = None

        def on_dispatch(self, label, fn, args):
            if label == "train_step" and self.text is None:
                self.text = str(jax.make_jaxpr(fn)(*args))
    recorder = Recorder()
    trainer.observers.append(recorder)
    trainer.one_step(batch, jax.random.key(0))
    return recorder.text


def test_run_config_trainer_kwargs_remat_reaches_the_trainer():
    """``RunConfig.trainer_kwargs = {'remat': ..., 'remat_policy': '<name>'}`` (as gin binds
    it) builds a `Trainer` that checkpoints its layers, with the plain trainer's step."""
    import re

    import gin
    import jax

    from revtrain import configurables
    from revtrain import layers as tl
    from revtrain.trainers import Trainer
    from revtrain.training import build_trainer
    from tests.fsdp_models import blocks_and_loss
    from tests.trainers.conftest import adam, make_batch

    gin.clear_config()
    try:
        gin.parse_config(["RunConfig.trainer_kwargs = {'remat': 'layer', "
                          "'remat_policy': 'dots_with_no_batch_dims_saveable'}"])
        run = configurables.run_configs()["run"]
    finally:
        gin.clear_config()
    assert run.trainer_arguments() == {"remat": "layer",
                                       "remat_policy": "dots_with_no_batch_dims_saveable"}
    trainers = []
    for arguments in ({}, run.trainer_arguments(), {"remat": 2}):
        blocks, loss = blocks_and_loss(dropout=0.0)
        model = tl.Serial(*[layer for std, revs in blocks for layer in (std, *revs)])
        trainers.append(build_trainer(Trainer, model, loss, adam, n_devices=2, **arguments))
    batch = make_batch()
    texts = [_step_jaxpr(trainer, batch) for trainer in trainers]
    checkpoints = [len(re.findall(r"\b(?:remat2|checkpoint)\[", text)) for text in texts]
    assert checkpoints[0] == 0 and checkpoints[1] > 0 and checkpoints[2] > 0
    assert f"policy={jax.checkpoint_policies.dots_with_no_batch_dims_saveable!r}" in texts[1]
    losses = [float(trainer.one_step(batch, jax.random.key(1))[0]) for trainer in trainers]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert losses[2] == pytest.approx(losses[0], rel=1e-6)


@pytest.mark.parametrize("trainer_kwargs, message", [
    ({"remat": 0}, r"remat=0 must be None, 'layer' \(checkpoint every layer\) or an int "),
    ({"remat": True}, "remat=True must be None, 'layer' "),
    ({"remat": "every"}, "remat='every' must be None, 'layer' "),
    ({"remat": "layer", "remat_policy": "full"},
     "remat_policy='full' is not a policy of jax.checkpoint_policies; use one of "),
])
def test_a_bad_remat_in_trainer_kwargs_stops_the_run_before_anything_is_written(
        tmp_path, trainer_kwargs, message):
    model = functools.partial(ReversibleTransformerLM, vocab_size=8, d_model=8, d_ff=16,
                              n_layers=1, n_heads=2, max_len=16)
    run = RunConfig(model=model, inputs=CopyTask(vocab_size=8, length=4, batch_size=4),
                    n_devices=1, trainer_kwargs=trainer_kwargs)
    out = str(tmp_path / "run")
    with pytest.raises(ValueError, match=f"^{message}") as error:
        build_loop(run, EvalConfig(steps=0), CheckpointConfig(), LogConfig(progress=False),
                   out)
    assert "\n" not in str(error.value)
    assert not os.path.exists(out)
