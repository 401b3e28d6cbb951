"""One line for a file of a run that could not be written, whichever writer failed.

A run writes checkpoints (orbax), ``metrics.jsonl`` and TensorBoard event files,
``config.gin`` and ``config_history/``, ``checkpoints/retention.json``, ``run.lock``,
``tokenizer.json`` and ``tokenizer.model``, ``decoder_out/``, and moves unreadable steps to
``checkpoints_unreadable/``. When one of them cannot be written -- most often because the disk is
full -- the command ends with one line that says what could not be written, why, which
checkpoint is intact, and what to do::

    could not write <dir>/metrics.jsonl: the disk is full (No space left on device); the
    newest checkpoint, step 6, is intact; free space and run the same command to resume

Every writer reports through `reporting_write_failures` (the checkpointer through
`write_failure`), so the lines differ only in what was being written.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

NO_SPACE = "No space left on device"  # strerror(ENOSPC), also in tensorstore's messages.
RESUME = "run the same command to resume"


class RunWriteError(OSError):
    """A file of a run could not be written (e.g. a full disk); the message names the
    file, the cause, the newest checkpoint that is intact, and what to do."""


def checkpoint_steps(directory: str) -> list[int]:
    """Steps of the step directories in a checkpoint ``directory``, ascending ([] when it
    does not exist); orbax's temporary directories of saves in progress are not steps."""
    try:  # Not isdir, then listdir: the directory may go in between (a `close`).
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(name) for name in names if name.isdigit())


def short_reason(error: BaseException) -> str:
    """A short one-line reason (tensorstore appends its whole JSON spec to messages)."""
    text = " ".join(str(error).split()).split(" [tensorstore_spec=")[0]
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (an OSError, or orbax's or tensorstore's report of one) says the
    disk is full."""
    return getattr(error, "errno", None) == errno.ENOSPC or NO_SPACE in str(error)


def write_failure(what: str, error: BaseException, checkpoint_dir: str, *,
                  before_step: int | None = None, then: str = RESUME) -> str:
    """The one-line message of a write that failed.

    Args:
      what: what could not be done, e.g. ``'write <dir>/metrics.jsonl'``.
      error: the failure.
      checkpoint_dir: the run's checkpoint directory, read for its newest step.
      before_step: only steps below this count (a save of this step failed).
      then: what to run once the cause is fixed.

    Returns:
      ``could not <what>: <cause>; <the newest intact checkpoint>; <fix> and <then>``.
    """
    full = is_disk_full(error)
    cause = f"the disk is full ({NO_SPACE})" if full else short_reason(error)
    steps = [s for s in checkpoint_steps(checkpoint_dir)
             if before_step is None or s < before_step]
    intact = (f"the newest checkpoint, step {steps[-1]}, is intact" if steps else
              "no earlier checkpoint is there" if before_step is not None else
              "no checkpoint is saved yet")
    return (f"could not {what}: {cause}; {intact}; {'free space' if full else 'fix the cause'}"
            f" and {then}")


@contextlib.contextmanager
def reporting_write_failures(what: str, checkpoint_dir: str, *,
                             then: str = RESUME) -> Iterator[None]:
    """Turns an OSError of the block (a full disk, a read-only directory) into one
    `RunWriteError` (`write_failure`'s message), chained to it.

    Args:
      what: what the block writes, e.g. ``'write <dir>/metrics.jsonl'``.
      checkpoint_dir: the run's checkpoint directory (its newest step is named).
      then: what to run once the cause is fixed.

    Raises:
      RunWriteError: the block raised an OSError (a `RunWriteError` passes unchanged).
    """
    try:
        yield
    except RunWriteError:
        raise
    except OSError as e:
        raise RunWriteError(write_failure(what, e, checkpoint_dir, then=then)) from e
