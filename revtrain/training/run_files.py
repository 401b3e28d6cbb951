"""Writing and reading the small files revtrain keeps next to a run, safely.

Every such file (``run.lock``, ``checkpoints/retention.json``, ``config.gin`` and
``config_history/*.gin``, ``decoder_out/step_<N>.jsonl``) is written whole or not at all:
the text goes to a temporary file in the same directory, is flushed to disk, and is then
renamed over the target (``os.replace``) or, where an existing file must never be replaced,
hard-linked to it (``os.link`` fails when the target exists). A crash or a full disk leaves
the previous file (or none) and no partial one; the temporary file is removed on failure.
This is the write-then-rename idiom of git's lock files and of orbax's own checkpoints.

Reading is the callers' part: each says what an unreadable file means (`read_json` gives
the reason in one line).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import uuid
from typing import Any

# Errors of file systems that have no hard links (some FUSE and network mounts).
_NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)


class UnreadableFileError(ValueError):
    """A file revtrain wrote is empty, cut short or not what it should be; the message
    names the file and the reason."""


def write_atomic(path: str, text: str | bytes, *, overwrite: bool = True) -> None:
    """Writes ``text`` to ``path`` whole or not at all.

    Args:
      path: the file to write; its directory must exist.
      text: the content (a str is written as UTF-8, bytes as they are); must not be
        empty (an empty file is what a failed write leaves, so it is never written on
        purpose).
      overwrite: replace an existing ``path`` (``os.replace``); False raises
        FileExistsError instead (``os.link``; where the file system has no hard links,
        an ``O_EXCL`` create, which is exclusive but not atomic).

    Raises:
      ValueError: for an empty ``text``.
      FileExistsError: ``path`` exists and ``overwrite`` is False.
      OSError: the write failed (e.g. ``ENOSPC``); ``path`` is as it was.
    """
    if not text:
        raise ValueError(f"refusing to write an empty {path}")
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    temporary = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(temporary, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(temporary, path)
            return
        try:
            os.link(temporary, path)
        except OSError as e:
            if isinstance(e, FileExistsError) or e.errno not in _NO_LINKS:
                raise
            _write_exclusive(path, data)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)


def _write_exclusive(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError:
        os.remove(path)
        raise


def read_json(path: str) -> Any:
    """The JSON value in ``path``.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      UnreadableFileError: ``path`` is empty, not UTF-8 or not JSON; the message says
        which, in one line.
    """
    with open(path, "rb") as f:
        data = f.read()
    if not data.strip():
        raise UnreadableFileError(f"{path} is empty")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnreadableFileError(f"{path} is not JSON ({e})") from e
