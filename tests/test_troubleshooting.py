"""docs/troubleshooting.md's table of bad arguments is true: each row's input gives its
one-line error.

The rows are read from the page, so the table and this test cannot drift apart. Every row
must also leave the output directory as it was: nothing is written before a run is valid.
"""
import os
import re

import pytest

from revtrain import cli
from tests.cli_helpers import COPY_TASK, TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A_FILE = "<a file>"
A_LINK, TARGET = "<a broken link>", "<its missing target>"


def _rows() -> list[tuple[str, str]]:
    with open(os.path.join(ROOT, "docs", "troubleshooting.md"), encoding="utf-8") as f:
        section = f.read().split("## Bad arguments", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(.+?)` \| `(.+?)` \|$", section, re.M)


def test_the_page_has_a_table_of_bad_arguments():
    assert len(_rows()) >= 10


@pytest.mark.parametrize("given, message", _rows(), ids=lambda x: x[:60])
def test_bad_input_fails_first_in_one_line_and_writes_nothing(tmp_path, capsys, given,
                                                              message):
    output_dir = str(tmp_path / "run")
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
