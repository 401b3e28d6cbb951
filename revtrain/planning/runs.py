"""Planning a configured run: `plan_run` plans a gin-built `RunConfig`, and
`applied_bindings` turns the pick into the gin bindings that apply it.

The run's model is built abstractly from its first train batch
(`revtrain.training.build_model` with ``abstract=True``: shapes, no values), on the run's
placement; the plan's candidates replace the run's trainer class, its trainer options and
its ``accumulate_steps`` (the options that say where values live -- ``n_devices``,
``mesh``, ``fsdp``, ``placement`` -- are the run's and stay).
"""

from __future__ import annotations

from typing import Any

from revtrain.planning.plan import DEFAULT_MARGIN, Choice, Plan, plan
from revtrain.training.builder import build_model, resolve_inputs
from revtrain.training.config import RunConfig

_PLACEMENT_OPTIONS = ("n_devices", "mesh", "fsdp", "placement")


def plan_run(run: RunConfig, memory_budget: int, margin: float = DEFAULT_MARGIN,
             fixed_batch: bool = True, **plan_options: Any) -> Plan:
    """`revtrain.planning.plan` of ``run``'s model, data, optimizer and placement.

    Args:
      run: the run (its model, inputs, optimizer, schedule and placement are used).
      memory_budget: bytes per device.
      margin, fixed_batch, **plan_options: as `revtrain.planning.plan`'s.

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


__all__ = ["applied_bindings", "plan_run"]
