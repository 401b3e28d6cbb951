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
