"""`estimate`: one training step's peak device bytes and work, before anything is allocated.

The model is initialised abstractly (``jax.eval_shape`` of its init: shapes, no values),
the trainer is built on it (`revtrain.trainers.common.base.is_abstract`: it places
nothing), and the trainer walks one step on abstract values (its ``walk_abstract``) under
an `revtrain.planning.ledger.AbstractLedger`, which compiles every program of the step for
the devices it will run on and accounts, at each dispatch, for what is live: the same sum
`revtrain.memory.MemoryLedger` measures on a real step. Every option that changes memory
is covered because the programs themselves are compiled: `Trainer`'s ``scan_layers`` and
remat, the block trainers' ``keep_every``, ``scan_window`` and ``clip_global_norm``,
FSDP and the data x fsdp x seq mesh, and the model's own ``ff_chunk_size``, attention
``chunk_len`` / block size, ``n_hashes`` and loss chunks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from revtrain.layers.base import Layer
from revtrain.memory import format_bytes, rss_bytes
from revtrain.planning.cost import DeviceRates, Work, jaxpr_work
from revtrain.planning.ledger import AbstractLedger, LedgerRow
from revtrain.trainers import MemoryEfficientTrainer, Trainer
from revtrain.trainers.block.block_trainer import BlockTrainer
from revtrain.trainers.common.base import is_abstract
from revtrain.trainers.common.protocols import ResidentBytes


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The predicted peak of one training step on one device, in bytes, and its work.

    Attributes:
      trainer: the trainer class's name.
      options: the trainer's keyword options the estimate was made with.
      batch_size: the global batch (rows of one step).
      peak_bytes: predicted peak bytes in use on the mesh's first device.
      weights_bytes: the trainer's weights on the device at the peak (all layers', or a
        window's for `MemoryEfficientTrainer`).
      slots_bytes: its optimizer slots there, likewise.
      state_bytes: its layers' state there, likewise.
      activation_bytes: the step's other live values at the peak (batch, stack,
        cotangents, stashed block inputs, new states).
      temp_bytes: the peak program's temporaries plus its non-aliased outputs.
      peak_program: the label of the dispatch that holds the peak.
      all_values_bytes: the trainer's weights, slots and state of all layers per device
        (what a device would hold if they all lived there).
      host_values_bytes: bytes of the trainer's values kept in host memory (all of them
        for `MemoryEfficientTrainer`, else 0).
      host_bytes: bytes moved between host and device per step (values that live in host
        memory; 0 for `Trainer` and `ReversibleSerialTrainer`).
      work: the step's per-device `revtrain.planning.cost.Work`.
      n_dispatches: programs dispatched per step.
      n_programs: distinct programs compiled.
      seconds: wall seconds the estimate took (compiling included).
      planner_rss_bytes: this process's RSS after the estimate (on a CPU backend the
        compiled programs count here, not on the device).
    """

    trainer: str
    options: Mapping[str, Any]
    batch_size: int
    peak_bytes: int
    weights_bytes: int
    slots_bytes: int
    state_bytes: int
    activation_bytes: int
    temp_bytes: int
    peak_program: str
    all_values_bytes: int
    host_values_bytes: int
    host_bytes: int
    work: Work
    n_dispatches: int
    n_programs: int
    seconds: float
    planner_rss_bytes: int

    def step_seconds(self, rates: DeviceRates) -> float:
        """The modelled seconds of one step on a device with ``rates``."""
        return rates.step_seconds(self.work, self.n_dispatches, self.host_bytes, self.trainer)

    def summary(self) -> str:
        """One line: trainer, batch, peak and its split."""
        return (f"{self.trainer} batch {self.batch_size}: peak "
                f"{format_bytes(self.peak_bytes)} at {self.peak_program} (weights "
                f"{format_bytes(self.weights_bytes)}, slots {format_bytes(self.slots_bytes)}, "
                f"activations {format_bytes(self.activation_bytes)}, temporaries "
                f"{format_bytes(self.temp_bytes)})")


@contextlib.contextmanager
def abstract_values(layers: Sequence[Layer]) -> Iterator[None]:
    """Gives ``layers`` the shapes of their weights and state for the block (restored on
    exit), so a trainer built inside holds no values."""
    saved = [(layer.weights, layer.state) for layer in layers]
    try:
        for layer in layers:
            layer.weights, layer.state = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype),
                (layer.weights, layer.state))
        yield
    finally:
        for layer, (weights, state) in zip(layers, saved, strict=True):
            layer.weights, layer.state = weights, state


def with_batch_size(batch_signature: Sequence[Any], batch_size: int) -> tuple:
    """``batch_signature`` (``[batch, ...]`` items) with ``batch_size`` rows."""
    return tuple(jax.ShapeDtypeStruct((batch_size, *np.shape(item)[1:]), item.dtype)
                 for item in batch_signature)


def estimate(model: Layer, loss_layer: Layer, batch_signature: Sequence[Any],
             optimizer_fn: Callable[[], Any], trainer_class: type = Trainer,
             batch_size: int | None = None, learning_rate: float | None = None,
             **options: Any) -> Estimate:
    """Predicts the peak device bytes of one step of ``trainer_class`` on ``model``.

    Nothing of model size is allocated: the layers are given their shapes for the call
    (`abstract_values`), the trainer is built on them and walks one step abstractly; each
    program is compiled (module docstring).

    Args:
      model: an initialised model (values or, from ``build_model(..., abstract=True)``,
        shapes); its layer objects are unchanged on return.
      loss_layer: the initialised loss layer.
      batch_signature: the global batch ``(inputs, targets, weights)`` as arrays or
        `jax.ShapeDtypeStruct` s, ``[batch, length, ...]``.
      optimizer_fn: ``() -> optax.GradientTransformation``.
      trainer_class: `Trainer`, `ReversibleSerialTrainer` or `MemoryEfficientTrainer`.
      batch_size: the global batch to estimate at (default: ``batch_signature``'s).
      learning_rate: as `one_step`'s (only whether one is passed matters).
      **options: the trainer's keyword options (``n_devices``, ``mesh``, ``fsdp``,
        ``placement``, ``scan_layers``, ``keep_every``, ``remat``, ...).

    Returns:
      An `Estimate`.

    Raises:
      ValueError, TypeError: as the trainer's constructor and ``one_step`` (a batch that
        does not split over the devices, a bad option).
    """
    start = time.perf_counter()
    signature = tuple(batch_signature)
    if batch_size is not None:
        signature = with_batch_size(signature, batch_size)
    layers = [model, loss_layer]
    swap = (contextlib.nullcontext() if is_abstract([layer.weights for layer in layers])
            else abstract_values(layers))  # An abstract model is used as it is.
    with swap:
        trainer = trainer_class.from_model(model, loss_layer, optimizer_fn, **options)
    ledger = AbstractLedger(trainer.placement, ResidentBytes, cost=jaxpr_work)
    all_values = trainer.values_bytes()
    # Values that stay on the device throughout, unless the store moves them (and then
    # says what it holds now: `MemoryEfficientTrainer`'s window).
    ledger.resident = lambda: all_values
    if isinstance(trainer, BlockTrainer):
        store = trainer.abstract_store(ledger.values)
        ledger.resident = getattr(store, "resident_bytes", ledger.resident)
        trainer.walk_abstract(signature, ledger, store=store, learning_rate=learning_rate,
                              device=ledger.values)
    else:
        trainer.walk_abstract(signature, ledger, learning_rate=learning_rate,
                              device=ledger.values)
    peak: LedgerRow = ledger.peak
    host, host_values = 0, 0
    if isinstance(trainer, MemoryEfficientTrainer):
        host_values = sum(all_values)
        # Weights go up for the forward and the backward pass, slots once; both come back.
        host = 3 * all_values.weights + 2 * all_values.slots
    return Estimate(
        trainer=trainer_class.__name__, options=dict(options),
        batch_size=int(np.shape(signature[0])[0]), peak_bytes=peak.total,
        weights_bytes=peak.resident.weights, slots_bytes=peak.resident.slots,
        state_bytes=peak.resident.state, activation_bytes=peak.transient,
        temp_bytes=peak.temp + peak.outputs, peak_program=peak.label,
        all_values_bytes=sum(all_values), host_values_bytes=host_values, host_bytes=host,
        work=ledger.work,
        n_dispatches=ledger.n_dispatches, n_programs=ledger.n_programs,
        seconds=time.perf_counter() - start,
        planner_rss_bytes=rss_bytes())


__all__ = ["Estimate", "abstract_values", "estimate", "with_batch_size"]
