"""Checkpoints written by earlier code restore and resume (tests/training/data/README.md)."""
import os
import shutil

import numpy as np
import pytest

from revtrain.training import Checkpointer, flatten_tree
from tests.training.data import make_checkpoints

SAVED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "saved_runs")


def _copy(name, tmp_path):
    out = str(tmp_path / name)
    shutil.copytree(os.path.join(SAVED, name, "checkpoints"), os.path.join(out, "checkpoints"))
    return out


def _expected(name, file):
    with np.load(os.path.join(SAVED, name, file)) as data:
        return dict(data)


def _assert_equal(values, expected, rtol=0.0):
    assert sorted(values) == sorted(expected)
    for key, value in values.items():
        np.testing.assert_allclose(value, expected[key], rtol=rtol, atol=0, err_msg=key)


@pytest.mark.parametrize("name", sorted(make_checkpoints.TRAINERS))
def test_saved_run_restores_its_values_and_resumes(name, tmp_path):
    out = _copy(name, tmp_path)
    with make_checkpoints.build(make_checkpoints.TRAINERS[name], out) as loop:
        assert loop.step == loop.restored_step == make_checkpoints.STEPS
        _assert_equal(make_checkpoints.host_values(loop), _expected(name, "expected.npz"))
        loop.run(make_checkpoints.STEPS + 1)
        weights = {k: v for k, v in make_checkpoints.host_values(loop).items()
                   if k.startswith("weights")}
    _assert_equal(weights, _expected(name, "expected_next.npz"), rtol=1e-6)


@pytest.mark.parametrize("name", sorted(make_checkpoints.TRAINERS))
def test_saved_run_weights_restore_without_the_optimizer(name):
    expected = _expected(name, "expected.npz")
    checkpointer = Checkpointer(os.path.join(SAVED, name, "checkpoints"), read_only=True)
    try:
        template = {"weights": None, "state": None}
        with make_checkpoints.build(make_checkpoints.TRAINERS[name], None) as loop:
            template = {part: loop.trainer.host_values(part) for part in template}
        values = flatten_tree(checkpointer.restore_values(template, make_checkpoints.STEPS))
    finally:
        checkpointer.close()
    _assert_equal({k: np.asarray(v) for k, v in values.items()},
                  {k: v for k, v in expected.items() if k.split("/")[0] in template})
