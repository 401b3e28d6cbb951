"""Where, when and by what command a benchmark ran: the ``machine`` entry of its JSON.

Split from `benchmarks.harness`, which re-exports `machine_info` and `command_line`.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def machine_info(command: str | None = None) -> dict[str, Any]:
    """Where, when and by what the run happened (for the JSON and the Markdown header).

    Args:
      command: the command line that started the run (`command_line`); None leaves it out.

    Returns:
      ``date`` (UTC, ISO 8601), ``platform``, ``processor``, ``cpu_count``, the
      ``python``, ``jax`` and ``revtrain`` versions, ``commit`` (the checkout's git commit,
      ``+changes`` when its files differ from it; None outside a git checkout) and
      ``command``.
    """
    import jax  # Only for its version: the parent never starts a backend.

    import revtrain
    info = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "platform": platform.platform(), "processor": _cpu_name(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "jax": jax.__version__, "revtrain": revtrain.__version__,
            "commit": _git_commit()}
    return info | ({"command": command} if command is not None else {})


def command_line(argv: Sequence[str] | None) -> str:
    """The benchmark's command as typed from the repository root.

    ``argv`` is the flags a test passed to ``main`` (the command is then written as that
    call), or None for a run from the shell (``sys.argv``).
    """
    if argv is not None:
        return f"main({list(argv)!r})"
    script = Path(sys.argv[0]).resolve()
    name = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(name), *sys.argv[1:]])


def _git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10, check=True)
        changes = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=10,
                                 check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+changes" if changes.stdout.strip() else "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
