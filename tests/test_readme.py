"""The README stays true: its Python example runs and its set-up commands are the ones CI runs."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", _readme(), re.S)
    assert blocks, "README has no Python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # noqa: S102
    assert float(namespace["loss"]) > 0
    assert "layer0/gradients_l2" in namespace["stats"]


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
