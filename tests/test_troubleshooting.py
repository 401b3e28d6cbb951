"""docs/troubleshooting.md's tables of bad arguments are true: each row's input gives its
one-line error.

The rows are read from the page, so the tables and this test cannot drift apart. Every row
must also leave the output directory as it was: nothing is written before a run is valid
(no run directory for ``revtrain-train``, no model file for ``revtrain-tokenizer``). Rows
name input files by placeholders (``<a Latin-1 file>``), made by `tests.text_files`.
"""
import os
import re
import shlex

import pytest

from revtrain import cli
from tests.cli_helpers import COPY_TASK, TINY
from tests.text_files import fill_in, make_text_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A_FILE = "<a file>"
A_LINK, TARGET = "<a broken link>", "<its missing target>"


def _rows(section: str = "## Bad arguments") -> list[tuple[str, str]]:
    with open(os.path.join(ROOT, "docs", "troubleshooting.md"), encoding="utf-8") as f:
        text = f.read().split(f"{section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(.+?)` \| `(.+?)` \|$", text, re.M)


TOKENIZER_SECTION = "## Bad tokenizer input"


def test_the_page_has_a_table_of_bad_arguments():
    assert len(_rows()) >= 10 and len(_rows(TOKENIZER_SECTION)) >= 5


@pytest.mark.parametrize("given, message", _rows(), ids=lambda x: x[:60])
def test_bad_input_fails_first_in_one_line_and_writes_nothing(tmp_path, capsys, given,
                                                              message):
    output_dir = str(tmp_path / "run")
    files = make_text_files(tmp_path.parent / f"{tmp_path.name}-inputs")
    given, message = fill_in(given, files), fill_in(message, files)
    if given == f"--output_dir={A_FILE}":
        (tmp_path / "run").write_text("not a directory")
        message = message.replace(A_FILE, output_dir)
        bindings = []
    elif given == f"--output_dir={A_LINK}":
        (tmp_path / "run").symlink_to(tmp_path / "moved")
        message = message.replace(A_LINK, output_dir).replace(TARGET, str(tmp_path / "moved"))
        bindings = []
    else:
        bindings = re.findall(r"--gin_bindings='([^']*)'", given)
        assert bindings, given
    argv = ["revtrain-train", f"--config_file={COPY_TASK}", f"--output_dir={output_dir}"]
    argv += [f"--gin_bindings={b}" for b in TINY + bindings]
    assert cli.train_main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"revtrain-train: error: {message} ("), err
    assert os.listdir(tmp_path) == (["run"] if not bindings else [])


@pytest.mark.parametrize("given, message", _rows(TOKENIZER_SECTION), ids=lambda x: x[:60])
def test_bad_tokenizer_input_fails_in_one_line_and_writes_no_model(tmp_path, capsys, given,
                                                                   message):
    files = make_text_files(tmp_path / "inputs")
    given, message = fill_in(given, files), fill_in(message, files)
    argv = ["revtrain-tokenizer", *shlex.split(given)]
    if not any(arg.startswith("--model_prefix=") for arg in argv):
        argv.append(f"--model_prefix={tmp_path / 'out' / 'sp'}")
    (tmp_path / "out").mkdir()
    assert cli.tokenizer_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"revtrain-tokenizer: error: {message}"]
    assert os.listdir(tmp_path / "out") == [] and sorted(os.listdir(tmp_path)) == [
        "inputs", "out"]
    assert os.listdir(files["<a directory>"]) == []
