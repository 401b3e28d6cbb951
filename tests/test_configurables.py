"""Tests of revtrain/configurables.py: every integer binding is checked as one."""
import inspect

import gin
import pytest

from revtrain import configurables


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def _integer_parameters():
    """(gin name, parameter) of every registered constructor's ``int`` / ``int | None``
    parameter, read from the signatures here so a new one is covered by this test too."""
    found = [("train", "steps")]
    for _, constructors in configurables.REGISTRY:
        for constructor in constructors:
            for p in inspect.signature(constructor).parameters.values():
                if p.annotation in ("int", "int | None"):
                    found.append((constructor.__name__, p.name))
    return found


def test_every_integer_parameter_of_every_configurable_refuses_a_float_naming_it():
    found = _integer_parameters()
    assert ("CopyTask", "batch_size") in found and ("TextFiles", "sequence_length") in found
    assert len(found) > 60
    for name, parameter in found:
        gin.clear_config()
        gin.parse_config([f"{name}.{parameter} = 4.5"])
        with pytest.raises(ValueError, match=rf"^{name}\.{parameter}=4\.5 must be an "
                           rf"integer.*; change the gin binding {name}\.{parameter}$"):
            configurables.check_integer_bindings()


@pytest.mark.parametrize("bindings, message", [
    (["CopyTask.batch_size = 'abc'"], "CopyTask.batch_size='abc' must be an integer; "),
    (["CopyTask.batch_size = True"], "CopyTask.batch_size=True must be an integer; "),
    (["ReversibleTransformerLM.d_model = '8'"],
     "ReversibleTransformerLM.d_model='8' must be an integer; change the gin binding "
     "ReversibleTransformerLM.d_model"),
    (["SIZE = 16.7", "TextFiles.sequence_length = %SIZE"],
     "TextFiles.sequence_length=16.7 must be an integer"),
    (["RevNet.widths = [8, 2.5]"], r"RevNet.widths=\[8, 2.5\] must be a sequence of integers"),
    (["LogConfig.profile_steps = (1, 2.0)"],
     r"LogConfig.profile_steps=\(1, 2.0\) must be a tuple of integers or None"),
    (["RunConfig.mesh_shape = {'data': 2.0}"],
     "RunConfig.mesh_shape={'data': 2.0} must be a mapping to integers or None"),
    (["CheckpointConfig.max_to_keep = 1.0"],
     "CheckpointConfig.max_to_keep=1.0 must be an integer or None"),
    (["RunConfig.trainer_class = @ReversibleSerialTrainer",
      "RunConfig.trainer_kwargs = {'keep_every': 2.5}"],
     r"RunConfig.trainer_kwargs\['keep_every'\]=2.5 must be an integer or None "
     r"\(ReversibleSerialTrainer.keep_every\); change the gin binding RunConfig.trainer_kwargs"),
    (["RunConfig.trainer_kwargs = {'n_devices': '2'}"],
     r"RunConfig.trainer_kwargs\['n_devices'\]='2' must be an integer or None \(Trainer"),
])
def test_a_binding_that_is_not_an_integer_is_one_line_naming_it(bindings, message):
    gin.parse_config(bindings)
    with pytest.raises(ValueError, match=message):
        configurables.check_integer_bindings()
    with pytest.raises(ValueError, match=message):  # Before anything is built.
        configurables.run_configs()


def test_integers_none_macros_and_references_pass():
    gin.parse_config([
        "SIZE = 4", "CopyTask.batch_size = %SIZE", "CopyTask.length = 3",
        "ReversibleTransformerLM.ff_chunk_size = None", "RevNet.widths = [8, 16]",
        "LSHCausalAttention.n_buckets = [2, 4]", "LogConfig.profile_steps = (1, 2)",
        "RunConfig.mesh_shape = {'data': 2}", "RunConfig.schedule = @warmup_rsqrt_decay()",
        "RunConfig.model = @ReversibleTransformerLM", "warmup_rsqrt_decay.peak_value = 1e-3",
        "optimizer_fn.b2 = 0.98", "RunConfig.trainer_class = @MemoryEfficientTrainer",
        "RunConfig.trainer_kwargs = {'n_async_layers': 2, 'free_accelerators_on_step': True}",
    ])
    configurables.check_integer_bindings()
