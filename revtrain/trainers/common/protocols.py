"""The trainers' vocabulary: `TrainState`, `DeviceFootprint`, `Params`, and the `Trainer`,
`Observer` and `ParamStore` protocols.

A trainer *owns* its training values, a `TrainState`; layer objects are updated only on
request (`TrainerBase.sync_to`, in the spirit of flax NNX ``update``). *Where* the values
of a block trainer live during a step -- on the devices (replicated or FSDP-sharded), or
in host memory with a prefetch window -- is a `ParamStore`; the trainer's step is a plan
built once (`revtrain.trainers.block.plan`) that one executor runs
(`revtrain.trainers.block.executor.run_step`), asking the store for values and giving the new
ones back. Observers watch dispatches and phases (benchmarks, the memory ledger) without
reading a trainer's private attributes. `Trainer` is what the training loop needs of any
trainer (`revtrain.training.loop.Loop` is typed against it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

import jax

Weights = Any  # A pytree of arrays (``()`` for a layer without weights).
State = Any  # A pytree of arrays updated by the forward pass (``()`` for none).
Slots = Any  # An optax optimizer state.
Stack = Any  # One array or a tuple of arrays: the data stack (``[n_devices, ...]`` leaves).


class TrainState(NamedTuple):
    """All values a trainer trains: host (numpy) copies, owned by the trainer.

    For the block trainers each field is a tuple with one entry per flat layer
    (``blocks_to_layers(blocks, loss_layer)``), and ``slots[i]`` is layer ``i``'s own
    optimizer state. For `Trainer` ``weights`` and ``state`` are the trees of its
    ``model_with_loss`` (for ``Serial(*flat_layers)``, again one entry per flat layer) and
    ``slots`` is one optimizer state for the whole model. ``state`` is device 0's (layer
    state is per device, as in Trax). Checkpoints store exactly these three trees.
    """

    weights: Any
    state: Any
    slots: Any


class ResidentBytes(NamedTuple):
    """Bytes of a trainer's own values (weights, optimizer slots, layer state) on one
    device."""

    weights: int = 0
    slots: int = 0
    state: int = 0

    @staticmethod
    def total(parts: Iterable[ResidentBytes]) -> ResidentBytes:
        """The column sums of ``parts``."""
        return ResidentBytes(*(sum(column) for column in zip((0, 0, 0), *parts,
                                                             strict=True)))


class DeviceFootprint(NamedTuple):
    """Bytes of training values resident on *one* device (the mesh's first) right now.

    Attributes:
      weights_bytes: bytes of weight buffers on the device (a replicated leaf counts once
        per device; prefetched and not-yet-copied-back layers included).
      slots_bytes: bytes of optimizer-slot buffers on the device.
      resident_layers: number of flat layers with weights on the device.
      kept_bytes: bytes of the activation stacks the last step's forward pass kept on the
        device for its backward pass -- block inputs and the ``keep_every`` copies, all
        alive at once at the end of the forward pass (an array shared by several stacks,
        e.g. the batch's targets, counts once). 0 where they wait in host memory
        (`HostStore`) and for `Trainer`, whose activations live inside its compiled step.
        Not part of `total_bytes`.
    """

    weights_bytes: int
    slots_bytes: int
    resident_layers: int
    kept_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Weights plus slots bytes (``kept_bytes`` excluded)."""
        return self.weights_bytes + self.slots_bytes


class Observer(Protocol):
    """Watches a trainer (``trainer.observers.append(obs)``); both methods are optional.

    ``on_dispatch(label, fn, args)`` is called just before each compiled function runs
    (``label`` e.g. ``'forward/layer3'``; ``fn(*args)`` is the call about to happen);
    ``on_phase(label)`` at phase boundaries of a step: ``'step_start'``, ``'loss_start'``,
    ``'backward_start'``, ``'step_end'``. Observers must not change the arguments.
    """

    def on_dispatch(self, label: str, fn: Callable[..., Any], args: tuple) -> None: ...

    def on_phase(self, label: str) -> None: ...


class Params(NamedTuple):
    """A layer's weights and optimizer slots as one program argument (donated by name)."""

    weights: Weights
    slots: Slots


class Trainer(Protocol):
    """What every revtrain trainer offers, and all the training loop relies on.

    `revtrain.trainers.Trainer`, `ReversibleSerialTrainer` and `MemoryEfficientTrainer`
    implement it (through `revtrain.trainers.common.base.TrainerBase`); a custom trainer that
    does can be driven by `revtrain.training.Loop`.
    """

    observers: list[Observer]
    learning_rate: float | None

    @classmethod
    def from_model(cls, model: Any, loss_layer: Any, optimizer_fn: Any,
                   **options: Any) -> Trainer:
        """The trainer of an initialised ``model`` followed by ``loss_layer``, with
        ``optimizer_fn`` and the constructor's keyword ``options`` (placement, ...): how
        `revtrain.training.build_trainer` builds any trainer, with no type test."""
        ...

    def one_step(self, batch: Any, rng: jax.Array, step: int = 0,
                 learning_rate: float | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """One training step on the global ``batch`` (``(inputs, targets, weights)``,
        ``[batch, ...]`` each); returns the float32 loss (the weighted mean over the global
        batch) and stats (device values, read only when logged); may return before the
        step's device work is done (JAX's asynchronous dispatch)."""
        ...

    @property
    def train_state(self) -> TrainState:
        """Host copies of every value trained."""
        ...

    def host_values(self, part: str) -> Any:
        """Host copy of one `TrainState` field (``'weights'``, ``'state'``, ``'slots'``)."""
        ...

    def saved_values(self, part: str) -> Any:
        """One field as it lives (device arrays in their shardings), for a checkpoint."""
        ...

    def value_shardings(self, part: str) -> Any:
        """Per leaf of ``part``, the ``NamedSharding`` to restore into (None: host)."""
        ...

    def value_signature(self, part: str) -> Any:
        """Per leaf of ``part``, its ``jax.ShapeDtypeStruct`` (no value is read)."""
        ...

    def restore(self, train_state: TrainState) -> None:
        """Replaces every value (host arrays or ``jax.Array`` s in any sharding)."""
        ...

    def sync_to(self, layers: Any = None) -> None:
        """Writes the current weights and state into layer objects."""
        ...

    def block_until_ready(self) -> None:
        """Waits until every update dispatched so far has landed."""
        ...
