"""Tests for revtrain.trainers.common.structure."""

import numpy as np
import pytest

from revtrain.trainers.common import structure


def test_check_same_structure_names_the_first_mismatching_path():
    with pytest.raises(ValueError, match=r"\['b'\]"):
        structure.check_same_structure({"a": 1.0, "c": 2.0}, {"a": 1.0, "b": 2.0}, "slots")
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        structure.check_same_structure({"a": np.ones(3)}, {"a": np.ones(2)}, "weights")


def test_structure_mismatch_names_both_paths_and_the_trainer_kind_for_slots():
    with pytest.raises(ValueError, match=r"at slots\[0\]\['x'\]: expected that path, got "
                                         r"slots\['x'\]; values from another kind of trainer"):
        structure.check_same_structure({"x": np.zeros(2)}, ({"x": np.zeros(2)},), "slots")
