"""Which checkpoint can be read: damaged ones are skipped, vanished ones listed again.

A program reading a directory that a training run is saving into (``revtrain-decode``,
``revtrain-eval``, a resume) meets two kinds of failure, told apart here once for all of
them:

* a *damaged* checkpoint (a missing or cut file, an empty step directory): it stays
  unreadable, so it is skipped with a warning naming it and the reason, and an older one
  is tried;
* a *vanished* checkpoint (`CheckpointVanishedError`): its step directory was deleted
  while it was read, e.g. by the training run's retention (``max_to_keep``) after a newer
  save. A newer checkpoint exists then, so the directory is listed again and the newest
  one read (`newest_readable`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from revtrain.training.checkpoints.trees import CheckpointMismatchError
from revtrain.training.write_failures import short_reason

logger = logging.getLogger(__name__)

# How many times `newest_readable` lists a directory again after a checkpoint vanished.
MAX_RELISTS = 100


class CheckpointUnreadableError(OSError):
    """No checkpoint of a directory can be read; the message names the first failure."""


class CheckpointVanishedError(FileNotFoundError):
    """A checkpoint's step directory was deleted while it was read (e.g. by the retention
    of the run saving into the directory); a newer checkpoint may be read instead."""


@contextlib.contextmanager
def reading_step(directory: str, step: int) -> Iterator[None]:
    """Turns any failure of reading the checkpoint ``<directory>/<step>`` into a
    `CheckpointVanishedError` when that step directory no longer exists afterwards (a
    deleted step fails in many ways inside orbax and tensorstore).

    Raises:
      CheckpointVanishedError: the step directory is gone.
      CheckpointMismatchError: as raised inside (another model: not a vanished step).
    """
    where = os.path.join(directory, str(step))
    try:
        yield
    except CheckpointMismatchError:
        raise
    except Exception as e:
        if os.path.isdir(where):
            raise
        raise CheckpointVanishedError(f"{where} was deleted while it was read") from e


def newest_readable(directory: str, list_steps: Callable[[], list[int]],
                    read: Callable[[int], Any]) -> tuple[int, Any, list[int]]:
    """``read(step)`` of the newest checkpoint it succeeds on.

    Args:
      directory: the checkpoint directory (named in warnings and errors).
      list_steps: lists the complete checkpoints' steps afresh (re-reading the directory).
      read: reads one step; raises `CheckpointVanishedError` when the step was deleted
        meanwhile (see `reading_step`), any other error when it is damaged.

    Returns:
      ``(step, read(step), unreadable)``: the step read and the newer steps skipped as
      damaged, newest first.

    Raises:
      FileNotFoundError: there is no checkpoint (left).
      CheckpointUnreadableError: none can be read; names the newest one's failure, or
        says checkpoints are deleted faster than they can be read.
      CheckpointMismatchError: from ``read`` (another model: no older step helps).
    """
    damaged: dict[int, str] = {}
    for _ in range(MAX_RELISTS):
        steps = sorted(set(list_steps()) - set(damaged), reverse=True)
        for step in steps:
            where = os.path.join(directory, str(step))
            try:
                tree = read(step)
            except CheckpointMismatchError:
                raise
            except CheckpointVanishedError:
                logger.warning("the checkpoint %s was deleted while it was read; reading "
                               "the newest one again", where)
                break
            except Exception as e:  # noqa: BLE001  Damage shows as any orbax/tensorstore error.
                damaged[step] = f"{where}, fails with {short_reason(e)}"
                logger.warning("skipping the checkpoint %s: it cannot be read (%s); trying "
                               "the previous one", where, short_reason(e))
                continue
            return step, tree, sorted((s for s in damaged if s > step), reverse=True)
        else:  # Every listed step is damaged (or none is listed).
            if not damaged:
                raise FileNotFoundError(f"{directory} holds no checkpoint")
            newest = damaged[max(damaged)]
            raise CheckpointUnreadableError(
                f"none of the {len(damaged)} checkpoints in {directory} can be read; the "
                f"newest, {newest}")
    raise CheckpointUnreadableError(
        f"the checkpoints in {directory} were deleted {MAX_RELISTS} times while they were "
        f"read: the run saving there deletes them faster than they can be read; pass the "
        f"step of a kept checkpoint, or save with a larger max_to_keep")
