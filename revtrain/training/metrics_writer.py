"""Writes metrics as JSON lines and TensorBoard event files.

Layout under ``output_dir``:

* ``metrics.jsonl`` -- one JSON object per line: ``{"step": 20, "split": "eval",
  "time": <unix seconds>, "loss": ..., ...}``; appended to, so a resumed run continues it.
* ``tensorboard/train`` and ``tensorboard/eval`` -- TensorBoard event files (`EventFile`),
  one scalar per metric name, so TensorBoard overlays the train and eval curves of a
  metric (the layout Trax's ``train`` and ``eval`` summary directories use).

A write that fails (a full disk) raises one `RunWriteError` naming the file and the newest
intact checkpoint (`revtrain.training.write_failures`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Mapping

from revtrain.training.run_directory import CHECKPOINT_DIR, METRICS_FILE, TENSORBOARD_DIR
from revtrain.training.write_failures import reporting_write_failures

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 30.0  # How often event files are flushed to disk (and at flush/close).


class EventFile:
    """A TensorBoard event file in ``logdir``, written on the calling thread.

    tensorboardX's ``SummaryWriter`` writes from a thread of its own: on a full disk that
    thread dies printing a traceback, and the writer's queue then blocks the training
    thread forever once it is full (a run hung so). Here a failed write raises where it
    was called, so it can be reported in one line. The file is what TensorBoard reads,
    ``events.out.tfevents.<unix time>.<host>``: TFRecords (little-endian u64 length, its
    masked CRC-32C, the payload, its masked CRC-32C) of ``Event`` protos, the first one
    the file version; tensorboardX builds the summaries. Events are flushed at the first,
    every `FLUSH_SECONDS` and on `flush`/`close`.

    Raises:
      OSError: from any method, when the file cannot be written.
    """

    def __init__(self, logdir: str):
        os.makedirs(logdir, exist_ok=True)
        self.logdir = logdir
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self._file = open(os.path.join(logdir, name), "ab")  # noqa: SIM115  Kept open.
        self._next_flush = 0.0
        try:
            self._add(file_version="brain.Event:2")
        except BaseException:
            self._file.close()
            raise

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """Adds the scalar ``value`` of ``tag`` at ``step``."""
        from tensorboardX.summary import scalar  # Lazy: it imports protobuf.

        self._add(summary=scalar(tag, value), step=int(step))

    def add_text(self, tag: str, text: str, step: int) -> None:
        """Adds ``text`` (markdown) as ``tag`` at ``step``."""
        from tensorboardX.summary import text as text_summary

        self._add(summary=text_summary(tag, text), step=int(step))

    def _add(self, **event: object) -> None:
        from tensorboardX.proto import event_pb2
        from tensorboardX.record_writer import masked_crc32c

        data = event_pb2.Event(wall_time=time.time(), **event).SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", masked_crc32c(header)) + data
                         + struct.pack("<I", masked_crc32c(data)))
        if time.monotonic() >= self._next_flush:
            self.flush()

    def flush(self) -> None:
        """Writes the pending events to the file."""
        self._file.flush()
        self._next_flush = time.monotonic() + FLUSH_SECONDS

    def close(self) -> None:
        """Flushes and closes the file (closed even when the flush fails)."""
        self._file.close()


class MetricsWriter:
    """Appends ``(step, split, metrics)`` records to JSONL and TensorBoard.

    Args:
      output_dir: directory to write into (created if missing); None writes nothing.
      tensorboard: also write TensorBoard event files.
      enabled: False makes every call a no-op (for processes other than process 0).

    Raises (from every method):
      RunWriteError: a file could not be written (e.g. a full disk); names it and the
        newest checkpoint of ``output_dir``.
    """

    def __init__(self, output_dir: str | None, tensorboard: bool = True, enabled: bool = True):
        self._enabled = enabled and output_dir is not None
        self._output_dir = output_dir
        self._tensorboard = tensorboard
        self._summary_writers: dict[str, EventFile] = {}
        if self._enabled:
            with self._reporting(f"create {output_dir}"):
                os.makedirs(output_dir, exist_ok=True)

    @property
    def jsonl_path(self) -> str | None:
        """Path of ``metrics.jsonl``, or None when nothing is written."""
        return os.path.join(self._output_dir, METRICS_FILE) if self._enabled else None

    def write(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
        """Writes one record; values must be numbers (non-finite ones are written as null).

        Args:
          step: the global step the metrics belong to.
          split: ``'train'`` or ``'eval'`` (any short name; one TensorBoard run each).
          metrics: metric name -> value.
        """
        if not self._enabled:
            return
        values = {name: float(value) for name, value in metrics.items()}
        record = {"step": int(step), "split": split, "time": round(time.time(), 3)}
        record.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
        line = json.dumps(record) + "\n"
        with self._reporting(f"write {self.jsonl_path}"), open(self.jsonl_path, "ab+") as f:
            if f.seek(0, os.SEEK_END) and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
                line = "\n" + line  # A write cut short (full disk, crash): start anew.
            f.write(line.encode("utf-8"))  # One write: a whole line or, at worst, a cut one.
        if self._tensorboard:
            writer = self._event_file(split)
            with self._reporting(f"write the TensorBoard events in {writer.logdir}"):
                for name, value in values.items():
                    writer.add_scalar(name, value, int(step))

    def write_text(self, tag: str, text: str, step: int) -> None:
        """Writes ``text`` to TensorBoard (run ``tensorboard/text``) as a code block."""
        if self._enabled and self._tensorboard:
            body = "\n".join("    " + line for line in text.splitlines())
            writer = self._event_file("text")
            with self._reporting(f"write the TensorBoard events in {writer.logdir}"):
                writer.add_text(tag, body, int(step))

    def _reporting(self, what: str) -> contextlib.AbstractContextManager:
        return reporting_write_failures(what, os.path.join(self._output_dir, CHECKPOINT_DIR))

    def _event_file(self, split: str) -> EventFile:
        if split not in self._summary_writers:
            logdir = os.path.join(self._output_dir, TENSORBOARD_DIR, split)
            with self._reporting(f"write the TensorBoard events in {logdir}"):
                self._summary_writers[split] = EventFile(logdir)
        return self._summary_writers[split]

    def flush(self) -> None:
        """Flushes the TensorBoard event files (JSONL lines are written at once)."""
        for writer in self._summary_writers.values():
            with self._reporting(f"write the TensorBoard events in {writer.logdir}"):
                writer.flush()

    def close(self) -> None:
        """Flushes and closes the TensorBoard event files (each is closed even when one
        fails; the first failure is raised after)."""
        writers, self._summary_writers = list(self._summary_writers.values()), {}
        failure = None
        for writer in writers:
            try:
                with self._reporting(f"write the TensorBoard events in {writer.logdir}"):
                    writer.close()
            except OSError as e:
                failure = failure or e
        if failure is not None:
            raise failure


def read_metrics(output_dir: str, split: str | None = None) -> list[dict]:
    """Reads ``output_dir/metrics.jsonl``; keeps only records of ``split`` when given.

    A line that is not a record (cut short by a crash or a full disk) is skipped with one
    warning naming the file and the line numbers: the file is a record, so a lost line
    means at most a step that ``revtrain-eval`` evaluates again.
    """
    path = os.path.join(output_dir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    records, bad = [], []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
                if isinstance(record["step"], int) and isinstance(record["split"], str):
                    records.append(record)
                    continue
            except (UnicodeDecodeError, ValueError, KeyError, TypeError):
                pass
            bad.append(number)
    if bad:
        logger.warning("%s: skipped %d line(s) that are not metric records (line %s); a "
                       "write was cut short", path, len(bad), ", ".join(map(str, bad[:5])))
    return [r for r in records if split is None or r["split"] == split]
