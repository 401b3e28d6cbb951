"""Whether this process may read (and change) a run's checkpoints and files, asked before
training.

A step directory that this user cannot read looks, to orbax and to a plain ``os.path``
check, like an empty one, and one it cannot change cannot be moved aside or deleted by
retention: a run that took it for damaged would train every remaining step and die at its
first save. So a run that saves checks its checkpoint directory and every step directory in
it first (`check_checkpoint_access`), and a run that only reads names the permission
problem when it skips a step (`access_problem`). The run directory's own files (metrics,
TensorBoard events, configs) are checked likewise (`check_run_access`). The checks use
``os.access``, which asks for the real user's rights; root passes them (as it passes the
file system's).
"""

from __future__ import annotations

import os
import stat

from revtrain.training.write_failures import checkpoint_steps


class CheckpointPermissionError(PermissionError):
    """A checkpoint directory or step this process may not read or change; the message
    names the entry, its mode and owner, and the fix."""


_RIGHTS = {os.R_OK: "read rights (r)", os.R_OK | os.W_OK: "read and write rights (rw-)",
           os.R_OK | os.X_OK: "read and search rights (r-x)",
           os.R_OK | os.W_OK | os.X_OK: "read, write and search rights (rwx)"}


def _denied(entry: str, is_dir: bool, write: bool, write_files: bool = False) -> str | None:
    """Why ``entry`` may not be used, or None: a directory is listed and entered (and,
    with ``write``, changed); a file is read (and, with ``write_files``, written)."""
    needed = (os.R_OK | os.X_OK | (os.W_OK if write else 0)) if is_dir else (
        os.R_OK | (os.W_OK if write_files else 0))
    if os.access(entry, needed):
        return None
    rights = _RIGHTS[needed]
    try:
        info = os.stat(entry)
        whose = (f"mode {stat.filemode(info.st_mode)}, owner uid {info.st_uid}, this "
                 f"process uid {os.geteuid()}")
    except OSError as e:
        whose = e.strerror or type(e).__name__
    return f"permission denied: this user needs {rights} on {entry} ({whose})"


def access_problem(path: str, write: bool = False, write_files: bool = False) -> str | None:
    """The first entry of ``path`` (a directory) and everything under it that this process
    may not read (with ``write``: directories it may not change either; with
    ``write_files``: files it may not write), as ``'permission
    denied: this user needs <rights> on <entry> (mode ..., owner uid ..., this process
    uid ...)'``; None when all may be used (or ``path`` does not exist)."""
    if not os.path.lexists(path):
        return None
    problem = _denied(path, os.path.isdir(path), write, write_files)
    if problem or not os.path.isdir(path):
        return problem
    for root, dirs, files in os.walk(path):
        for name in dirs:
            problem = _denied(os.path.join(root, name), True, write, write_files)
            if problem:
                return problem
        for name in files:
            problem = _denied(os.path.join(root, name), False, write, write_files)
            if problem:
                return problem
    return None


def check_checkpoint_access(directory: str) -> None:
    """Checks, before a run that saves trains, that it may read and change ``directory``
    (a checkpoint directory) and each of its step directories.

    Raises:
      CheckpointPermissionError: one line naming the entry, the permission problem, and
        the fix: give this user access, or move the step out of ``directory``.
    """
    if not os.path.exists(directory):
        return
    problem = _denied(directory, True, write=True)
    if problem:
        raise CheckpointPermissionError(
            f"the checkpoint directory {directory} cannot be used: {problem}; give this "
            f"user read and write access to it (or run as its owner), then run the same "
            f"command")
    for step in reversed(checkpoint_steps(directory)):
        step_dir = os.path.join(directory, str(step))
        problem = access_problem(step_dir, write=True)
        if problem:
            raise CheckpointPermissionError(
                f"the checkpoint {step_dir} cannot be read or replaced: {problem}; give "
                f"this user read and write access to it (chmod -R u+rwX {step_dir}, or "
                f"run as its owner) or move it out of {directory}, then run the same "
                f"command; nothing was trained")


def check_run_access(output_dir: str, entries: tuple[str, ...]) -> None:
    """Checks, before a run trains, that it may write ``output_dir`` and each existing
    entry of ``entries`` (names in it: files are appended to, directories get new files),
    so that no step is trained whose metrics or config cannot be written.

    Raises:
      CheckpointPermissionError: one line naming the entry, the permission problem and
        the fix.
    """
    for entry in (output_dir, *(os.path.join(output_dir, name) for name in entries)):
        if not os.path.exists(entry):
            continue
        problem = (_denied(entry, True, write=True) if entry == output_dir else
                   access_problem(entry, write=True, write_files=True))
        if problem:
            raise CheckpointPermissionError(
                f"the run directory {output_dir} cannot be written: {problem}; give this "
                f"user write access to it (chmod -R u+rwX {entry}, or run as its owner), "
                f"then run the same command; nothing was trained")
