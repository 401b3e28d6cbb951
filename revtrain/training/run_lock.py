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

A directory the lock created is removed again on release when nothing was written to it, so
a run that fails validation leaves no trace.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import uuid

import psutil

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class RunLockError(RuntimeError):
    """``output_dir`` is in use by another process, or cannot hold a lock file."""


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


class RunLock:
    """Exclusive ownership of a run directory, as a context manager.

    Args:
      output_dir: the run directory; created (with parents) if missing.

    Raises (from `acquire` / ``__enter__``):
      RunLockError: when ``output_dir`` is a file, is not writable, or is locked by a
        running process (on this host) or by a process on another host.
    """

    def __init__(self, output_dir: str):
        self.output_dir = os.path.abspath(output_dir)
        self.path = os.path.join(self.output_dir, LOCK_FILE)
        self._owner = _owner()
        self._created: str | None = None  # The topmost directory the lock created.
        self._held = False

    def acquire(self) -> None:
        """Takes the lock (taking over a dead process's lock on this host, with a warning)."""
        self._make_dir()
        for _ in range(3):  # A takeover races with other starters at most once per loser.
            if self._try_create():
                self._held = True
                return
            owner = self._read_owner()
            if owner is None:
                continue  # Released (or half-written) meanwhile: try again.
            self._refuse_or_take_over(owner)
        raise RunLockError(f"could not take the lock {self.path}: other processes keep "
                           f"taking it; start one revtrain-train per --output_dir")

    def release(self) -> None:
        """Removes the lock file if this process holds it, and a directory it left empty."""
        if not self._held:
            return
        self._held = False
        if self._read_owner() == self._owner:
            os.remove(self.path)
        directory = self.output_dir
        while self._created and directory.startswith(self._created) and not os.listdir(
                directory):  # Remove the directories the lock created, if left empty.
            os.rmdir(directory)
            directory = os.path.dirname(directory)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def _make_dir(self) -> None:
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
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            raise RunLockError(f"cannot write the lock file {self.path}: {e.strerror}; "
                               f"choose a writable --output_dir") from e
        with os.fdopen(fd, "w") as f:
            json.dump(self._owner, f)
        return True

    def _read_owner(self) -> dict | None:
        try:
            with open(self.path) as f:
                owner = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return owner if isinstance(owner, dict) else None

    def _refuse_or_take_over(self, owner: dict) -> None:
        who = f"process {owner.get('pid')} on host {owner.get('host')}"
        if owner.get("host") != self._owner["host"]:
            raise RunLockError(f"{self.output_dir} is in use by {who}; if that run has "
                               f"ended, delete {self.path} to force it, else use another "
                               f"--output_dir")
        if _is_alive(owner):
            raise RunLockError(f"{self.output_dir} is in use by {who}; wait for it to end "
                               f"or use another --output_dir")
        # Rename first: of several processes taking over at once, only one succeeds.
        stale = f"{self.path}.stale-{uuid.uuid4().hex}"
        try:
            os.rename(self.path, stale)
        except FileNotFoundError:
            return
        with open(stale) as f:
            moved = json.load(f)
        if moved != owner:  # Another starter took it over first: give its lock back.
            with contextlib.suppress(FileExistsError):
                os.link(stale, self.path)
            os.remove(stale)
            return
        os.remove(stale)
        logger.warning("took over %s from %s, which is no longer running", self.path, who)
