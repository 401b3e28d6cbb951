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
import math
import os
import time
from collections.abc import Mapping

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


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
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps(record) + "\n")
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
    """Reads ``output_dir/metrics.jsonl``; keeps only records of ``split`` when given."""
    path = os.path.join(output_dir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if split is None or r["split"] == split]
