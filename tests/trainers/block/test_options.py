"""`BlockOptions`: the block trainers' options as one value, checked when built, and the
keyword convenience that builds it (`resolve_options`)."""
import dataclasses

import jax
import pytest

from revtrain.trainers import BlockOptions, MemoryEfficientTrainer, ReversibleSerialTrainer
from revtrain.trainers.block.options import resolve_options
from tests.fsdp_models import blocks_and_loss
from tests.trainers.conftest import adam, make_batch
from tests.tree_utils import assert_trees_close


@pytest.mark.parametrize("fields, error, message", [
    ({"keep_every": 0}, ValueError, "keep_every=0 must be >= 1 or None"),
    ({"clip_global_norm": 0.0}, ValueError,
     "clip_global_norm=0.0 must be a finite number > 0 or None"),
    ({"clip_global_norm": float("inf")}, ValueError,
     "clip_global_norm=inf must be a finite number > 0 or None"),
    ({"clip_global_norm": "a"}, TypeError, "clip_global_norm='a' must be a finite number"),
    ({"keep_every": 1.5}, TypeError, "keep_every=1.5 must be an int >= 1 or None"),
    ({"keep_every": True}, TypeError, "keep_every=True must be an int >= 1 or None"),
    ({"keep_every": "2"}, TypeError, "keep_every='2' must be an int >= 1 or None"),
    ({"scan_window": 1}, ValueError, "scan_window=1 must be >= 2 repetitions"),
    ({"scan_window": 2.5}, TypeError, "scan_window=2.5 must be an int >= 2 or None"),
    ({"scan_layers": 1}, TypeError, "scan_layers=1 must be True or False"),
    ({"free_accelerators_on_step": "yes"}, TypeError,
     "free_accelerators_on_step='yes' must be True or False"),
])
def test_bad_options_are_refused_when_built(fields, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        BlockOptions(**fields)


def test_resolve_options_builds_from_fields_or_takes_the_value_never_both():
    defaults = BlockOptions(free_accelerators_on_step=True, scan_layers=False)
    assert resolve_options(None, defaults, keep_every=None) == defaults
    assert resolve_options(None, defaults, keep_every=2) == dataclasses.replace(
        defaults, keep_every=2)
    given = BlockOptions(clip_global_norm=1.0)
    assert resolve_options(given, defaults, keep_every=None,
                           free_accelerators_on_step=True) is given
    with pytest.raises(ValueError, match="options= was given with keep_every="):
        resolve_options(given, defaults, keep_every=2)
    with pytest.raises(TypeError, match="is not a BlockOptions"):
        resolve_options({"keep_every": 2}, defaults)


@pytest.mark.parametrize("cls", [ReversibleSerialTrainer, MemoryEfficientTrainer])
def test_options_as_one_value_train_as_the_keywords_do(cls):
    """The same options as a value or as keyword arguments: the same trainer, the same
    step (keep_every and clipping change the plan, so a mix-up would show)."""
    as_value = BlockOptions(keep_every=2, clip_global_norm=0.5,
                            free_accelerators_on_step=cls is MemoryEfficientTrainer,
                            scan_layers=cls is ReversibleSerialTrainer)
    batch = make_batch()
    losses, weights = [], []
    for kwargs in ({"keep_every": 2, "clip_global_norm": 0.5}, {"options": as_value}):
        blocks, loss = blocks_and_loss(dropout=0.0)
        trainer = cls(blocks, loss, adam, n_devices=1, **kwargs)
        assert trainer.options == as_value
        losses.append(float(trainer.one_step(batch, jax.random.key(0))[0]))
        weights.append(trainer.host_values("weights"))
    assert losses[0] == losses[1]
    assert_trees_close(weights[0], weights[1], rtol=0, atol=0)


def test_options_with_their_fields_are_refused_before_anything_is_built():
    blocks, loss = blocks_and_loss(dropout=0.0)
    with pytest.raises(ValueError, match="options= was given with keep_every="):
        ReversibleSerialTrainer(blocks, loss, adam, keep_every=2, options=BlockOptions())
