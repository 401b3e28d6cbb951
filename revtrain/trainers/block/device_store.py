"""`DeviceStore`: every value of a block trainer on the devices (`ReversibleSerialTrainer`).

Weights and slots on the mesh -- replicated, or with ``fsdp`` sharded
(`revtrain.parallel.placement.Placement.weight_shardings`: each device holds about
``1/n_devices`` of every large leaf) --, layer states per device, block inputs kept on the
transfers. The layers of each scanned `revtrain.trainers.block.plan.Run` are kept stacked
(`revtrain.trainers.block.stacked`: one ``[repeats, ...]`` array per leaf and group position),
which is what the run's scan programs take and donate; ``train_state``, checkpoints and
`restore` still see one entry per flat layer. See `revtrain.trainers.block.stores` for the
contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from revtrain.parallel import transfers
from revtrain.parallel.batches import for_n_devices
from revtrain.parallel.placement import Placement
from revtrain.trainers.block import stacked
from revtrain.trainers.block.plan import Run
from revtrain.trainers.common.protocols import DeviceFootprint, Params, TrainState


class DeviceStore:
    """All values on the devices: weights and slots replicated (or sharded), states per
    device; the layers of each run stacked.

    Values are keyed by `Run`: a lone layer's (one repetition) are its own, a scanned
    run's a tuple over the group's positions of stacked trees
    (`revtrain.trainers.block.stacked`). Inside, both are held under the run's first
    flat layer.

    Args:
      placement: the trainer's placement; with ``placement.fsdp`` weights and slots are
        stored sharded (`Placement.weight_shardings`) instead of replicated.
      train_state: the initial values (one entry per flat layer): host arrays or
        ``jax.Array`` s in any sharding.
      runs: the runs the trainer's plan scans (`revtrain.trainers.block.plan.runs_of`).
    """

    def __init__(self, placement: Placement, train_state: TrainState,
                 runs: Sequence[Run] = ()):
        self._placement = placement
        self._runs = tuple(runs)
        self._positions = stacked.run_positions(self._runs)
        self._unstack = stacked.Unstacker()
        self.restore(train_state)

    def restore(self, train_state: TrainState) -> None:
        self._shardings = {"weights": [], "slots": []}
        self._weights: dict[Any, Any] = {}
        self._slots: dict[Any, Any] = {}
        writers = {(run, part): [stacked.StackWriter(self._placement, run.repeats)
                                 for _ in range(run.period)]
                   for run in self._runs for part in ("weights", "slots")}
        # One pass, one layer at a time: ``slots`` may be made as they are read.
        for i, (weights, slots) in enumerate(zip(train_state.weights, train_state.slots,
                                                 strict=True)):
            for part, values, kept in (("weights", weights, self._weights),
                                       ("slots", slots, self._slots)):
                sharding = self._placement.weight_shardings(values)
                self._shardings[part].append(sharding)
                if i in self._positions:
                    run, j, t = self._positions[i]
                    writers[run, part][j].write(t, values)
                else:
                    kept[i] = transfers.put_values(values, sharding)
        for (run, part), position_writers in writers.items():
            kept = self._weights if part == "weights" else self._slots
            kept[run.start] = tuple(w.buffers for w in position_writers)
        states = [for_n_devices(transfers.host_values(s), self._placement.n_devices)
                  for s in train_state.state]
        self._n_layers = len(states)
        self._states = {i: self._per_device(s) for i, s in enumerate(states)
                        if i not in self._positions}
        for run in self._runs:
            self._states[run.start] = tuple(
                self._per_device(stacked.stack_states([states[i] for i in run.members(j)]))
                for j in range(run.period))
        self._new_states: dict[Any, Any] = {}
        self._kept_ids: set[int] = set()
        self._kept_bytes = 0

    def _per_device(self, state: Any) -> Any:
        return transfers.shard_per_device(state, self._placement)

    def begin_step(self) -> None:
        self._new_states = {}
        self._kept_ids, self._kept_bytes = set(), 0

    def prepare(self, position: int) -> None:
        del position

    def weights(self, run: Run) -> Any:
        return self._weights[run.start]

    def params(self, run: Run) -> Params:
        return Params(self._weights[run.start], self._slots[run.start])

    def keep_params(self, run: Run, params: Params) -> None:
        self._weights[run.start], self._slots[run.start] = params

    def state(self, run: Run) -> Any:
        return self._states[run.start]

    def new_state(self, run: Run) -> Any:
        return self._new_states[run.start]

    def keep_state(self, run: Run, new_state: Any) -> None:
        self._new_states[run.start] = new_state

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
        transfers.block_until_ready_live([list(d.values()) for d in
                                          (self._weights, self._slots, self._states)])

    # ----------------------------------------------------------------------------------
    # One entry per flat layer.

    def _per_layer(self, values: dict, entry_of: Any) -> tuple:
        """Per flat layer, ``values[i]`` or, inside a run, ``entry_of(run, j, t)``."""
        return tuple(entry_of(*self._positions[i]) if i in self._positions else values[i]
                     for i in range(self._n_layers))

    def host_values(self, part: str) -> tuple:
        if part == "state":
            host = {run: tuple(transfers.first_device_slice(s)
                               for s in self._states[run.start]) for run in self._runs}
            flat = {i: transfers.first_device_slice(s) for i, s in self._states.items()
                    if i not in self._positions}
            return self._per_layer(flat, lambda run, j, t: stacked.entry(host[run][j], t))
        values = {"weights": self._weights, "slots": self._slots}[part]
        host = {run: tuple(transfers.host_values(v) for v in values[run.start])
                for run in self._runs}
        flat = {i: transfers.host_values(v) for i, v in values.items()
                if i not in self._positions}
        return self._per_layer(flat, lambda run, j, t: stacked.entry(host[run][j], t))

    def saved_values(self, part: str) -> tuple:
        if part == "state":
            return self.host_values(part)
        values = {"weights": self._weights, "slots": self._slots}[part]
        split = {}
        for run in self._runs:
            for j in range(run.period):
                shardings = [self._shardings[part][i] for i in run.members(j)]
                split[run, j] = self._unstack((run, j, part), values[run.start][j],
                                              shardings)
        return self._per_layer(values, lambda run, j, t: split[run, j][t])


    def value_shardings(self, part: str) -> tuple:
        if part == "state":  # Host values: no sharding (the tree alone, nothing copied).
            nothing = lambda tree: jax.tree.map(lambda _: None, tree)
            return self._per_layer({i: nothing(s) for i, s in self._states.items()},
                                   lambda run, j, t: nothing(self._states[run.start][j]))
        return tuple(self._shardings[part])

    def device_footprint(self) -> DeviceFootprint:
        device = self._placement.first_local_device
        weights, slots = list(self._weights.values()), list(self._slots.values())
        return DeviceFootprint(transfers.device_bytes(weights, device),
                               transfers.device_bytes(slots, device),
                               sum(1 for s in self._shardings["weights"] if jax.tree.leaves(s)),
                               self._kept_bytes)
