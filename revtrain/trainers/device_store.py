"""`DeviceStore`: every value of a block trainer on the devices (`ReversibleSerialTrainer`).

Weights and slots on the mesh -- replicated, or with ``fsdp`` sharded
(`revtrain.trainers.placement.Placement.weight_shardings`: each device holds about
``1/n_devices`` of every large leaf) --, layer states per device, block inputs kept on the
transfers. See `revtrain.trainers.stores` for the contract.
"""

from __future__ import annotations

from typing import Any

import jax

from revtrain.trainers import transfers
from revtrain.trainers.batches import for_n_devices
from revtrain.trainers.placement import Placement
from revtrain.trainers.protocols import DeviceFootprint, Params, TrainState


def _host_values(tree: Any) -> Any:
    return jax.tree.map(transfers.host_value, tree)


class DeviceStore:
    """All values on the devices: weights and slots replicated (or sharded), states per
    device.

    Args:
      placement: the trainer's placement; with ``placement.fsdp`` weights and slots are
        stored sharded (`Placement.weight_shardings`) instead of replicated.
      train_state: the initial values (one entry per flat layer): host arrays or
        ``jax.Array`` s in any sharding.
    """

    def __init__(self, placement: Placement, train_state: TrainState):
        self._placement = placement
        self.restore(train_state)

    def restore(self, train_state: TrainState) -> None:
        self._shardings = {"weights": [], "slots": []}
        self._weights, self._slots = [], []
        # One pass, one layer at a time: ``slots`` may be made as they are read.
        for weights, slots in zip(train_state.weights, train_state.slots, strict=True):
            for part, values, kept in (("weights", weights, self._weights),
                                       ("slots", slots, self._slots)):
                sharding = self._placement.weight_shardings(values)
                self._shardings[part].append(sharding)
                kept.append(transfers.put_values(values, sharding))
        self._states = [self._per_device(_host_values(s)) for s in train_state.state]
        self._new_states: list[Any] = [None] * len(self._states)
        self._kept_ids: set[int] = set()
        self._kept_bytes = 0

    def _per_device(self, state: Any) -> Any:
        return transfers.shard_per_device(for_n_devices(state, self._placement.n_devices),
                                        self._placement.mesh)

    def begin_step(self) -> None:
        self._new_states = [None] * len(self._states)
        self._kept_ids, self._kept_bytes = set(), 0

    def prepare(self, position: int) -> None:
        del position

    def weights(self, i: int) -> Any:
        return self._weights[i]

    def params(self, i: int) -> Params:
        return Params(self._weights[i], self._slots[i])

    def keep_params(self, i: int, params: Params) -> None:
        self._weights[i], self._slots[i] = params

    def state(self, i: int) -> Any:
        return self._states[i]

    def new_state(self, i: int) -> Any:
        return self._new_states[i]

    def keep_state(self, i: int, new_state: Any) -> None:
        self._new_states[i] = new_state

    def stash(self, stack: Any) -> Any:
        device = self._placement.first_local_device
        for leaf in jax.tree.leaves(stack):
            if id(leaf) not in self._kept_ids:
                self._kept_ids.add(id(leaf))
                self._kept_bytes += transfers.device_bytes(leaf, device)
        return stack

    def unstash(self, kept: Any) -> Any:
        return kept

    def end_forward(self, stack: Any) -> Any:
        return stack

    def finish_step(self) -> None:
        self._states = self._new_states

    def block_until_ready(self) -> None:
        transfers.block_until_ready_live((self._weights, self._slots, self._states))

    def host_values(self, part: str) -> tuple:
        if part == "state":
            return tuple(transfers.first_device_slice(s) for s in self._states)
        values = {"weights": self._weights, "slots": self._slots}[part]
        return tuple(_host_values(v) for v in values)

    def saved_values(self, part: str) -> tuple:
        if part == "state":
            return self.host_values(part)
        return tuple({"weights": self._weights, "slots": self._slots}[part])

    def value_shardings(self, part: str) -> tuple:
        if part == "state":  # Host values: no sharding (the tree alone, nothing copied).
            return tuple(jax.tree.map(lambda _: None, s) for s in self._states)
        return tuple(self._shardings[part])

    def device_footprint(self) -> DeviceFootprint:
        device = self._placement.first_local_device
        return DeviceFootprint(transfers.device_bytes(self._weights, device),
                               transfers.device_bytes(self._slots, device),
                               sum(1 for w in self._weights if jax.tree.leaves(w)),
                               self._kept_bytes)


