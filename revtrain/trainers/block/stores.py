"""`ParamStore`: where a block trainer's values live, and the contract of a custom store.

A store has two roles. `StepValues` is what one step needs: the executor
(`revtrain.trainers.block.executor.run_step`) reads each op's values from it and hands the new
ones back. `HeldValues` is what the trainer needs between steps: copies for checkpoints and
``train_state``, restoring, waiting, and the device account. A `ParamStore` is both.

Implementations: `revtrain.trainers.block.device_store.DeviceStore` (every value on the
devices: `ReversibleSerialTrainer`), `revtrain.trainers.block.host_store.HostStore` (host
memory, a prefetch window: `MemoryEfficientTrainer`) and, for precompilation,
`revtrain.trainers.block.precompile.AbstractStore` (shapes only). A custom store plugs into
`revtrain.trainers.BlockTrainer` through a `StoreFactory`.

Keys: the methods that read or keep an op's values take the op's
`revtrain.trainers.block.plan.Run`. A lone layer is a run of one repetition, whose values
are the layer's own; a scanned run's (two or more repetitions) are each a tuple over the
group's positions of stacked trees (`revtrain.trainers.block.stacked`). A store is given
the scanned runs by its `StoreFactory`'s schedule (`revtrain.trainers.block.plan.runs_of`);
one that cannot hold them is built with a plan that has none (``scan_layers=False``).

Donation: values given by `StepValues.params` are donated to the layer's fbo and must not
be used again, so a layer's update cannot be taken back. A step that raises before its
first `StepValues.keep_params` leaves every stored value as it was; one that raises later
(in the backward pass) leaves the layers already updated with their new values, and
`HeldValues.restore` -- which must work whatever state a failed step left -- undoes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from revtrain.parallel.placement import Placement
from revtrain.trainers.block.plan import Op, Run
from revtrain.trainers.common.protocols import (
    DeviceFootprint,
    Params,
    Stack,
    State,
    TrainState,
    Weights,
)


class StepValues(Protocol):
    """The values of one step, in the order the executor asks for them."""

    def begin_step(self) -> None:
        """Called once before the first op: forget last step's new states and stashes."""

    def prepare(self, position: int) -> None:
        """Called before op ``position`` of the schedule (the store may look ahead in it:
        `HostStore` prefetches the next ops' weights here)."""

    def weights(self, run: Run) -> Weights:
        """The run's weights, on the devices in the stored sharding; not donated."""

    def params(self, run: Run) -> Params:
        """The run's weights and slots for its backward op, which donates them."""

    def keep_params(self, run: Run, params: Params) -> None:
        """Takes the run's updated weights and slots (the backward op's outputs)."""

    def state(self, run: Run) -> State:
        """The run's state before this step, per device (``[devices, ...]``)."""

    def new_state(self, run: Run) -> State:
        """The run's state after this step's forward op (kept by `keep_state`)."""

    def keep_state(self, run: Run, new_state: State) -> None:
        """Takes the run's state after its forward op; it becomes current at
        `finish_step`."""

    def stash(self, stack: Stack) -> Any:
        """Keeps a block input (or ``keep_every`` copy) for the backward pass; returns the
        handle `unstash` takes (the stack itself on the devices, a host copy in memory)."""

    def unstash(self, kept: Any) -> Stack:
        """The stack `stash` kept, on the devices again."""

    def end_forward(self, stack: Stack) -> Any:
        """Called with the final activations after the forward pass: lets them leave the
        devices (the loss op `unstash` es the result)."""

    def finish_step(self) -> None:
        """Called after the last op: new states become current, transfers settle."""


class HeldValues(Protocol):
    """The values between steps: copies, checkpoints, restore and the device account."""

    def host_values(self, part: str) -> tuple:
        """Host copies of ``'weights'``, ``'state'`` (device 0's) or ``'slots'``, one
        entry per flat layer."""

    def saved_values(self, part: str) -> tuple:
        """The same values as they live, without a host copy, for a sharded checkpoint:
        global ``jax.Array`` s in their own sharding (each process then writes only its
        shards), or host arrays where the store keeps values in host memory."""

    def value_shardings(self, part: str) -> tuple:
        """Per leaf, the ``NamedSharding`` a checkpoint should be restored into (None for
        a leaf held in host memory)."""

    def restore(self, train_state: TrainState) -> None:
        """Replaces every value: host arrays or ``jax.Array`` s in any sharding (resharded
        as the store keeps them, never aliased). Works after any failed step."""

    def block_until_ready(self) -> None:
        """Waits until every value is computed and every transfer the store started has
        landed, without copying to the host anything that stays on the devices."""

    def device_footprint(self) -> DeviceFootprint:
        """Bytes of weights and slots on the mesh's first local device now."""


class ParamStore(StepValues, HeldValues, Protocol):
    """A block trainer's store: both roles (see the module docstring)."""


StoreFactory = Callable[[Placement, TrainState, Sequence[Op]], ParamStore]
"""``(placement, initial values, schedule) -> ParamStore``: how `BlockTrainer` makes its
store. The initial `TrainState` has one entry per flat layer (host arrays or ``jax.Array`` s;
its ``slots`` may be made as they are read, one layer at a time); with ``placement.fsdp``
the store must keep weights and slots in `Placement.weight_shardings` layout."""


__all__ = ["HeldValues", "ParamStore", "StepValues", "StoreFactory"]
