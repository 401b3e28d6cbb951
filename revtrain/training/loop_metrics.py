"""The loop's train-metric window, progress bar, model summary and formatting helpers.

`Window` collects the losses of the steps since the last log line as device arrays and
reads them back only when asked (`Window.first_non_finite`, `Window.metrics`), so ordinary
steps never wait for the device: the loop checks them on logging, eval and checkpoint
steps, before anything is saved.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from tqdm.contrib.logging import logging_redirect_tqdm

from revtrain.training.evaluation import bits_per_byte


def global_l2(stats: Mapping[str, Any], name: str) -> float | None:
    """``stats[name]`` (every trainer reports the whole model's ``gradients_l2`` and
    ``weights_l2``), or None when a custom trainer does not."""
    return float(stats[name]) if name in stats else None


def fmt(value: float) -> str:
    """A metric value for a log line: 4 significant digits, or an integer when large."""
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


def tokens(batch: Any) -> tuple[int, str]:
    """``(count, unit)`` of a batch across processes: tokens for sequences, else examples."""
    inputs = np.asarray(batch[0])
    if inputs.ndim == 2 and np.issubdtype(inputs.dtype, np.integer):
        return inputs.size * jax.process_count(), "tokens"
    return inputs.shape[0] * jax.process_count(), "examples"


class Window:
    """Train metrics accumulated since the last log line (losses kept on the device)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Starts a new window."""
        self.losses: list[Any] = []
        self.steps: list[int] = []
        self.started: float | None = None
        self.count, self.unit = 0, "tokens"
        self.stats: Mapping[str, Any] = {}
        self._checked = 0

    def add(self, step: int, loss: Any, stats: Mapping[str, Any], count: tuple[int, str],
            started: float) -> None:
        """Adds the (not yet read) ``loss`` of ``step``, which started at ``started``."""
        self.losses.append(loss)
        self.steps.append(step)
        self.stats = stats
        self.count += count[0]
        self.unit = count[1]
        self.started = started if self.started is None else self.started

    def first_non_finite(self) -> tuple[int, float] | None:
        """``(step, loss)`` of the first NaN/inf loss not checked yet (reads them back)."""
        for i in range(self._checked, len(self.losses)):
            self.losses[i] = float(self.losses[i])
            if not math.isfinite(self.losses[i]):
                return self.steps[i], self.losses[i]
        self._checked = len(self.losses)
        return None

    def metrics(self, byte_level: bool) -> dict[str, float]:
        """Mean loss, rates and the last step's stats; the seconds run until now."""
        self.first_non_finite()
        loss = float(np.mean(self.losses))
        metrics = {"loss": loss}
        if byte_level:
            metrics["bits_per_byte"] = bits_per_byte(loss)
        if "learning_rate" in self.stats:
            metrics["learning_rate"] = float(self.stats["learning_rate"])
        for name in ("gradients_l2", "weights_l2"):
            value = global_l2(self.stats, name)
            if value is not None:
                metrics[name] = value
        seconds = max(time.perf_counter() - (self.started or time.perf_counter()), 1e-9)
        metrics["steps_per_second"] = len(self.losses) / seconds
        metrics[f"{self.unit}_per_second"] = self.count / seconds
        return metrics


class BarWithLogging:
    """A tqdm bar that routes log lines through ``tqdm.write`` while it is open."""

    def __init__(self, bar: Any):
        self._bar = bar
        self._redirect = logging_redirect_tqdm(
            loggers=[logging.getLogger(), logging.getLogger("revtrain")])

    def __enter__(self) -> Any:
        self._redirect.__enter__()
        return self._bar

    def __exit__(self, *exc_info) -> None:
        self._bar.close()
        self._redirect.__exit__(*exc_info)


def model_summary(flat_layers: Any) -> str:
    """One line per flat layer (index, name, parameter count) and the total.

    Counts are of the layers' (initial) weights, which have the trained values' shapes.
    """
    lines, total = [], 0
    for i, layer in enumerate(flat_layers):
        count = sum(int(np.size(leaf)) for leaf in jax.tree.leaves(layer.weights))
        total += count
        lines.append(f"  {i:3d} {layer.name:<32} {count:>12,}")
    return "\n".join([f"model: {total:,} parameters in {len(lines)} layers", *lines])
