"""Tests of revtrain/training/config.py: the run configuration dataclasses."""
import dataclasses
import re

import gin
import pytest

from revtrain import configurables
from revtrain.trainers import BlockOptions
from revtrain.training import CheckpointConfig, EvalConfig, LogConfig, RunConfig
from revtrain.training.config import LEGACY_BINDINGS, legacy_binding_error


@pytest.mark.parametrize("build, message", [
    (lambda: EvalConfig(every=-1), "EvalConfig.every=-1 must be >= 0"),
    (lambda: EvalConfig(steps=-1), "EvalConfig.steps=-1 must be >= 0 or None"),
    (lambda: EvalConfig(splits={"eval": None}), "EvalConfig.splits has a split named 'eval'"),
    (lambda: CheckpointConfig(max_to_keep=0), "CheckpointConfig.max_to_keep=0 must be >= 1"),
    (lambda: LogConfig(every=0), "LogConfig.every=0 must be >= 1 or None"),
    (lambda: RunConfig(n_devices=9), "RunConfig.n_devices=9 is more than the 4 local"),
    (lambda: RunConfig(schedule=-1.0), "RunConfig.schedule=-1.0 must be a finite number"),
    # Every switch is checked like the numbers, naming its binding.
    (lambda: RunConfig(fsdp=1), "RunConfig.fsdp=1 must be True or False; change the gin "
                                "binding RunConfig.fsdp"),
    (lambda: EvalConfig(eval_train="yes"), "EvalConfig.eval_train='yes' must be True or"),
    (lambda: CheckpointConfig(async_save=1), "CheckpointConfig.async_save=1 must be True or"),
    (lambda: CheckpointConfig(init_weights_only=None),
     "CheckpointConfig.init_weights_only=None must be True or False; change"),
    (lambda: LogConfig(progress=0), "LogConfig.progress=0 must be True or False or None"),
    (lambda: LogConfig(profile_steps=(1.5, 2)), "LogConfig.profile_steps=(1.5, 2) must be "
                                                "(first, last) integers"),
    (lambda: RunConfig(accumulate_steps=0), "RunConfig.accumulate_steps=0 must be >= 1; "
                                            "change the gin binding RunConfig.accumulate_steps"),
    (lambda: RunConfig(accumulate_steps=1.5), "RunConfig.accumulate_steps=1.5 must be an "
                                              "integer; change the gin binding"),
    (lambda: RunConfig(accumulate_steps=True), "RunConfig.accumulate_steps=True must be an "
                                               "integer"),
    # A block trainer's clip_global_norm would clip each micro-batch's gradient.
    (lambda: RunConfig(accumulate_steps=2, trainer_kwargs={"clip_global_norm": 1.0}),
     "RunConfig.accumulate_steps=2 with clip_global_norm=1.0 in RunConfig.trainer_kwargs "
     "would clip each micro-batch's gradient, not the accumulated one; bind "
     "optimizer_fn.clip_gradient_norm instead or set RunConfig.accumulate_steps = 1"),
    (lambda: RunConfig(accumulate_steps=4, trainer_kwargs={
        "options": BlockOptions(clip_global_norm=0.5)}),
     "RunConfig.accumulate_steps=4 with clip_global_norm=0.5 in RunConfig.trainer_kwargs"),
])
def test_fields_are_checked_when_built(build, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        build()


def test_configs_are_frozen_and_default_schedule_is_the_optimizers():
    config = RunConfig()
    assert config.schedule is None  # None: the optimizer's own learning rate.
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1
    with pytest.raises(ValueError, match="RunConfig.model is not set"):
        config.check_complete()


def test_gin_binds_fields_and_old_bindings_name_the_new_one():
    gin.clear_config()
    try:
        gin.parse_config(["EvalConfig.every = 7", "CheckpointConfig.max_to_keep = None",
                          "train.eval_every = 4"])
        configs = configurables.run_configs()
        assert configs["eval_config"].every == 7
        assert configs["checkpoint"].max_to_keep is None
        with pytest.raises(ValueError, match="^train.eval_every is now EvalConfig.every; "
                                             "change the gin binding"):
            configurables.train(output_dir=None, **configs)
    finally:
        gin.clear_config()
    assert str(legacy_binding_error(["learning_rate"])).startswith(
        "train.learning_rate is now RunConfig.schedule")
    assert set(LEGACY_BINDINGS) >= {"model", "inputs", "eval_steps", "log_every"}


@pytest.mark.parametrize("build, message", [
    (lambda: RunConfig(mesh_shape={"data": 2, "tensor": 2}),
     "RunConfig.mesh_shape={'data': 2, 'tensor': 2} has axis 'tensor'"),
    (lambda: RunConfig(mesh_shape={"fsdp": 1.5}), "RunConfig.mesh_shape={'fsdp': 1.5}: axis"),
    (lambda: RunConfig(mesh_shape={"fsdp": 4}, fsdp=True),
     "RunConfig.mesh_shape={'fsdp': 4} and RunConfig.fsdp are both set"),
    (lambda: RunConfig(mesh_shape={"data": 2, "fsdp": 4}).mesh(),
     "RunConfig.mesh_shape={'data': 2, 'fsdp': 4} has 8 devices but the run has 4"),
])
def test_a_bad_mesh_shape_is_one_line_naming_the_binding(build, message):
    with pytest.raises(ValueError, match="^" + message.replace(".", r"\.").replace(
            "{", r"\{").replace("}", r"\}").replace("(", r"\(")):
        build()


def test_gin_binds_a_mesh_shape_by_axis_name():
    gin.clear_config()
    try:
        gin.parse_config(["RunConfig.mesh_shape = {'data': 2, 'seq': 2}"])
        run = configurables.run_configs()["run"]
    finally:
        gin.clear_config()
    placement = run.placement()
    assert dict(placement.mesh.shape) == {"data": 2, "fsdp": 1, "seq": 2}
    # Evaluation splits rows only, over data x fsdp: a seq group counts once.
    assert placement.rows_mesh.devices.size == 2 and run.trainer_arguments() == {}


def test_trainer_kwargs_n_devices_places_the_run_when_run_config_does_not():
    """``trainer_kwargs={'n_devices': k}`` is the run's device count (it was dropped)."""
    from revtrain.training import RunConfig

    assert RunConfig(trainer_kwargs={"n_devices": 2}).placement().n_devices == 2
    assert RunConfig(n_devices=1, trainer_kwargs={"n_devices": 2}).placement().n_devices == 1
