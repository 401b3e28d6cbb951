"""Every script in examples/ runs as a user runs it (``python examples/<name>.py --tiny``, a
process of its own on one CPU device) and prints what it promises."""
import math
import os
import re
import subprocess
import sys

import pytest

from tests.subprocesses import ROOT, child_env

pytestmark = pytest.mark.slow

EXAMPLES = os.path.join(ROOT, "examples")
SCRIPTS = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))


def _run(name: str, *args: str, cwd) -> subprocess.CompletedProcess:
    argv = [sys.executable, os.path.join(EXAMPLES, name), "--tiny", *args]
    done = subprocess.run(argv, cwd=cwd, env=child_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}"
    return done


def _floats(pattern: str, text: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, text)]


def test_the_readme_lists_every_example_and_each_has_a_docstring_and_tiny_sizes():
    with open(os.path.join(EXAMPLES, "README.md")) as f:
        readme = f.read()
    assert SCRIPTS == sorted(set(re.findall(r"\[`(\w+\.py)`\]\(\1\)", readme)))
    for name in SCRIPTS:
        with open(os.path.join(EXAMPLES, name)) as f:
            source = f.read()
        assert source.startswith('"""') and '"--tiny"' in source, name


def test_train_lm_trains_evaluates_and_checkpoints(tmp_path):
    out = _run("train_lm.py", f"--output_dir={tmp_path / 'run'}", cwd=tmp_path)
    train = _floats(r"step \d+ train: loss (\S+)", out.stderr)
    assert len(train) == 2 and all(math.isfinite(x) for x in train)  # Steps 2 and 4.
    [(loss, bits)] = re.findall(r"final eval at step 4: loss (\S+) bits_per_byte (\S+)",
                                out.stdout)
    assert math.isfinite(float(loss)) and float(bits) == pytest.approx(
        float(loss) / math.log(2), abs=1e-3)  # Bits per byte of a byte-level LM.
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2", "4"]


def test_custom_reversible_block_reconstructs_and_trains(tmp_path):
    out = _run("custom_reversible_block.py", cwd=tmp_path).stdout
    [error] = _floats(r"reconstruction error after 2 blocks \(float32\): (\S+)", out)
    assert 0 <= error < 1e-5
    losses = _floats(r"step \d+ loss (\S+)", out)
    assert len(losses) == 5 and losses[-1] < 0.7 * losses[0]


def test_memory_efficient_peak_stays_within_a_budget_the_weights_exceed(tmp_path):
    out = _run("memory_efficient.py", cwd=tmp_path).stdout
    [(weights, budget, peak)] = re.findall(
        r"weights (\d+) bytes > budget (\d+) bytes >= peak (\d+) bytes", out)
    assert int(weights) > int(budget) >= int(peak) > 0
    assert "(ledger, at " in out  # CPU: the ledger of the trainer's dispatches.
    assert re.search(r"at most 2 of \d+ layers resident at once", out)  # 1 + n_async.
    assert all(math.isfinite(x) for x in _floats(r"step \d+ loss (\S+)", out))


def test_long_context_blockwise_attention_is_exact_and_trains(tmp_path):
    out = _run("long_context.py", cwd=tmp_path).stdout
    [difference] = _floats(r"outputs differ by at most (\S+)", out)
    assert difference < 1e-4
    losses = _floats(r"step \d+ \(blockwise attention, 64 bytes\): loss (\S+)", out)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_two_processes_train_one_model(tmp_path):
    out = _run("two_processes.py", f"--output_dir={tmp_path / 'run'}", cwd=tmp_path).stdout
    for i in range(2):
        assert (f"process {i} of 2: 1 local of 2 devices; its slice of the global batch of "
                f"8: inputs [4, 16]") in out
    evals = re.findall(r"process (\d): eval at step 2: (.*)", out)
    assert [p for p, _ in evals] == ["0", "1"] and evals[0][1] == evals[1][1]
    assert "both processes report the same eval metrics" in out
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]
