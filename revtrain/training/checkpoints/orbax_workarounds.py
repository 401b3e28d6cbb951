"""Filters for orbax's and tensorstore's leftover reports after a failed read or write,
and the on-disk check of a step directory that keeps orbax from misreading a damaged one.

These install process-wide hooks (``sys.unraisablehook``, ``sys.excepthook`` and logging
filters on the ``asyncio`` and ``absl`` loggers) that drop only the reports described in
each function; `revtrain.training.checkpoints.checkpointer.Checkpointer` installs them when it
opens, restores or saves, and each installs itself once per process.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from revtrain.training.checkpoints.access import CheckpointPermissionError, access_problem

DEFAULT_ITEM = "default"  # orbax's directory name for a manager's single item.
_STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's per-step metadata file.
_TREE_METADATA = "_METADATA"  # orbax's metadata of the item's tree (paths, shapes, dtypes).
NO_TREE_METADATA = f"its metadata ({_TREE_METADATA}) is missing or unreadable"


def _is_closed_loop(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def drop_closed_event_loop_reports() -> None:
    """Keeps a failed restore's or save's leftover operations from printing tracebacks.

    When one array of a checkpoint cannot be read or written (a damaged file, a full
    disk), orbax raises at once and closes its asyncio event loop while tensorstore still
    completes the other reads or writes; each of those then reports
    ``RuntimeError('Event loop is closed')`` through ``sys.unraisablehook`` or (printed
    from tensorstore's threads) ``sys.excepthook``, seconds later or at exit, and asyncio
    logs the reads orbax never collected (`_orphaned_read_failures`). Those reports (and
    only those) are dropped; the failure itself is raised by `Checkpointer.restore` or
    `Checkpointer.save`.
    """
    previous = sys.unraisablehook
    if getattr(previous, "_revtrain_filter", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_closed_loop(unraisable.exc_value):
            previous(unraisable)

    previous_excepthook = sys.excepthook

    def excepthook(kind: type, value: BaseException, traceback: Any) -> None:
        if not _is_closed_loop(value):
            previous_excepthook(kind, value, traceback)

    hook._revtrain_filter = True
    sys.unraisablehook = hook
    sys.excepthook = excepthook
    logging.getLogger("asyncio").addFilter(_orphaned_read_failures)


def _orphaned_read_failures(record: logging.LogRecord) -> bool:
    """Drops asyncio's "Task exception was never retrieved" reports of tensorstore reads a
    failed restore left behind (orbax gathers the reads, raises the first failure and never
    collects the others); the failure itself is reported once by the caller."""
    error = record.exc_info[1] if record.exc_info else None
    orphaned = str(record.msg).startswith("Task exception was never retrieved")
    return not (orphaned and _is_tensorstore_read(error))


# orbax's own reports of a damaged step's metadata, logged while it lists the steps;
# `Checkpointer.restore` names such a step once, with what to do.
_STEP_METADATA_REPORTS = ("Metadata file does not exist: ",
                          "Failed to json parse Metadata file: ")


def _step_metadata_reports(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_STEP_METADATA_REPORTS)


def _is_tensorstore_read(error: BaseException | None) -> bool:
    text = str(error)
    return error is not None and ('"zarr" driver' in text or "OCDBT database" in text)


def drop_step_metadata_reports() -> None:
    """Drops orbax's log lines about a damaged step's metadata (absl logger), which it
    writes while it lists the steps; `Checkpointer.restore` names such a step once, with
    what to do."""
    if _step_metadata_reports not in logging.getLogger("absl").filters:
        logging.getLogger("absl").addFilter(_step_metadata_reports)


def check_step_layout(step_dir: str) -> None:
    """Raises FileNotFoundError (the reason, one line) unless ``step_dir`` has orbax's
    step metadata (``_CHECKPOINT_METADATA``, a JSON object) and its ``default`` item with
    the item's tree metadata (``default/_METADATA``; orbax, asked about an item without
    it, logs a warning of its own before failing); a `CheckpointPermissionError` when this
    user may not read it (such a directory looks empty)."""
    problem = access_problem(step_dir)
    if problem:
        raise CheckpointPermissionError(problem)
    if not os.path.isdir(os.path.join(step_dir, DEFAULT_ITEM)):
        raise FileNotFoundError(f"it has no {DEFAULT_ITEM}/ item (an empty or partly "
                                f"deleted step directory)")
    if not os.path.isfile(os.path.join(step_dir, DEFAULT_ITEM, _TREE_METADATA)):
        raise FileNotFoundError(NO_TREE_METADATA)
    try:
        with open(os.path.join(step_dir, _STEP_METADATA)) as f:
            metadata = json.load(f)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"its {_STEP_METADATA} is missing or not JSON ("
                                f"{type(e).__name__})") from e
    if not isinstance(metadata, dict):
        raise FileNotFoundError(f"its {_STEP_METADATA} is not a JSON object")
