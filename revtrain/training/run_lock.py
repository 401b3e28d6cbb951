"""`RunLock`: a training run's output directory has one writer at a time.

``revtrain-train`` takes the lock before it reads or writes anything in ``output_dir`` and
releases it on exit; ``revtrain-eval`` and ``revtrain-decode`` only read and never take it.
The lock is the file ``output_dir/run.lock``, created atomically (``O_CREAT | O_EXCL``),
holding the owner's process id, host name and process start time as JSON. A lock file whose
process is gone (same host, pid not running or reused by another process, checked with
psutil) is taken over with a warning; one from another host cannot be checked, so the error
says which file to delete to force it. This is the pid-file scheme of daemons and of
Paxml/TensorFlow's single-writer assumption made explicit; it needs no ``fcntl`` locks, which
network file systems often do not honour.

The lock file is written whole (a complete temporary file hard-linked to ``run.lock``,
`revtrain.training.run_files.write_atomic`), so revtrain never leaves an empty or partial
one, not even on a full disk. A ``run.lock`` that is unreadable all the same (empty, not
JSON, or JSON without an owner's pid, host and start time: damaged by hand, by a file
system, or left by an older version) names no process that could still hold it; it is taken
over with a warning that says what was wrong with it, as a daemon replaces a stale pid file,
rather than blocking the directory until someone deletes it.

A directory the lock created is removed again on release (or when the lock cannot be
taken) when nothing was written to it, so a run that fails validation leaves no trace.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import uuid

import psutil

from revtrain.training.run_directory import CHECKPOINT_DIR, LOCK_FILE, broken_link_error
from revtrain.training.run_files import write_atomic
from revtrain.training.write_failures import reporting_write_failures

logger = logging.getLogger(__name__)



class RunLockError(RuntimeError):
    """``output_dir`` is in use by another process, or is not a directory it can create."""


def _owner() -> dict:
    process = psutil.Process()
    return {"pid": process.pid, "host": socket.gethostname(),
            "started": process.create_time()}


def _is_alive(owner: dict) -> bool:
    """Whether the process of a same-host ``owner`` record still runs (pid not reused)."""
    try:
        process = psutil.Process(int(owner["pid"]))
        return abs(process.create_time() - float(owner["started"])) < 1.0
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return False


def _parse_owner(data: bytes) -> dict | str:
    """The owner record in a lock file's bytes, or why there is none (one short phrase)."""
    if not data.strip():
        return "it is empty"
    try:
        owner = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "it is not JSON"
    if not isinstance(owner, dict):
        return f"it holds a JSON {type(owner).__name__}, not an owner record"
    if not (isinstance(owner.get("pid"), int) and isinstance(owner.get("host"), str)
            and isinstance(owner.get("started"), (int, float))):
        return "it names no owner (pid, host and start time)"
    return owner


class RunLock:
    """Exclusive ownership of a run directory, as a context manager.

    Args:
      output_dir: the run directory; created (with parents) if missing.

    Raises (from `acquire` / ``__enter__``):
      RunLockError: when ``output_dir`` is a file, a symbolic link to a missing target
        (`revtrain.training.run_directory.broken_link_error`), cannot be created, or is
        locked by a
        running process (on this host) or by a process on another host.
      RunWriteError: the lock file cannot be written (a full disk, a read-only
        directory); one line, as every file of a run (`revtrain.training.write_failures`).
    """

    def __init__(self, output_dir: str):
        self.output_dir = os.path.abspath(output_dir)
        self.path = os.path.join(self.output_dir, LOCK_FILE)
        self._owner = _owner()
        self._created: str | None = None  # The topmost directory the lock created.
        self._held = False

    def acquire(self) -> None:
        """Takes the lock (taking over, with a warning, a dead process's lock on this host
        or an unreadable lock file).

        Raises:
          RunLockError, RunWriteError: as the class says; a directory this call created
            is removed.
        """
        self._make_dir()
        try:
            for _ in range(3):  # A takeover races with other starters at most once a loser.
                if self._try_create():
                    self._held = True
                    return
                data = self._read()
                if data is None:
                    continue  # Released meanwhile: try again.
                owner = _parse_owner(data)
                if isinstance(owner, str):
                    self._take_over(data, f"took over {self.path}: it was unreadable "
                                          f"({owner}), so it named no process that could "
                                          f"still hold it")
                else:
                    self._refuse_or_take_over(owner, data)
            raise RunLockError(f"could not take the lock {self.path}: other processes keep "
                               f"taking it; start one revtrain-train per --output_dir")
        except BaseException:
            self._remove_created_dirs()
            raise

    def release(self) -> None:
        """Removes the lock file if this process holds it, and a directory it left empty."""
        if not self._held:
            return
        self._held = False
        data = self._read()
        if data is not None and _parse_owner(data) == self._owner:
            os.remove(self.path)
        self._remove_created_dirs()

    def _remove_created_dirs(self) -> None:
        directory = self.output_dir
        while self._created and directory.startswith(self._created) and os.path.isdir(
                directory) and not os.listdir(directory):  # Left empty: remove.
            os.rmdir(directory)
            directory = os.path.dirname(directory)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def _make_dir(self) -> None:
        broken = broken_link_error("--output_dir", self.output_dir)
        if broken:
            raise RunLockError(broken)
        if os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir):
            raise RunLockError(f"--output_dir={self.output_dir} is a file, not a directory; "
                               f"choose a directory (it is created if missing)")
        missing = self.output_dir
        while not os.path.exists(os.path.dirname(missing)):
            missing = os.path.dirname(missing)
        self._created = None if os.path.exists(missing) else missing
        try:
            os.makedirs(self.output_dir, exist_ok=True)
        except OSError as e:
            raise RunLockError(f"cannot create --output_dir={self.output_dir}: "
                               f"{e.strerror}; choose a writable directory") from e

    def _try_create(self) -> bool:
        with reporting_write_failures(f"write {self.path}",
                                      os.path.join(self.output_dir, CHECKPOINT_DIR)):
            try:
                write_atomic(self.path, json.dumps(self._owner), overwrite=False)
            except FileExistsError:
                return False
        return True

    def _read(self) -> bytes | None:
        """The lock file's bytes, or None when there is no lock file."""
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _refuse_or_take_over(self, owner: dict, data: bytes) -> None:
        who = f"process {owner.get('pid')} on host {owner.get('host')}"
        if owner.get("host") != self._owner["host"]:
            raise RunLockError(f"{self.output_dir} is in use by {who}; if that run has "
                               f"ended, delete {self.path} to force it, else use another "
                               f"--output_dir")
        if _is_alive(owner):
            raise RunLockError(f"{self.output_dir} is in use by {who}; wait for it to end "
                               f"or use another --output_dir")
        self._take_over(data, f"took over {self.path} from {who}, which is no longer "
                              f"running")

    def _take_over(self, data: bytes, warning: str) -> None:
        """Removes the lock file holding ``data`` (unless another starter changed it
        meanwhile) and logs ``warning``; the caller then tries to create its own."""
        # Rename first: of several processes taking over at once, only one succeeds.
        stale = f"{self.path}.stale-{uuid.uuid4().hex}"
        try:
            os.rename(self.path, stale)
        except FileNotFoundError:
            return
        with open(stale, "rb") as f:
            moved = f.read()
        if moved != data:  # Another starter took it over first: give its lock back.
            with contextlib.suppress(FileExistsError):
                os.link(stale, self.path)
            os.remove(stale)
            return
        os.remove(stale)
        logger.warning("%s", warning)
