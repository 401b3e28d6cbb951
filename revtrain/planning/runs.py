"""Planning a configured run: `plan_run` plans a gin-built `RunConfig`, and
`applied_bindings` turns the pick into the gin bindings that apply it.

The run's model is built abstractly from its first train batch
(`revtrain.training.build_model` with ``abstract=True``: shapes, no values), on the run's
placement; the plan's candidates replace the run's trainer class, its trainer options and
its ``accumulate_steps`` (the options that say where values live -- ``n_devices``,
``mesh``, ``fsdp``, ``placement`` -- are the run's and stay).
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from revtrain import memory
from revtrain.memory import MemoryLedger
from revtrain.planning.plan import DEFAULT_MARGIN, Choice, Plan, plan
from revtrain.training.builder import build_model, resolve_inputs
from revtrain.training.config import RunConfig

_PLACEMENT_OPTIONS = ("n_devices", "mesh", "fsdp", "placement")
PLAN_FILE = "plan.gin"  # The bindings a planned run applied, reapplied on resume.

logger = logging.getLogger(__name__)


def plan_run(run: RunConfig, memory_budget: int, margin: float = DEFAULT_MARGIN,
             fixed_batch: bool = True, **plan_options: Any) -> Plan:
    """`revtrain.planning.plan` of ``run``'s model, data, optimizer and placement.

    Args:
      run: the run (its model, inputs, optimizer, schedule and placement are used).
      memory_budget: bytes per device.
      margin: the fraction of the budget kept free, as `revtrain.planning.plan`'s.
      fixed_batch: keep the run's global batch, as `revtrain.planning.plan`'s.
      **plan_options: other keyword arguments of `revtrain.planning.plan`.

    Raises:
      ValueError: as `revtrain.training.build_model` and `revtrain.planning.plan`.
    """
    inputs = resolve_inputs(run.inputs)
    built = build_model(run, inputs, abstract=True)
    learning_rate = None if run.schedule is None else 1.0  # The loop passes one then.
    return plan(built.model, built.loss, built.batch_signature, run.optimizer,
                memory_budget, margin=margin, fixed_batch=fixed_batch,
                learning_rate=learning_rate, placement=run.placement(), **plan_options)


def applied_bindings(choice: Choice, run: RunConfig) -> list[str]:
    """The gin bindings that apply ``choice`` to ``run``: its trainer class, its options
    (with the run's placement options kept) and its accumulation steps."""
    kept = {k: v for k, v in (run.trainer_kwargs or {}).items() if k in _PLACEMENT_OPTIONS}
    options = {**kept, **choice.candidate.options}
    return [f"RunConfig.trainer_class = @{choice.candidate.trainer_class.__name__}",
            f"RunConfig.trainer_kwargs = {options!r}" if options
            else "RunConfig.trainer_kwargs = None",
            f"RunConfig.accumulate_steps = {choice.accumulate_steps}"]




class FirstStepPeak:
    """A trainer observer that logs the planned peak beside the measured one after the
    first step, then does nothing more.

    Measured: the allocator's peak (``memory_stats``, GPU/TPU) or, on a CPU, a
    `revtrain.memory.MemoryLedger` of the first step (the planner's sum, measured).

    Args:
      predicted: the plan's predicted peak bytes.
      device: the measured device (default the first local one).
    """

    def __init__(self, predicted: int, device: Any = None):
        device = jax.local_devices()[0] if device is None else device
        self.predicted = predicted
        self.measured: int | None = None
        self._device = device
        self._ledger = MemoryLedger(device) if memory.peak_bytes(device) is None else None

    def on_dispatch(self, label: str, fn: Any, args: tuple) -> None:
        if self._ledger is not None and self.measured is None:
            self._ledger.on_dispatch(label, fn, args)

    def on_phase(self, label: str) -> None:
        if self.measured is not None:
            return
        if self._ledger is not None:
            self._ledger.on_phase(label)
        if label == "step_end":
            self.measured = (self._ledger.peak_bytes if self._ledger is not None
                             else memory.peak_bytes(self._device) or 0)
            method = "ledger" if self._ledger is not None else "memory_stats"
            ratio = self.predicted / self.measured if self.measured else float("nan")
            logger.info("first step: predicted peak %s, measured %s (%s): predicted/measured "
                        "%.3f", memory.format_bytes(self.predicted),
                        memory.format_bytes(self.measured), method, ratio)


__all__ = ["PLAN_FILE", "FirstStepPeak", "applied_bindings", "plan_run"]
