"""Writes metrics as JSON lines and TensorBoard event files.

Layout under ``output_dir``:

* ``metrics.jsonl`` -- one JSON object per line: ``{"step": 20, "split": "eval",
  "time": <unix seconds>, "loss": ..., ...}``; appended to, so a resumed run continues it.
* ``tensorboard/train`` and ``tensorboard/eval`` -- event files written by tensorboardX's
  ``SummaryWriter``, one scalar per metric name, so TensorBoard overlays the train and eval
  curves of a metric (the layout Trax's ``train`` and ``eval`` summary directories use).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping

from revtrain.training.run_directory import METRICS_FILE, TENSORBOARD_DIR

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Appends ``(step, split, metrics)`` records to JSONL and TensorBoard.

    Args:
      output_dir: directory to write into (created if missing); None writes nothing.
      tensorboard: also write TensorBoard event files.
      enabled: False makes every call a no-op (for processes other than process 0).
    """

    def __init__(self, output_dir: str | None, tensorboard: bool = True, enabled: bool = True):
        self._enabled = enabled and output_dir is not None
        self._output_dir = output_dir
        self._tensorboard = tensorboard
        self._summary_writers: dict[str, object] = {}
        if self._enabled:
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
        with open(self.jsonl_path, "ab+") as f:
            if f.seek(0, os.SEEK_END) and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
                line = "\n" + line  # A write cut short (full disk, crash): start anew.
            f.write(line.encode("utf-8"))  # One write: a whole line or, at worst, a cut one.
        if self._tensorboard:
            writer = self._summary_writer(split)
            for name, value in values.items():
                writer.add_scalar(name, value, global_step=int(step))

    def write_text(self, tag: str, text: str, step: int) -> None:
        """Writes ``text`` to TensorBoard (run ``tensorboard/text``) as a code block."""
        if self._enabled and self._tensorboard:
            body = "\n".join("    " + line for line in text.splitlines())
            self._summary_writer("text").add_text(tag, body, global_step=int(step))

    def _summary_writer(self, split: str):
        if split not in self._summary_writers:
            from tensorboardX import SummaryWriter  # Imported lazily: it pulls in protobuf.

            logdir = os.path.join(self._output_dir, TENSORBOARD_DIR, split)
            self._summary_writers[split] = SummaryWriter(logdir=logdir)
        return self._summary_writers[split]

    def flush(self) -> None:
        """Flushes the TensorBoard writers (JSONL lines are written at once)."""
        for writer in self._summary_writers.values():
            writer.flush()

    def close(self) -> None:
        """Flushes and closes the TensorBoard writers."""
        for writer in self._summary_writers.values():
            writer.close()
        self._summary_writers = {}


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
