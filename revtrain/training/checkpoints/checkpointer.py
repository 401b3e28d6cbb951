"""`Checkpointer`: saves and restores flat checkpoints with orbax, Paxml-style retention.

Each checkpoint is the flat form of a pytree (`revtrain.training.checkpoints.trees`), one
``orbax.checkpoint.CheckpointManager`` step directory per step.

Retention, as Paxml's checkpoint manager: the newest ``max_to_keep`` checkpoints, plus,
permanently, every checkpoint whose step is a multiple of ``keep_period`` and one per
``keep_time_interval`` seconds (orbax ``LatestN``, ``EveryNSteps`` and ``EveryNSeconds``
preservation policies); what earlier runs of the directory kept permanently stays kept
(`revtrain.training.checkpoints.retention`). Saves are atomic: orbax writes into a temporary
directory and renames it when complete, so a crash mid-save leaves the previous checkpoint the
newest restorable one.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from revtrain.training.barriers import barrier
from revtrain.training.checkpoints import retention
from revtrain.training.checkpoints.access import check_checkpoint_access
from revtrain.training.checkpoints.orbax_workarounds import (
    DEFAULT_ITEM,
    NO_TREE_METADATA,
    check_step_layout,
    drop_closed_event_loop_reports,
    drop_step_metadata_reports,
)
from revtrain.training.checkpoints.readable import (  # noqa: F401  (re-exported)
    CheckpointUnreadableError,
    CheckpointVanishedError,
    newest_readable,
    reading_step,
)
from revtrain.training.checkpoints.trees import (
    SEPARATOR,
    check_matches,
    flatten_tree,
    signatures,
    unflatten_tree,
)
from revtrain.training.run_directory import UNREADABLE_SUFFIX
from revtrain.training.write_failures import (  # noqa: F401  (short_reason: re-exported)
    RunWriteError,
    checkpoint_steps,
    reporting_write_failures,
    short_reason,
    write_failure,
)

logger = logging.getLogger(__name__)


class CheckpointSaveError(RunWriteError):
    """A checkpoint could not be written (e.g. a full disk); the message names the step,
    the directory, the cause and the newest checkpoint that is intact
    (`revtrain.training.write_failures`)."""


class Checkpointer:
    """Saves and restores flat pytree checkpoints under ``directory`` with orbax.

    Args:
      directory: where the step directories (``<directory>/<step>``) go; created.
      max_to_keep: how many of the newest checkpoints to keep (None: all).
      keep_period: also keep, permanently, every checkpoint whose step is a multiple of
        this (Paxml's ``keep_period``); None disables.
      keep_time_interval: also keep, permanently, one checkpoint per this many seconds (a
        number or ``datetime.timedelta``; Paxml's ``keep_interval_timedelta``); None
        disables.
      async_save: write in a background thread (orbax async checkpointing); `save`
        returns once the arrays are copied. Call `wait_until_finished` or `close` before
        exiting.
      cleanup_tmp: delete temporary directories left by a crashed save when opening
        (orbax's ``cleanup_tmp_directories``) an existing ``directory``; only for the one
        process that saves.
      read_only: only restore (``revtrain-eval``, ``revtrain-decode``, a warm start's
        source): nothing is created, written or deleted, not even ``directory``, and the
        retention record is not read.

    A ``directory`` this object created is removed again by `close` when nothing was
    saved into it, so a run that fails before its first save leaves no empty
    ``checkpoints/``.

    Attributes:
      restored_step: the step of the checkpoint the last `restore` or `restore_values`
        read (None before any).
      unreadable_steps: the steps the last restore of the newest checkpoint skipped as
        unreadable.

    Raises:
      ValueError: for ``max_to_keep < 1``, ``keep_period < 1`` or a non-positive interval.
      CheckpointPermissionError: (unless ``read_only``) this user may not read or change
        ``directory`` or one of its step directories (`check_checkpoint_access`).
    """

    def __init__(self, directory: str, max_to_keep: int | None = 3,
                 keep_period: int | None = None,
                 keep_time_interval: float | datetime.timedelta | None = None,
                 async_save: bool = False, cleanup_tmp: bool = False,
                 read_only: bool = False):
        self.directory = os.path.abspath(directory)
        drop_step_metadata_reports()
        self._keep = (keep_period, keep_time_interval)
        self._created = not read_only and not os.path.exists(self.directory)
        self._read_only = read_only
        if read_only:
            retention.check_retention(max_to_keep, keep_period, keep_time_interval)
            self._promises = []
            # Not orbax's read_only, which warns on every use: it never saves, so nothing
            # is deleted either; create=False keeps a missing directory missing.
            options = ocp.CheckpointManagerOptions(create=False)
        else:  # Before anything is trained: what cannot be read or replaced stops here.
            check_checkpoint_access(self.directory)
            existing = checkpoint_steps(self.directory)
            self._promises = retention.read_promises(self.directory, existing)
            kept = retention.promised_steps(self._promises, existing)
            # A directory this object creates holds no crashed save; and orbax's cleanup
            # lists it in a thread that `close` does not wait for, so it could race
            # `close`'s removal of the still-empty directory (a FileNotFoundError).
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=async_save,
                cleanup_tmp_directories=cleanup_tmp and not self._created,
                preservation_policy=retention.preservation_policy(
                    max_to_keep, keep_period, keep_time_interval, kept))
        self.unreadable_steps: list[int] = []
        self.restored_step: int | None = None
        self._saving: int | None = None  # The step of a save not known to be complete.
        self._async = async_save
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              handler_registry=_handler_registry())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of all complete checkpoints, ascending."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, tree: Any) -> bool:
        """Saves ``tree`` as the checkpoint of ``step``; returns whether it was written.

        A step equal to the newest checkpoint's is not written again (returns False). A step
        *older* than the newest checkpoint is skipped with a warning, as Paxml does, since
        the newer checkpoint would otherwise hide it on restore. With several processes,
        every process must call this; `multihost_utils.sync_global_devices` brackets the
        save.
        """
        if self._read_only:
            raise ValueError(f"this Checkpointer of {self.directory} is read-only; open it "
                             f"without read_only=True to save")
        self._set_aside_unreadable()
        latest = self.latest_step()
        if latest is not None and step <= latest:
            if step < latest:
                logger.warning("not saving the checkpoint of step %d: it is older than the "
                               "newest checkpoint (step %d) in %s", step, latest,
                               self.directory)
            return False
        flat = flatten_tree(tree)
        if jax.process_index() == 0:  # Before saving: the save may delete old steps.
            retention.record_promise(self.directory, self._promises, *self._keep, step)
        barrier(f"revtrain_checkpoint_save_start_{step}")
        drop_closed_event_loop_reports()  # A failed write's leftover writes, as `restore`.
        self._saving = int(step)
        with self._reporting_save_failures():
            saved = self._manager.save(int(step), args=ocp.args.StandardSave(flat),
                                       force=True)
        if not self._async:
            self._saving = None  # Written; an asynchronous save is known at the wait.
        barrier(f"revtrain_checkpoint_save_end_{step}")
        return bool(saved)

    @contextlib.contextmanager
    def _reporting_save_failures(self) -> Iterator[None]:
        """Turns a failure of the save in progress (orbax's, tensorstore's, the file
        system's) into one `CheckpointSaveError` that says what is intact."""
        try:
            yield
        except Exception as e:
            if self._saving is None or isinstance(e, RunWriteError):
                raise
            step, self._saving = self._saving, None
            raise CheckpointSaveError(write_failure(
                f"save the checkpoint of step {step} in {self.directory}", e,
                self.directory, before_step=step)) from e

    def restore(self, template: Any, step: int | None = None) -> Any:
        """Restores the checkpoint of ``step`` (default: the newest readable one).

        Without ``step``, a checkpoint that cannot be read (a missing or damaged file) is
        skipped with a warning naming it and the reason, and the next older one is tried;
        nothing is deleted. The skipped steps are listed in `unreadable_steps`; the next
        `save` moves them to ``<directory>_unreadable/`` (so they neither hide the new
        checkpoints nor get deleted by retention).

        Args:
          template: a pytree with the structure, shapes and dtypes to restore (e.g. the
            current trainer's values); its values are not used. ``jax.Array`` and
            ``jax.ShapeDtypeStruct`` leaves are restored as ``jax.Array`` s in their
            sharding (`restore_targets`), the others as numpy arrays.
          step: which checkpoint; None for the newest readable one.

        Returns:
          A pytree with ``template``'s structure.

        Raises:
          FileNotFoundError: when there is no checkpoint (of ``step``).
          CheckpointUnreadableError: when no checkpoint can be read; names the directory
            and the newest checkpoint's failure.
          CheckpointMismatchError: (a ValueError) when a readable checkpoint's paths,
            shapes or dtypes differ from the template's; names the first mismatching path.
        """
        self.wait_until_finished()
        drop_closed_event_loop_reports()  # Before: a failed read may report at once.
        if step is not None:
            tree = self._restore_step(template, step)
            self.restored_step = step
            return tree
        return self._newest_readable(lambda each: self._restore_step(template, each))

    def _newest_readable(self, read: Callable[[int], Any]) -> Any:
        """``read(step)`` of the newest checkpoint it succeeds on (`newest_readable`): the
        one fallback of `restore` and `restore_values` without a step. Damaged steps are
        skipped with a warning and listed in `unreadable_steps`; a step deleted while it
        was read makes the directory listed again. The step read is `restored_step`."""
        def list_steps() -> list[int]:
            self._manager.reload()
            return list(self._manager.all_steps())

        step, tree, self.unreadable_steps = newest_readable(self.directory, list_steps, read)
        self.restored_step = step
        return tree

    def _set_aside_unreadable(self) -> None:
        """Moves the checkpoints `restore` skipped out of the way of new saves."""
        if not self.unreadable_steps:
            return
        aside = self.directory + UNREADABLE_SUFFIX
        for step in self.unreadable_steps if jax.process_index() == 0 else ():
            target = os.path.join(aside, str(step))
            while os.path.exists(target):
                target += "_"
            with reporting_write_failures(f"move the unreadable checkpoint {self.directory}/"
                                          f"{step} to {target}", self.directory):
                os.makedirs(aside, exist_ok=True)
                os.rename(os.path.join(self.directory, str(step)), target)
            logger.warning("moved the unreadable checkpoint of step %d to %s", step, target)
        self.unreadable_steps = []
        barrier("revtrain_checkpoint_set_aside")
        self._manager.reload()

    def _restore_step(self, template: Any, step: int) -> Any:
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"{self.directory} holds no checkpoint of step {step}")
        expected = flatten_tree(template)
        with reading_step(self.directory, step):
            self._check_step(step, expected)
            flat = self._manager.restore(step, args=ocp.args.StandardRestore(expected))
        return unflatten_tree(flat, template)

    def _check_step(self, step: int, expected: Mapping[str, Any],
                    roots: Collection[str] | None = None) -> None:
        """Checks ``step``'s saved paths (those under ``roots``; None: all), shapes and
        dtypes against ``expected`` (a `flatten_tree` result) without reading arrays.

        The step directory's layout is checked on disk first (`check_step_layout`), so orbax is
        only asked about a step that has its ``default`` item: orbax's manager decides
        once, on the first step it reads, whether its checkpoints hold one unnamed item,
        and an empty step directory read first would make it misread every later step.

        Raises:
          CheckpointPermissionError: this user may not read the step directory.
          FileNotFoundError: the step's layout or metadata is missing or unreadable.
          CheckpointMismatchError: as `check_matches`.
        """
        found = {k: v for k, v in self.saved_signatures(step).items()
                 if roots is None or k.split(SEPARATOR)[0] in roots}
        check_matches(signatures(expected), found,
                      f"checkpoint {os.path.join(self.directory, str(step))}")

    def saved_signatures(self, step: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{flat path: (shape, dtype)}`` of the checkpoint of ``step``, from its
        metadata (no array is read); raises as `_check_step` (a mismatch aside)."""
        check_step_layout(os.path.join(self.directory, str(step)))
        metadata = self._manager.metadata(step).item_metadata
        tree = None if metadata is None else getattr(metadata, "tree", None)
        if tree is None:
            raise FileNotFoundError(NO_TREE_METADATA)
        return {k: (tuple(m.shape), np.dtype(m.dtype)) for k, m in tree.items()}

    def reload(self) -> None:
        """Re-reads the directory: sees checkpoints other processes saved or deleted since."""
        self._manager.reload()

    def restore_values(self, template: Mapping[str, Any],
                       step: int | None = None) -> dict[str, Any]:
        """Restores only ``template``'s top-level entries of the checkpoint of ``step``.

        For programs that need a model's values but no optimizer (``revtrain-eval``,
        ``revtrain-decode``, a weights-only warm start): ``template`` is e.g.
        ``{'weights': ..., 'state': ...}``. The other entries of the checkpoint (``slots``,
        ``step``, ``rng``) are not read from disk (orbax's partial restore,
        ``PyTreeRestore(partial_restore=True)``). Without ``step``, the newest readable
        checkpoint, skipping unreadable ones with a warning as `restore` does; its step is
        then `restored_step`.

        Raises:
          FileNotFoundError: when there is no checkpoint (of ``step``: e.g. retention
            deleted it after it was listed), or the metadata of ``step`` is unreadable.
          CheckpointUnreadableError: without ``step``, when no checkpoint can be read.
          CheckpointMismatchError: naming the first path whose shape or dtype differs, or
            that is missing.
        """
        drop_closed_event_loop_reports()  # A damaged file's leftover reads, as `restore`.
        if step is None:
            return self._newest_readable(lambda each: self._restore_values(template, each))
        values = self._restore_values(template, step)
        self.restored_step = step
        return values

    def _restore_values(self, template: Mapping[str, Any], step: int) -> dict[str, Any]:
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"{self.directory} holds no checkpoint of step {step}")
        expected = flatten_tree(template)
        with reading_step(self.directory, step):  # A step deleted meanwhile: vanished.
            self._check_step(step, expected, roots=tuple(template))
            flat = self._manager.restore(step, args=ocp.args.PyTreeRestore(
                item=expected, partial_restore=True,
                restore_args={k: ocp.RestoreArgs(restore_type=np.ndarray) for k in expected}))
        return unflatten_tree(flat, template)

    def wait_until_finished(self) -> None:
        """Blocks until an asynchronous save has finished.

        Raises:
          CheckpointSaveError: the save failed; names the step and what is intact.
        """
        with self._reporting_save_failures():
            self._manager.wait_until_finished()
        self._saving = None

    def close(self) -> None:
        """Finishes pending saves and releases the manager.

        Raises:
          CheckpointSaveError: as `wait_until_finished`.
        """
        with self._reporting_save_failures():
            self._manager.close()
        self._saving = None
        if self._created and os.path.isdir(self.directory) and not os.listdir(
                self.directory) and jax.process_index() == 0:
            os.rmdir(self.directory)  # Nothing was saved: leave no trace.


def _handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """The flat tree is orbax's single default item, saved by `StandardCheckpointHandler`.

    Registering it up front (rather than on the first save) lets a fresh manager read a
    step's metadata before restoring it.
    """
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for args in (ocp.args.StandardSave, ocp.args.StandardRestore):
        registry.add(DEFAULT_ITEM, args, ocp.StandardCheckpointHandler)
    # The same files read by the general handler, for `restore_values`' partial restore.
    registry.add(DEFAULT_ITEM, ocp.args.PyTreeRestore, ocp.PyTreeCheckpointHandler)
    return registry
