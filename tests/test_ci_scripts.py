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
                    "gin-config", "absl-py", "psutil", "tqdm", "tensorboardX",
                    "sentencepiece"}}


def test_an_unknown_extra_is_one_error():
    with pytest.raises(ValueError, match="extra 'nope' is not declared"):
        _min_constraints().lower_bounds(str(ROOT / "setup.cfg"), ["nope"])


def test_names_extras_and_markers_compare_as_pip_reads_them(tmp_path):
    setup_cfg = tmp_path / "setup.cfg"
    setup_cfg.write_text(
        "[options]\ninstall_requires =\n    jax>=0.8.2\n"
        "    oldlib>=1.0; python_version < '3.0'\n"
        "[options.extras_require]\n"
        "tfds-cpu =\n    tensorflow-cpu>=2.19.0\n"
        "docs =\n    mkdocs>=1.6.1\n    Docstring_Parser>=0.16\n"
        "test =\n    RevTrain[tfds_cpu,Docs]\n    docstring-parser>=0.16\n")
    lower_bounds = _min_constraints().lower_bounds
    # The self-reference and its extras in any spelling are followed; one distribution
    # spelled two ways is one pin; a requirement whose marker excludes this Python is
    # not installed, so it is not pinned.
    # (The first spelling read is printed: ``test``'s own line comes before its extras'.)
    assert lower_bounds(str(setup_cfg), ["Test"]) == {
        "jax": "0.8.2", "docstring-parser": "0.16", "mkdocs": "1.6.1",
        "tensorflow-cpu": "2.19.0"}
    setup_cfg.write_text(setup_cfg.read_text().replace("Docstring_Parser>=0.16",
                                                       "Docstring_Parser>=0.17"))
    with pytest.raises(ValueError, match="two lower bounds"):
        lower_bounds(str(setup_cfg), ["test"])


def test_every_test_the_ci_scripts_name_exists():
    """A test file moved or a test renamed must not leave .ci/min_versions naming a path
    pytest cannot find (it would fail CI after the whole suite passed)."""
    import ast
    import re

    root = ROOT
    named = set()
    for script in (root / ".ci").iterdir():
        if script.is_file() and script.suffix not in (".py",):
            named.update(re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", script.read_text()))
    assert named, "no test path found in .ci/: the pattern no longer matches the scripts"
    for path, test in named:
        assert (root / path).is_file(), f".ci names {path}, which does not exist"
        if test:
            functions = {node.name for node in ast.walk(ast.parse((root / path).read_text()))
                         if isinstance(node, ast.FunctionDef)}
            assert test in functions, f".ci names {path}::{test}, which does not exist"
