"""Tests for revtrain.trainers.transfers."""

import jax
import numpy as np
import pytest

from revtrain.trainers import transfers


def test_on_accelerator_rejects_a_missing_device():
    with pytest.raises(ValueError, match=r"device index 9 does not exist"):
        transfers.on_accelerator(np.ones(2), 9)
    y = transfers.on_accelerator(np.ones(2), 1)
    assert y.devices() == {jax.local_devices()[1]}


def test_on_cpu_gives_numpy():
    assert isinstance(transfers.on_cpu({"a": jax.numpy.ones(2)})["a"], np.ndarray)
