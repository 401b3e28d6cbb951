"""The README's shell commands run as written: every command that starts with
``.venv/bin/revtrain-`` in a ```sh block (a line, or a part of an ``&&`` chain), in order,
in a fresh directory.

Only two things change: ``.venv/bin/`` becomes this interpreter's bin directory (where
``pip install -e .`` put the console scripts), and each ``revtrain-train`` gets gin
bindings appended that shrink its config to seconds (a later binding wins in gin). The
bindings are chosen from what the command's config binds, so a new README command with a
shipped config needs no change here. Each train command on an output directory trains
one step more than the last one there, so a second command resumes the first run.
``revtrain-eval`` and ``revtrain-decode`` run exactly as written (they read the run's
``config.gin``). The directory holds a ``configs`` link to the repository's, as a clone
does.
"""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.subprocesses import ROOT, child_env

pytestmark = pytest.mark.slow

PREFIX = ".venv/bin/revtrain-"
SHELL_FENCES = ("```sh", "```bash", "```shell", "```console")
# Configurable -> bindings that make it tiny; used when the config binds the configurable.
TINY = {
    "ReversibleTransformerLM": ["d_model=16", "d_ff=32", "n_layers=1", "n_heads=2",
                                "max_len=32"],
    "TransformerLM": ["d_model=16", "d_ff=32", "n_layers=1", "n_heads=2", "max_len=32"],
    "TextFiles": ["sequence_length=16", "batch_size=2"],
    "CopyTask": ["batch_size=2"],
}
# Parameter -> its tiny value; used when the config binds that parameter.
TINY_PARAMETERS = {
    "ReversibleTransformerLM.ff_chunk_size": "8", "TransformerLM.ff_chunk_size": "8",
    "CausalAttention.block_size": "8", "LSHCausalAttention.chunk_len": "4",
    "CrossEntropyLoss.n_chunks": "2",
}
ALWAYS = ["EvalConfig.steps=1", "LogConfig.progress=False"]
MAX_LEN = 32  # The tiny models' key/value cache.


def quickstart_commands(markdown: str) -> list[str]:
    """The commands starting with `PREFIX` in shell code blocks, in order: whole lines, and
    the parts of ``&&`` chains (the set-up line ``python3 -m venv .venv && ... &&
    .venv/bin/revtrain-train ...`` trains the run the next lines use). A line ending in a
    backslash continues on the next."""
    lines, fence, pending = [], None, ""
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.strip()
            continue
        if fence not in SHELL_FENCES:
            continue
        pending += line.strip() if pending else line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
            continue
        lines.append(pending)
        pending = ""
    return [part.strip() for line in lines for part in line.split("&&")
            if part.strip().startswith(PREFIX)]


def _config_text(argv: list[str], cwd: str) -> str:
    """The text of every ``--config_file`` / ``--gin_file`` of a train command."""
    texts = []
    for arg in argv:
        match = re.match(r"--(?:config_file|gin_file)=(.+)", arg)
        if match:
            path = match.group(1)
            for candidate in (os.path.join(cwd, path), os.path.join(ROOT, "configs", path)):
                if os.path.isfile(candidate):
                    with open(candidate) as f:
                        texts.append(f.read())
                    break
    return "\n".join(texts)


def tiny_bindings(config: str, steps: int) -> list[str]:
    """Bindings that shrink what ``config`` (gin text) binds, and train ``steps`` steps."""
    bound = set(re.findall(r"^\s*([A-Za-z_]\w*)\.(\w+)\s*=", config, re.MULTILINE))
    names = {name for name, _ in bound} | set(re.findall(r"@(\w+)", config))
    bindings = [f"{name}.{value}" for name, values in TINY.items() if name in names
                for value in values]
    bindings += [f"{parameter}={value}" for parameter, value in TINY_PARAMETERS.items()
                 if tuple(parameter.split(".")) in bound]
    return bindings + ALWAYS + [f"train.steps={steps}"]


def _flag(argv: list[str], name: str) -> str | None:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return values[-1] if values else None


def _check_decode(argv: list[str], cwd: str, out: str, err: str) -> None:
    prompt = _flag(argv, "prompt")
    if prompt is not None:
        assert out.startswith(prompt), out
    [path] = re.findall(r"^wrote (\S+\.jsonl)$", err, re.MULTILINE)
    with open(os.path.join(cwd, path)) as f:
        records = [json.loads(line) for line in f]
    if prompt is not None and _flag(argv, "max_new_bytes") is None:
        # No --max_new_bytes: as far as the cache allows after the prompt, and a note.
        n_new = min(200, MAX_LEN - len(prompt.encode()))
        assert [len(r["tokens"]) for r in records] == [n_new], records
        assert f"revtrain-decode: continuing the prompt by {n_new} bytes" in err, err


def test_readme_commands_run_in_order_on_tiny_settings(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        commands = quickstart_commands(f.read())
    assert commands, f"README.md has no line starting with {PREFIX} in a ```sh block"
    run_in_order(commands, str(tmp_path))


def run_in_order(commands: list[str], cwd: str) -> None:
    """Runs README ``commands`` in ``cwd`` as the module docstring says; fails on the first
    that fails or does not print what it should."""
    bin_dir = os.path.dirname(sys.executable)
    os.symlink(os.path.join(ROOT, "configs"), os.path.join(cwd, "configs"))
    trained: dict[str, int] = {}  # output_dir -> steps trained there so far
    for command in commands:
        argv = shlex.split(command)
        tool = os.path.basename(argv[0])
        script = os.path.join(bin_dir, tool)
        assert os.path.isfile(script), f"{tool} is not installed in {bin_dir}: pip install -e ."
        argv[0] = script
        output_dir = _flag(argv, "output_dir")
        if output_dir is None:  # E.g. --version or --help: nothing to shrink or check.
            tool = "other"
        elif tool == "revtrain-train":
            steps = trained.get(output_dir, 1) + 1
            trained[output_dir] = steps
            argv += [f"--gin_bindings={b}" for b in tiny_bindings(_config_text(argv, cwd),
                                                                   steps)]
        elif output_dir not in trained:
            pytest.fail(f"README: {command!r} reads {output_dir}, which no command before "
                        f"it trains")
        done = subprocess.run(argv, cwd=cwd, env=child_env(), capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (f"README command failed: {command}\n(run as "
                                      f"{shlex.join(argv)})\n{done.stderr[-3000:]}")
        if tool == "revtrain-train":
            assert f"final eval at step {steps}: loss" in done.stdout, done.stdout[-2000:]
            if steps > 2:
                assert "restored the checkpoint of step" in done.stderr, done.stderr[-2000:]
        elif tool == "revtrain-decode":
            _check_decode(argv, cwd, done.stdout, done.stderr)


def test_commands_are_found_in_sh_blocks_and_chains_and_continuations_join():
    markdown = "\n".join([
        "```sh", "python3 -m venv .venv && .venv/bin/pip install -e . && "
        ".venv/bin/revtrain-train --config_file=configs/a.gin --output_dir=runs/a",
        ".venv/bin/revtrain-train --config_file=configs/a.gin \\",
        "  --output_dir=runs/a", "python3 -m venv .venv", "```",
        ".venv/bin/revtrain-eval --output_dir=prose", "```",
        ".venv/bin/revtrain-eval --output_dir=plain-block", "```",
        "```bash", ".venv/bin/revtrain-decode --output_dir=runs/a --prompt='The '", "```"])
    assert quickstart_commands(markdown) == [
        ".venv/bin/revtrain-train --config_file=configs/a.gin --output_dir=runs/a",
        ".venv/bin/revtrain-train --config_file=configs/a.gin --output_dir=runs/a",
        ".venv/bin/revtrain-decode --output_dir=runs/a --prompt='The '"]
    config = "RunConfig.model = @ReversibleTransformerLM\nCausalAttention.block_size = 512\n"
    assert tiny_bindings(config, 3) == [
        "ReversibleTransformerLM.d_model=16", "ReversibleTransformerLM.d_ff=32",
        "ReversibleTransformerLM.n_layers=1", "ReversibleTransformerLM.n_heads=2",
        "ReversibleTransformerLM.max_len=32", "CausalAttention.block_size=8", *ALWAYS,
        "train.steps=3"]
