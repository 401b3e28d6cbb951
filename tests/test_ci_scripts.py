"""The CI helper scripts: the minimum-version pins follow the extras that are installed."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _min_constraints():
    spec = importlib.util.spec_from_file_location("min_constraints",
                                                  ROOT / ".ci" / "min_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pins_cover_only_the_installed_extras():
    lower_bounds = _min_constraints().lower_bounds
    setup_cfg = str(ROOT / "setup.cfg")
    test = lower_bounds(setup_cfg, ["test"])
    # test = tfds-cpu (which names tfds) + bench + dev: the nested extras are followed.
    for name in ("jax", "optax", "tensorflow-datasets", "tensorflow-cpu", "matplotlib",
                 "pytest"):
        assert name in test, name
    # The docs extra is not part of test: pinning it would ask for a package never installed
    # (the version check then fails on a missing distribution).
    assert "mkdocs" not in test
    both = lower_bounds(setup_cfg, ["test", "docs"])
    assert set(both) == set(test) | {"mkdocs", "mkdocstrings"}
    assert set(lower_bounds(setup_cfg)) == set(both)  # no extras named: all of them
    assert lower_bounds(setup_cfg, []) == {
        name: version for name, version in test.items()
        if name in {"jax", "jaxlib", "numpy", "optax", "equinox", "orbax-checkpoint",
                    "gin-config", "absl-py", "psutil", "tqdm", "tensorboardX"}}


def test_an_unknown_extra_is_one_error():
    with pytest.raises(ValueError, match="extra 'nope' is not declared"):
        _min_constraints().lower_bounds(str(ROOT / "setup.cfg"), ["nope"])
