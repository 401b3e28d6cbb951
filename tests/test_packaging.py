"""A built wheel is complete: configs, py.typed, console scripts; it runs a config by name.

The wheel is installed with ``pip install --no-deps --target`` (its dependencies are the
test environment's) and run from a directory outside the repository, so nothing can come
from the source tree.
"""
import glob
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out),
                    ROOT], check=True)
    [path] = glob.glob(str(out / "revtrain-*.whl"))
    return path


def test_wheel_ships_configs_and_marker(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    configs = sorted(os.path.basename(n) for n in names if n.startswith("revtrain/configs/")
                     and n.endswith(".gin"))
    assert configs == sorted(f for f in os.listdir(os.path.join(ROOT, "revtrain", "configs"))
                             if f.endswith(".gin"))
    assert "revtrain/py.typed" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "docs/")) for n in names)


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
