"""The README stays true: its Python examples run, its set-up commands are the ones CI runs,
and its quick start is in the form the quick-start test reads."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_python_examples_run_in_order():
    blocks = re.findall(r"```python\n(.*?)```", _readme(), re.S)
    assert len(blocks) >= 3, "README lacks the layer, reversible-block and trainer examples"
    namespace: dict = {}
    for k, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {k}", "exec"), namespace)  # noqa: S102
    assert namespace["y"].shape == (8, 10)
    assert 0 < max(namespace["errors"]) < 1e-4, namespace["errors"]  # float32: rounding only
    assert float(namespace["loss"]) > 0
    n_layers = len(namespace["trainer"].layers)
    assert namespace["stats"]["layers/gradients_l2"].shape == (n_layers,)


def test_first_two_commands_are_the_main_job_and_the_tests():
    commands = re.findall(r"```sh\n(.*?)\n```", _readme(), re.S)
    main, tests = commands[0], commands[1]
    assert main.startswith("python3 -m venv .venv && ") and "revtrain-train" in main
    assert "configs/reversible_lm.gin" in main
    assert tests.startswith("python3 -m venv .venv && ") and "pytest" in tests
    assert "'.[test]'" in tests


def test_ci_runs_the_readme_test_command():
    found = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run"), "--print-command"],
                           capture_output=True, text=True, check=True)
    tests = re.findall(r"```sh\n(.*?)\n```", _readme(), re.S)[1]
    assert found.stdout.strip() == tests


def test_quick_start_trains_resumes_evaluates_and_decodes_the_default_run():
    section = _readme().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    lines = [line for block in re.findall(r"```sh\n(.*?)\n```", section, re.S)
             for line in block.splitlines()]
    assert all(line.startswith(".venv/bin/revtrain-") for line in lines), lines
    programs = [line.split()[0].removeprefix(".venv/bin/") for line in lines]
    assert programs == ["revtrain-train", "revtrain-train", "revtrain-eval", "revtrain-decode"]
    assert all("--output_dir=runs/reversible_lm" in line for line in lines)
    assert lines[-1] == ".venv/bin/revtrain-decode --output_dir=runs/reversible_lm --prompt='The '"


def test_the_readme_is_a_guide_not_a_log():
    assert len(_readme().splitlines()) < 300
