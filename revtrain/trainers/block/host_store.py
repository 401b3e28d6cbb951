"""`HostStore`: a block trainer's values in host memory, a window of ops' values on the
devices (`MemoryEfficientTrainer`, after Trax's ``trainer.MemoryEfficientTrainer``).

Weights, slots and states live in host memory (numpy) between uses; an op's values are
put on the devices just before it runs, the next ``n_async_layers`` ops' are prefetched
(``jax.device_put`` is asynchronous), new values are copied back with
``copy_to_host_async`` into the same host buffers (allocated once, updated in place) and
their device buffers released before the next op, and block inputs wait on the host. With
``fsdp`` a put sends each device only its shard and a copy-back brings only the shards
home. An op is one layer's, or a scanned `revtrain.trainers.block.plan.Run` 's (a window of a
run: `revtrain.trainers.block.plan.windows`): its host buffers are kept in the stacked
layout (`revtrain.trainers.block.stacked`: one ``[repeats, ...]`` array per leaf and group
position), of which each layer's values are views, so the run goes to the devices and
back as a few arrays and `host_values` still has one entry per flat layer. See
`revtrain.trainers.block.stores` for the contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from revtrain.parallel import transfers
from revtrain.parallel.batches import for_n_devices
from revtrain.parallel.placement import Placement
from revtrain.parallel.transfers import delete_arrays
from revtrain.trainers.block import stacked
from revtrain.trainers.block.plan import Op, OpKind, Run, runs_of
from revtrain.trainers.common.protocols import DeviceFootprint, Params, TrainState


def _host_buffers(tree: Any) -> Any:
    """Writeable C-contiguous numpy copies the store owns (a caller's array is never
    aliased): its host buffers, allocated once and updated in place by every step."""
    return jax.tree.map(lambda a: np.array(a, order="C"), tree)


def _host_copy(tree: Any) -> Any:
    """Read-only numpy copies (values a store keeps whole and replaces each step)."""
    def copy(a):
        a = np.array(transfers.host_value(a))
        a.flags.writeable = False
        return a
    return jax.tree.map(copy, tree)


def _copy_into(host: Any, result: Any) -> None:
    """Copies the jax arrays of ``result`` into the host buffers of ``host`` (the same
    leaves in the same order), then frees their device buffers.

    A replicated leaf is read from this process's first copy; an FSDP-sharded one shard by
    shard into its slice of the buffer (all-gathered over processes when some shards live
    elsewhere: a collective every process reaches, in the same order). On the CPU backend
    ``np.asarray`` of a shard is a view of its buffer, so this is the only copy; elsewhere
    it is the host copy ``copy_to_host_async`` started, freed once its values are in place.
    These reads are this store's job, so they are allowed explicitly (a step runs clean
    under ``jax.transfer_guard('disallow')``) without ``jax.device_get``'s per-leaf cost.
    """
    with jax.transfer_guard_device_to_host("allow"):
        for buffer, leaf in zip(jax.tree.leaves(host), jax.tree.leaves(result), strict=True):
            if leaf.sharding.is_fully_replicated:
                np.copyto(buffer, np.asarray(leaf.addressable_shards[0].data))
            elif leaf.is_fully_addressable:
                for shard in leaf.addressable_shards:
                    np.copyto(buffer[shard.index], np.asarray(shard.data))
            else:
                np.copyto(buffer, transfers.host_value(leaf))
            leaf.delete()


class HostStore:
    """Values in host memory; the values of ``1 + n_async_layers`` ops on the devices.

    Values are keyed by `Run` (held under its first layer): a lone layer's (one
    repetition) are its own, a scanned run's a tuple over the group's positions of stacked
    trees, as `revtrain.trainers.block.device_store.DeviceStore` keeps them.

    Args:
      placement: the trainer's placement (with ``placement.fsdp``, see below).
      train_state: the initial values (host trees, one entry per flat layer).
      schedule: the trainer's ops; `prepare` looks ahead in it, and the scanned runs its
        ops name are kept stacked.
      n_async_layers: how many upcoming ops' weights (and, for backward ops that
        update, slots) to prefetch: layers, or whole scanned runs.
      free_accelerators_on_step: after the forward pass and at the end of the step,
        delete every device buffer this store holds; the final activations wait on the
        host for the loss op.

    With ``placement.fsdp`` weights and slots go to the devices sharded
    (`Placement.weight_shardings`): each device receives only its shard of the host value
    and the all-gather runs on the devices, inside the layer's program; new values come
    back as shards. With several processes each process's host still holds whole values
    (a copy-back all-gathers the other processes' shards).

    Attributes:
      max_resident_layers: the most flat layers whose weights were on the devices at
        once during the last step (current + prefetched + results not yet copied back; a
        run's op counts all its layers).
    """

    def __init__(self, placement: Placement, train_state: TrainState,
                 schedule: Sequence[Op], n_async_layers: int,
                 free_accelerators_on_step: bool):
        self._placement = placement
        self._schedule = tuple(schedule)
        self._n_async = n_async_layers
        self._free = free_accelerators_on_step
        self._resident: dict[int, list] = {}
        self._pending: list[tuple[int, Params]] = []
        self._runs = {run.start: run for run in runs_of(schedule)}
        self.max_resident_layers = 0
        self.restore(train_state)

    def restore(self, train_state: TrainState) -> None:
        self._free_resident()
        for _, params in self._pending:  # Not landed (last or failed step): replaced.
            transfers.delete_quietly(params)
        self._pending = []
        self._weights = [transfers.host_values(w) for w in train_state.weights]
        self._slots = [transfers.host_values(s) for s in train_state.slots]
        in_runs = {i for run in self._runs.values() for i in run.layers}
        for values in (self._weights, self._slots):
            for i in range(len(values)):
                if i not in in_runs:
                    values[i] = _host_buffers(values[i])
        # Key -> (weights, slots) host buffers: a layer's, or a run's stacked ones, of
        # which its layers' entries above become views (written in place by a step).
        self._buffers: dict[int, Params] = {
            i: Params(self._weights[i], self._slots[i])
            for i in range(len(self._weights)) if i not in in_runs}
        for start, run in self._runs.items():
            self._buffers[start] = Params(*(self._stack(values, run)
                                            for values in (self._weights, self._slots)))
        self._shardings = {
            key: tuple(self._placement.stacked_weight_shardings(v) if key in self._runs
                       else self._placement.weight_shardings(v) for v in values)
            for key, values in self._buffers.items()}
        self._states = [_host_copy(for_n_devices(transfers.host_values(s),
                                                 self._placement.n_devices))
                        for s in train_state.state]
        self._new_states: list[Any] = [None] * len(self._states)

    @staticmethod
    def _stack(values: list, run: Run) -> tuple:
        """Per group position, the stacked host buffers ``[repeats, *leaf]`` of ``run``'s
        layers' ``values`` (a new C-contiguous array per leaf); ``values[i]`` of each of
        those layers becomes the view of its entry."""
        per_position = []
        for j in range(run.period):
            members = list(run.members(j))
            buffers = jax.tree.map(lambda *leaves: np.stack(leaves),
                                   *[values[i] for i in members])
            for t, i in enumerate(members):
                values[i] = jax.tree.map(lambda a, t=t: a[t, ...], buffers)  # Views, 0-d too.
            per_position.append(buffers)
        return tuple(per_position)

    def _n_flat(self, key: int) -> int:
        run = self._runs.get(key)
        return 1 if run is None else run.stop - run.start

    # ----------------------------------------------------------------------------------
    # The prefetch window.

    def _put(self, host: Any, shardings: Any) -> Any:
        """Device arrays of host buffers, one sharding per leaf, in one batched put
        (`revtrain.parallel.transfers.put_batched`); an FSDP-sharded leaf sends each
        device only its slice. No owned device copy is made: the programs donate these
        arrays, which frees them and leaves the host buffers, the store's, untouched."""
        return transfers.put_batched(host, shardings)

    def _fetch(self, key: int, with_slots: bool) -> list:
        """The device ``[weights, slots or None]`` of a layer or a run (by its first layer),
        put now unless resident."""
        entry = self._resident.get(key)
        buffers, shardings = self._buffers[key], self._shardings[key]
        if entry is None:
            entry = self._resident[key] = [self._put(buffers.weights, shardings[0]), None]
        if with_slots and entry[1] is None:
            entry[1] = self._put(buffers.slots, shardings[1])
        return entry

    def _resolve_pending(self) -> None:
        """Lands the new weights and slots in the host buffers. A layer's (or run's)
        buffers are written only after its program finished (``np.asarray`` waits for it),
        and no device array sharing them is live then: the program took them (donated)."""
        for key, params in self._pending:
            _copy_into(tuple(self._buffers[key]), tuple(params))
        self._pending = []

    def _free_resident(self) -> None:
        for entry in self._resident.values():
            delete_arrays(entry)
        self._resident = {}

    def begin_step(self) -> None:
        self._resolve_pending()  # The last step's final updates, left in flight.
        self._new_states = [None] * len(self._states)
        self.max_resident_layers = 0

    def prepare(self, position: int) -> None:
        self._resolve_pending()
        window = self._schedule[position:position + 1 + self._n_async]
        wanted = {op.layer for op in window}
        for i in [i for i in self._resident if i not in wanted]:
            delete_arrays(self._resident.pop(i))
        for op in window:
            forward = op.kind == OpKind.FORWARD
            self._fetch(op.layer, with_slots=not forward and op.finisher.donates_values)
        self.max_resident_layers = max(self.max_resident_layers,
                                       sum(map(self._n_flat, self._resident)))

    # ----------------------------------------------------------------------------------
    # Values of one op.

    def weights(self, run: Run) -> Any:
        return self._fetch(run.start, with_slots=False)[0]

    def params(self, run: Run) -> Params:
        weights, slots = self._fetch(run.start, with_slots=True)
        return Params(weights, slots)

    def keep_params(self, run: Run, params: Params) -> None:
        key = run.start
        self._resident.pop(key, None)  # Donated: the old buffers are gone.
        for leaf in jax.tree.leaves(params):
            leaf.copy_to_host_async()
        self._pending.append((key, params))

    def _stacked_states(self, states: list, run: Run) -> tuple:
        return tuple(stacked.stack_states([states[i] for i in run.members(j)])
                     for j in range(run.period))

    def state(self, run: Run) -> Any:
        host = (self._stacked_states(self._states, run) if run.repeats > 1
                else self._states[run.start])
        return transfers.shard_per_device(host, self._placement)

    def new_state(self, run: Run) -> Any:
        host = (self._stacked_states(self._new_states, run) if run.repeats > 1
                else self._new_states[run.start])
        return transfers.shard_per_device(host, self._placement)

    def keep_state(self, run: Run, new_state: Any) -> None:
        host = transfers.local_rows(new_state)
        delete_arrays(new_state)
        if run.repeats == 1:  # A lone layer: its own state.
            self._new_states[run.start] = host
            return
        for j in range(run.period):  # [devices, repeats, ...] -> each layer's [devices, ...]
            for t, layer in enumerate(run.members(j)):
                self._new_states[layer] = stacked.entry(host[j], t, axis=1)

    def stash(self, stack: Any) -> Any:
        return transfers.local_rows(stack)

    def unstash(self, kept: Any) -> Any:
        if all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(kept)):
            return transfers.shard_per_device(kept, self._placement)
        return kept

    def end_forward(self, stack: Any) -> Any:
        if not self._free:
            return stack
        host = transfers.local_rows(stack)
        delete_arrays(stack)
        self._free_resident()
        return host

    def finish_step(self) -> None:
        # Without ``free_accelerators_on_step`` the last op's new weights and slots stay
        # pending (their copies back under way), so that the step returns while its final
        # update runs; the next step, a read of the values or `block_until_ready` lands
        # them. Freeing the devices at the end of the step means waiting for them.
        if self._free:
            self._resolve_pending()
            self._free_resident()
        self._states = self._new_states

    def block_until_ready(self) -> None:
        self._resolve_pending()  # Lands the copies back to host memory.
        transfers.block_until_ready_live(list(self._resident.values()))

    # ----------------------------------------------------------------------------------
    # Host values and the device account.

    def host_values(self, part: str) -> tuple:
        self._resolve_pending()
        if part == "state":
            return tuple(jax.tree.map(lambda a: np.asarray(a)[0], s) for s in self._states)
        # Copies: the host buffers change in place with every step.
        return tuple(_host_copy(v) for v in {"weights": self._weights,
                                               "slots": self._slots}[part])

    def saved_values(self, part: str) -> tuple:
        return self.host_values(part)

    def value_shardings(self, part: str) -> tuple:
        values = {"weights": self._weights, "slots": self._slots, "state": self._states}[part]
        return tuple(jax.tree.map(lambda _: None, v) for v in values)  # Nothing copied.

    def device_footprint(self) -> DeviceFootprint:
        device = self._placement.first_local_device
        weights = [e[0] for e in self._resident.values()] + [p.weights for _, p in
                                                             self._pending]
        slots = [e[1] for e in self._resident.values()] + [p.slots for _, p in self._pending]
        keys = set(self._resident) | {key for key, _ in self._pending}
        return DeviceFootprint(transfers.device_bytes(weights, device),
                               transfers.device_bytes(slots, device),
                               sum(map(self._n_flat, keys)))
