"""Tests of revtrain/training/checkpoints/restore_templates.py: templates from shapes, not
values."""
import jax
import numpy as np
import pytest

from revtrain import trainers
from revtrain.trainers import TrainState
from revtrain.training import flatten_tree
from revtrain.training.checkpoints.restore_templates import (
    checkpoint_template,
    host_placeholder,
    value_signature,
)
from tests.training.test_loop import TRAINERS, _loop


def _record_reads(monkeypatch, trainer_class):
    """Records the parts read by ``trainer_class``'s value accessors (host or device)."""
    read = []
    for name in ("host_values", "saved_values"):
        method = getattr(trainer_class, name)
        monkeypatch.setattr(trainer_class, name, lambda self, part, method=method, name=name:
                            read.append((name, part)) or method(self, part))
    return read


def _signatures(tree):
    return {k: (np.shape(v), np.dtype(v.dtype)) for k, v in flatten_tree(tree).items()}


@pytest.mark.parametrize("trainer_class", TRAINERS, ids=lambda c: c.__name__)
def test_resume_template_reads_no_values(trainer_class, monkeypatch):
    with _loop(None, trainer_class, eval_steps=0) as loop:
        read = _record_reads(monkeypatch, trainer_class)
        template = loop._restore_template()
        assert read == []
        assert _signatures(template) == _signatures(loop._checkpoint_tree())
        for part in TrainState._fields:
            shardings = jax.tree.leaves(loop.trainer.value_shardings(part),
                                        is_leaf=lambda x: x is None)
            for leaf, sharding in zip(jax.tree.leaves(template[part]), shardings,
                                      strict=True):
                assert getattr(leaf, "sharding", None) == sharding


def test_value_signature_and_host_placeholder_hold_no_values():
    with _loop(None, trainers.Trainer, eval_steps=0) as loop:
        signature = value_signature(loop.trainer, "slots")
        rng = loop._rng
        template = checkpoint_template(loop.trainer, ("weights",), rng)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(signature))
    assert set(template) == {"weights", "step", "rng"}
    placeholder = host_placeholder((1000, 1000), np.float32)
    assert placeholder.shape == (1000, 1000) and placeholder.strides == (0, 0)
