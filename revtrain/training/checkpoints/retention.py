"""Checkpoint retention that keeps the promises of earlier runs of a directory.

Retention is Paxml's: the newest ``max_to_keep`` checkpoints, plus, permanently, every step
that is a multiple of ``keep_period`` and one per ``keep_time_interval`` seconds (orbax
``LatestN``, ``EveryNSteps``, ``EveryNSeconds``). A "permanent" checkpoint must stay
permanent when the run is resumed with other bindings: the README's resume command does not
repeat ``keep_period``, and orbax, which knows only the current run's rules, would delete
the kept steps at the first save.

So each run that keeps checkpoints permanently records its promise in
``<checkpoint directory>/retention.json`` -- its ``keep_period`` and ``keep_time_interval``
and the last step it saved under them -- and later runs add the steps those promises cover
as an orbax ``CustomSteps`` rule: for a ``keep_period`` the multiples up to that last step,
for a ``keep_time_interval`` every checkpoint up to it (the earlier run kept only the
interval's checkpoints and its newest ``max_to_keep``, and which were which is not
recorded). A damaged record is rebuilt, with a warning, as a promise to keep every existing
checkpoint (`read_promises`). Steps after an earlier run's last step follow the current
run's rules only.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from orbax.checkpoint import checkpoint_managers as policies

from revtrain.training.run_directory import RETENTION_FILE
from revtrain.training.run_files import UnreadableFileError, read_json, write_atomic
from revtrain.training.write_failures import reporting_write_failures

logger = logging.getLogger(__name__)


def _seconds(interval: float | datetime.timedelta | None) -> float | None:
    """Seconds of ``interval``; a ValueError or TypeError when it is not a number."""
    if isinstance(interval, datetime.timedelta):
        return interval.total_seconds()
    return None if interval is None else float(interval)


def check_retention(max_to_keep: int | None, keep_period: int | None,
                    keep_time_interval: float | datetime.timedelta | None) -> None:
    """Raises ValueError for ``max_to_keep < 1``, ``keep_period`` not an integer >= 1, or
    an interval that is not a number > 0 (None passes for each)."""
    if max_to_keep is not None and max_to_keep < 1:
        raise ValueError(f"max_to_keep={max_to_keep} must be >= 1 or None (keep all)")
    if keep_period is not None and (isinstance(keep_period, bool) or not isinstance(
            keep_period, (int, np.integer)) or keep_period < 1):
        raise ValueError(f"keep_period={keep_period!r} must be an integer >= 1 or None")
    seconds = _seconds(keep_time_interval)
    if seconds is not None and not seconds > 0:
        raise ValueError(f"keep_time_interval={seconds} seconds must be > 0 or None")


def read_promises(directory: str, steps: Sequence[int] = ()) -> list[dict[str, Any]]:
    """The retention promises recorded in ``directory`` (oldest first; [] when none).

    The record is only a memory of earlier runs' rules, so a damaged one (empty, not JSON,
    or not a list of promises) does not stop a run: it is replaced, with a warning naming
    it, by the one promise that loses nothing -- every existing checkpoint (``steps``) is
    kept -- and rewritten so at the next save.

    Args:
      directory: the checkpoint directory.
      steps: the steps of its existing checkpoints (the rebuilt promise keeps them).
    """
    path = os.path.join(directory, RETENTION_FILE)
    try:
        record = read_json(path)
        promises = list(record["promises"])
        for promise in promises:
            if int(promise["last_step"]) < 0:
                raise ValueError(f"last_step={promise['last_step']} must be >= 0")
            # The rules CheckpointConfig's bindings pass: a keep_period of 0 would divide
            # by zero in `promised_steps`.
            check_retention(None, promise.get("keep_period"),
                            promise.get("keep_time_interval"))
        return promises
    except FileNotFoundError:
        return []
    except UnreadableFileError as e:
        reason = str(e).removeprefix(path + " ")
    except (KeyError, TypeError, ValueError) as e:
        reason = f"is not a retention record ({type(e).__name__}: {e})"
    last = max(steps, default=0)
    logger.warning("%s %s; it is rebuilt keeping every existing checkpoint up to step %d "
                   "(delete by hand those no earlier run needs kept)", path, reason, last)
    return [{"keep_period": None, "keep_time_interval": None, "keep_all": True,
             "last_step": int(last)}]


def promised_steps(promises: Sequence[dict[str, Any]], steps: Sequence[int]) -> list[int]:
    """Which of ``steps`` (existing checkpoints) earlier runs' ``promises`` keep."""
    kept = set()
    for promise in promises:
        last, period = promise["last_step"], promise.get("keep_period")
        for step in steps:
            if step <= last and (promise.get("keep_all")
                                 or promise.get("keep_time_interval") is not None
                                 or (period is not None and step % period == 0)):
                kept.add(step)
    return sorted(kept)


def record_promise(directory: str, promises: Sequence[dict[str, Any]],
                   keep_period: int | None,
                   keep_time_interval: float | datetime.timedelta | None,
                   last_step: int) -> None:
    """Writes ``promises`` plus this run's (kept up to ``last_step``) to the record file.

    Does nothing when this run promises nothing (neither ``keep_period`` nor
    ``keep_time_interval``) and there is nothing recorded. The file is replaced atomically.

    Raises:
      RunWriteError: the record could not be written (e.g. a full disk); it is as it was.
    """
    current = {"keep_period": keep_period, "keep_time_interval": _seconds(keep_time_interval),
               "last_step": int(last_step)}
    if keep_period is None and keep_time_interval is None:
        if not promises:
            return
        current = None
    record = {"promises": list(promises) + ([current] if current else [])}
    path = os.path.join(directory, RETENTION_FILE)
    with reporting_write_failures(f"write {path}", directory):
        write_atomic(path, json.dumps(record, indent=1))


def preservation_policy(max_to_keep: int | None, keep_period: int | None,
                        keep_time_interval: float | datetime.timedelta | None,
                        kept_steps: Sequence[int] = ()) -> Any:
    """orbax ``AnyPreservationPolicy``: newest N, every N steps, interval, ``kept_steps``.

    Raises:
      ValueError: as `check_retention`.
    """
    check_retention(max_to_keep, keep_period, keep_time_interval)
    rules = [policies.LatestN(n=max_to_keep)]
    if keep_period is not None:
        rules.append(policies.EveryNSteps(interval_steps=int(keep_period)))
    seconds = _seconds(keep_time_interval)
    if seconds is not None:
        rules.append(policies.EveryNSeconds(interval_secs=max(int(seconds), 1)))
    if kept_steps:
        rules.append(policies.CustomSteps(steps=list(kept_steps)))
    return policies.AnyPreservationPolicy(rules)
