"""A built wheel is complete: configs, py.typed, console scripts; it runs a config by name.

The wheel is installed with ``pip install --no-deps --target`` (its dependencies are the
test environment's) and run from a directory outside the repository, so nothing can come
from the source tree.
"""
import glob
import os
import re
import subprocess
import sys
import tomllib
import zipfile

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# pip's words when it cannot reach the package index (or the index has no such package).
_NO_INDEX = re.compile(r"(?i)failed to establish a new connection|network is unreachable|"
                       r"temporary failure in name resolution|no matching distribution|"
                       r"could not find a version that satisfies the requirement")


def _has_build_requirements() -> bool:
    """Whether this environment already holds pyproject.toml's build requirements, so the
    wheel builds without build isolation, i.e. without the package index."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    for text in requires:
        requirement = Requirement(text)
        try:
            if version(requirement.name) not in requirement.specifier:
                return False
        except PackageNotFoundError:
            return False
    return True


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """Built offline when the environment has the build requirements; else pip fetches
    them, and only a package index that cannot be reached skips the tests (saying so)."""
    out = tmp_path_factory.mktemp("dist")
    offline = _has_build_requirements()
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), ROOT]
    built = subprocess.run(argv + (["--no-build-isolation"] if offline else []),
                           capture_output=True, text=True)
    if built.returncode != 0 and not offline and _NO_INDEX.search(built.stderr):
        pytest.skip(f"the build requirements are not installed and the package index is "
                    f"unreachable, so no wheel was built: {built.stderr.strip()[-300:]}")
    assert built.returncode == 0, built.stderr
    [path] = glob.glob(str(out / "revtrain-*.whl"))
    return path


def test_wheel_ships_configs_and_marker(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    configs = sorted(os.path.basename(n) for n in names if n.startswith("revtrain/configs/")
                     and n.endswith(".gin"))
    assert configs == sorted(f for f in os.listdir(os.path.join(ROOT, "revtrain", "configs"))
                             if f.endswith(".gin"))
    assert "revtrain/py.typed" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "docs/", "examples/")) for n in names)


def test_installed_wheel_trains_a_config_by_name(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), wheel], check=True)
    env = dict(os.environ, PYTHONPATH=str(site))
    bindings = ["ReversibleTransformerLM.d_model=16", "ReversibleTransformerLM.d_ff=16",
                "ReversibleTransformerLM.n_layers=1", "train.steps=20", "EvalConfig.steps=1",
                "LogConfig.progress=False"]
    argv = [str(site / "bin" / "revtrain-train"), "--config_file=copy_task.gin",
            f"--output_dir={tmp_path / 'run'}"] + [f"--gin_bindings={b}" for b in bindings]
    result = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "final eval at step 20" in result.stdout
    version = subprocess.run([sys.executable, "-m", "revtrain", "--version"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, check=True)
    assert version.stdout.startswith("revtrain ")
    located = subprocess.run([sys.executable, "-c", "import revtrain; print(revtrain.__file__)"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert located.stdout.startswith(str(site))  # Not the source tree.
