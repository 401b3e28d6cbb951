"""`plan`: which trainer, at what batch, fits a memory budget, and which is fastest there.

The candidates (`default_candidates`) are the ways revtrain trades compute or transfers
for memory: plain `Trainer`; `Trainer` with every layer rematerialised (``remat='layer'``;
groups of ``k`` layers store fewer inputs but hold ``k`` layers' activations at once in
the backward pass, which on the reversible LM peaks higher than ``'layer'``, so they are
left to ``candidates=``); `ReversibleSerialTrainer` (inputs reconstructed by reversal);
and `MemoryEfficientTrainer` (values in host memory). For each, `plan` estimates
(`revtrain.planning.estimate`) the peak of one step on one device:

* with the global batch fixed (the default, what a run's learning rate was tuned for), at
  the configured batch; where that does not fit, at the fewest equal micro-batches whose
  peak fits, trained by gradient accumulation (``RunConfig.accumulate_steps``: one
  optimizer update per global batch, the same update as the whole batch);
* with ``fixed_batch=False``, at the largest batch (a multiple of the devices the batch is
  split over) that fits.

The batch a candidate can take is found from two estimates: peak bytes are affine in the
batch (weights and slots do not grow with it, activations and temporaries do), so the
estimates at the smallest batch and the configured one give the largest batch that fits,
which is then estimated itself (and stepped down until it fits). A candidate fits when its
peak is at most ``budget * (1 - margin)``; the margin (default 10%) covers what no
estimate sees: allocator fragmentation, the runtime's own buffers, and the error of the
estimate itself (measured by ``benchmarks/memory_budget.py``). The candidates that fit are
ranked by predicted tokens per second (`revtrain.planning.cost`: the programs' work over
rates measured on the device), best first.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from revtrain.layers.base import Layer
from revtrain.memory import format_bytes, rss_bytes
from revtrain.parallel.placement import Placement
from revtrain.planning.cost import DeviceRates, measure_rates
from revtrain.planning.estimate import Estimate, estimate
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
from revtrain.trainers.block.compiling import compile_workers
from revtrain.training.accumulation import accumulating_optimizer

DEFAULT_MARGIN = 0.1


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A way to train: a trainer class and its options.

    Attributes:
      name: what tables show, e.g. ``'Trainer + remat'``.
      trainer_class: `Trainer`, `ReversibleSerialTrainer` or `MemoryEfficientTrainer`.
      options: keyword options of the trainer (``RunConfig.trainer_kwargs``).
    """

    name: str
    trainer_class: type
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def default_candidates() -> tuple[Candidate, ...]:
    """The candidates `plan` compares (module docstring)."""
    return (Candidate("Trainer", Trainer),
            Candidate("Trainer + remat", Trainer, {"remat": "layer"}),
            Candidate("ReversibleSerialTrainer", ReversibleSerialTrainer),
            Candidate("MemoryEfficientTrainer", MemoryEfficientTrainer))


@dataclasses.dataclass(frozen=True)
class Choice:
    """One candidate's answer under the budget.

    Attributes:
      candidate: the `Candidate`.
      estimate: the estimate at the batch chosen (or, when nothing fits, at the smallest).
      fits: whether ``estimate.peak_bytes`` is within the budget less the margin.
      accumulate_steps: micro-batches per global batch (1: no accumulation).
      global_batch: rows per optimizer update (``estimate.batch_size *
        accumulate_steps``).
      step_seconds: predicted seconds per optimizer update.
      tokens_per_second: predicted tokens (rows x length) per second.
    """

    candidate: Candidate
    estimate: Estimate
    fits: bool
    accumulate_steps: int
    global_batch: int
    step_seconds: float
    tokens_per_second: float


@dataclasses.dataclass(frozen=True)
class Plan:
    """`plan`'s answer.

    Attributes:
      budget_bytes: the memory budget of one device.
      margin: the safety margin (a fraction of the budget kept free).
      choices: every candidate's `Choice`: those that fit by predicted tokens/s, best
        first, then those that do not, by peak.
      rates: the `revtrain.planning.cost.DeviceRates` the speeds were predicted with.
      seconds: wall seconds of planning.
      planner_rss_bytes: the planning process's RSS at the end.
      baseline_rss_bytes: the process's RSS when planning began (the Python and JAX
        runtime a training process holds too).
      host_is_device: whether the devices are the host's CPU (device memory is RAM).
    """

    budget_bytes: int
    margin: float
    choices: tuple[Choice, ...]
    rates: DeviceRates
    seconds: float
    planner_rss_bytes: int
    baseline_rss_bytes: int = 0
    host_is_device: bool = False

    def expected_rss_bytes(self, choice: Choice) -> int | None:
        """On a CPU backend, the RSS a training process is expected to reach with
        ``choice``: the runtime's baseline, the step's peak (device memory is host RAM)
        and, for values kept in host memory, all of them. None on an accelerator.
        An estimate: the compiler's own memory while compiling is not in it."""
        if not self.host_is_device:
            return None
        e = choice.estimate
        return self.baseline_rss_bytes + e.peak_bytes + e.host_values_bytes

    @property
    def pick(self) -> Choice | None:
        """The fastest candidate that fits, or None."""
        return self.choices[0] if self.choices and self.choices[0].fits else None

    @property
    def limit_bytes(self) -> int:
        """The budget less the margin: what a fitting peak stays under."""
        return int(self.budget_bytes * (1.0 - self.margin))

    def table(self) -> str:
        """A markdown table: each candidate, its batch, peak and split, fit, tokens/s."""
        lines = ["| candidate | batch x accumulate | peak | weights | slots | activations "
                 "| temporaries | at | fits | tokens/s |", "|" + "---|" * 10]
        for c in self.choices:
            e = c.estimate
            speed = f"{c.tokens_per_second:,.0f}" if c.fits else "-"
            lines.append(
                f"| {c.candidate.name} | {e.batch_size} x {c.accumulate_steps} | "
                f"{format_bytes(e.peak_bytes)} | {format_bytes(e.weights_bytes)} | "
                f"{format_bytes(e.slots_bytes)} | {format_bytes(e.activation_bytes)} | "
                f"{format_bytes(e.temp_bytes)} | {e.peak_program} | "
                f"{'yes' if c.fits else 'no'} | {speed} |")
        return "\n".join(lines)

    def nothing_fits(self) -> str:
        """One line for a budget nothing fits: the smallest predicted peak and what would
        fit."""
        smallest = min(self.choices, key=lambda c: c.estimate.peak_bytes)
        e = smallest.estimate
        return (f"nothing fits in {format_bytes(self.budget_bytes)} less the "
                f"{self.margin:.0%} margin ({format_bytes(self.limit_bytes)}): the smallest "
                f"predicted peak is {format_bytes(e.peak_bytes)} ({smallest.candidate.name} "
                f"at batch {e.batch_size}); fit it with a shorter length, fewer layers, more "
                f"devices (FSDP shards weights and slots), or a larger budget")


def _choice(candidate: Candidate, e: Estimate, fits: bool, accumulate: int,
            rates: DeviceRates, length: int) -> Choice:
    seconds = e.step_seconds(rates) * accumulate
    rows = e.batch_size * accumulate
    return Choice(candidate, e, fits, accumulate, rows, seconds,
                  rows * length / seconds if seconds > 0 else 0.0)


def _divisors_in_units(batch: int, unit: int) -> list[int]:
    """Micro-batch sizes: divisors of ``batch`` that are multiples of ``unit``, largest
    first."""
    return [b for b in range(batch, 0, -1) if batch % b == 0 and b % unit == 0]


def plan(model: Layer, loss_layer: Layer, batch_signature: Sequence[Any],
         optimizer_fn: Callable[[], Any], memory_budget: int,
         candidates: Sequence[Candidate] | None = None, margin: float = DEFAULT_MARGIN,
         fixed_batch: bool = True, max_batch: int | None = None,
         rates: DeviceRates | None = None, learning_rate: float | None = None,
         placement: Placement | None = None) -> Plan:
    """Ranks the ways to train ``model`` under ``memory_budget`` bytes per device.

    Args:
      model: the initialised model (values or shapes), as `estimate`'s.
      loss_layer: its initialised loss layer.
      batch_signature: the global batch of one optimizer update, ``(inputs, targets,
        weights)`` as arrays or `jax.ShapeDtypeStruct` s.
      optimizer_fn: ``() -> optax.GradientTransformation``.
      memory_budget: bytes of one device's memory the step may use (positive).
      candidates: default `default_candidates`; a candidate whose trainer refuses its
        options (e.g. remat of a model that is not a ``Serial``) is left out. They are
        estimated side by side in threads (the model's layers are only read: an abstract
        model is used as it is), one at a time while JAX's persistent compilation cache is
        on (`revtrain.trainers.block.compiling.compile_workers`).
      margin: the fraction of the budget kept free, in [0, 1).
      fixed_batch: keep the global batch (accumulating micro-batches where it does not
        fit); False: each candidate at the largest batch that fits, up to ``max_batch``.
      max_batch: the largest batch tried with ``fixed_batch=False`` (default 64 times the
        configured batch).
      rates: the device's `revtrain.planning.cost.DeviceRates` (default measured now).
      learning_rate: as `estimate`'s (only whether one is passed matters).
      placement: where every trainer runs (`revtrain.parallel.placement.Placement`;
        default all local devices); batches are multiples of its row slices.

    Returns:
      A `Plan`.

    Raises:
      ValueError: for a budget that is not a positive int, a margin outside [0, 1), or
        when no candidate can be built at all.
    """
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, np.integer)) \
            or memory_budget < 1:
        raise ValueError(f"memory_budget={memory_budget!r} must be a positive number of "
                         f"bytes; parse '12GiB' with revtrain.planning.parse_memory_budget")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin={margin!r} must be in [0, 1); e.g. 0.1 keeps 10% free")
    start, baseline_rss = time.perf_counter(), rss_bytes()
    candidates = default_candidates() if candidates is None else tuple(candidates)
    batch = int(np.shape(batch_signature[0])[0])
    length = int(np.prod(np.shape(batch_signature[0])[1:2] or (1,)))
    limit = int(memory_budget * (1.0 - margin))
    placement = Placement.resolve() if placement is None else placement
    unit = placement.n_devices // placement.n_seq
    rates = measure_rates() if rates is None else rates

    def search(candidate: Candidate) -> Choice | str:
        def at(rows: int) -> Estimate:
            # Micro-batches of a fixed batch are trained with MultiSteps, whose gradient
            # accumulator is one more copy of the weights.
            k = batch // rows if fixed_batch and rows < batch else 1
            return estimate(model, loss_layer, batch_signature,
                            accumulating_optimizer(optimizer_fn, k),
                            candidate.trainer_class, batch_size=rows,
                            learning_rate=learning_rate, placement=placement,
                            **candidate.options)
        try:
            return _search(candidate, at, batch, unit, limit, fixed_batch,
                           max_batch or 64 * batch, rates, length)
        except (TypeError, ValueError) as error:
            return f"{candidate.name}: {error}"

    # The candidates side by side (XLA compiles without holding the GIL), unless a compile
    # may be a persistent-cache load (`compile_workers`).
    with concurrent.futures.ThreadPoolExecutor(
            max_workers=compile_workers(os.cpu_count() or 1)) as pool:
        results = list(pool.map(search, candidates))
    choices = [r for r in results if isinstance(r, Choice)]
    errors = [r for r in results if isinstance(r, str)]
    if not choices:
        raise ValueError("no candidate could be estimated: " + "; ".join(errors))
    ranked = sorted(choices, key=lambda c: (not c.fits, -c.tokens_per_second if c.fits
                                            else c.estimate.peak_bytes))
    return Plan(memory_budget, margin, tuple(ranked), rates, time.perf_counter() - start,
                rss_bytes(), baseline_rss, placement.first_local_device.platform == "cpu")


def _search(candidate: Candidate, at: Callable[[int], Estimate], batch: int, unit: int,
            limit: int, fixed_batch: bool, max_batch: int, rates: DeviceRates,
            length: int) -> Choice:
    """The candidate's `Choice`: the configured batch if it fits (fixed batch), else the
    largest batch predicted to fit -- the line through the last two estimates, or from one
    estimate the peak less the trainer's own values growing in proportion to the batch --
    estimated to check it, until the largest that fits sits next to the smallest that
    does not (at most six more estimates)."""
    full = at(batch)
    fits = full.peak_bytes <= limit
    if fixed_batch and fits:
        return _choice(candidate, full, True, 1, rates, length)
    sizes = (_divisors_in_units(batch, unit) if fixed_batch
             else list(range(max(max_batch // unit, 1) * unit, 0, -unit)))
    points = [full]
    low, high = (full, None) if fits else (None, full)
    for _ in range(6):
        last = points[-1]
        per_row = _variable_bytes(last) / last.batch_size
        if len(points) >= 2 and points[-2].batch_size != last.batch_size:
            per_row = ((last.peak_bytes - points[-2].peak_bytes)
                       / (last.batch_size - points[-2].batch_size))
        predicted = last.batch_size + (limit - last.peak_bytes) / max(per_row, 1.0)
        between = [b for b in sizes if (low is None or b > low.batch_size)
                   and (high is None or b < high.batch_size)]
        if not between:
            break
        rows = next((b for b in between if b <= predicted), between[-1])
        e = at(rows)
        points.append(e)
        if e.peak_bytes <= limit:
            low = e
        else:
            high = e
    if low is None:
        return _choice(candidate, points[-1] if high is None else high, False, 1, rates,
                       length)
    return _choice(candidate, low, True, batch // low.batch_size if fixed_batch else 1,
                   rates, length)


def _variable_bytes(e: Estimate) -> int:
    """What grows with the batch at the peak: all but the trainer's own values."""
    return e.activation_bytes + e.temp_bytes


__all__ = ["DEFAULT_MARGIN", "Candidate", "Choice", "Plan", "default_candidates", "plan"]

