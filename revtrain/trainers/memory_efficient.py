"""`MemoryEfficientTrainer`: weights and optimizer slots in host memory, a layer at a time.

For models whose weights plus optimizer state do not fit on the accelerator. It runs the
same block-wise schedule and the same compiled per-layer functions as
`ReversibleSerialTrainer` (it is a subclass that only changes where values live):

* between steps every layer's weights, slots and state are numpy arrays in host memory;
* just before a layer's function runs its weights (and, for its fbo, its slots) are put on
  the accelerator, and the next ``n_async_layers`` layers' are prefetched while it
  computes (``jax.device_put`` is asynchronous);
* new weights and slots are copied back to host asynchronously (``copy_to_host_async``) and
  their device buffers released before the next layer runs, so at most
  ``1 + n_async_layers`` layers' weights are on the accelerator at once;
* block-boundary activations and layer states wait on the host between the forward and
  backward passes.

Trax's ``trainer.MemoryEfficientTrainer`` is the model for this design.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import psutil

from revtrain.layers.base import Layer
from revtrain.trainers import devices
from revtrain.trainers.base import OptimizerFn
from revtrain.trainers.reversible import Block, ReversibleSerialTrainer, delete_arrays

_FORWARD, _LOSS, _BACKWARD = "forward", "loss", "backward"


class MemoryEfficientTrainer(ReversibleSerialTrainer):
    """`ReversibleSerialTrainer` whose weights, slots and states live in host memory.

    Args:
      blocks: ``[(std_layer, [rev_layers]), ...]``, all layers initialised.
      loss_layer: maps the final stack to a scalar loss.
      optimizer_fn: returns an optax ``GradientTransformation`` (called once per layer).
      n_devices: devices to use (default: all local devices).
      free_accelerators_on_step: after the forward pass and after the step, delete every
        device buffer this trainer owns (the final activations wait on the host for the
        loss layer). Only buffers the trainer made are deleted, never the caller's.
      n_async_layers: how many upcoming layers' weights to prefetch.
      n_steps_per_log: log host RSS and accelerator bytes in use at the forward, loss and
        backward phases every this many steps (absl/std logging, INFO).

    Attributes:
      max_resident_layers: the most layers whose weights were on the accelerator at once
        during the last step (current + prefetched + results not yet copied back).
      memory_log: the phase measurements of the last logged step.
    """

    def __init__(self, blocks: Sequence[Block], loss_layer: Layer, optimizer_fn: OptimizerFn,
                 n_devices: int | None = None, free_accelerators_on_step: bool = True,
                 n_async_layers: int = 1, n_steps_per_log: int = 100):
        if n_async_layers < 0:
            raise ValueError(f"n_async_layers={n_async_layers} must be >= 0")
        if n_steps_per_log < 1:
            raise ValueError(f"n_steps_per_log={n_steps_per_log} must be >= 1")
        self.n_async_layers = n_async_layers
        self.n_steps_per_log = n_steps_per_log
        self._resident: dict[int, list] = {}
        self._pending: list[tuple[int, Any, Any]] = []
        self._schedule: list[tuple[int, str]] = []
        self.max_resident_layers = 0
        self.memory_log: list[dict[str, Any]] = []
        self._step = 0
        super().__init__(blocks, loss_layer, optimizer_fn, n_devices,
                         free_accelerators_on_step)

    # ----------------------------------------------------------------------------------
    # Storage hooks of ReversibleSerialTrainer.

    def _store_initial(self, weights: list, states: list, slots: list) -> None:
        self._w_on_host = [devices.on_cpu(w) for w in weights]
        self._slots_on_host = [devices.on_cpu(s) for s in slots]
        self._states = [devices.on_cpu(devices.for_n_devices(s, self.n_devices))
                        for s in states]

    def _device_weights_and_slots(self, i: int) -> tuple[Any, Any]:
        entry = self._fetch(i, with_slots=True)
        return entry[0], entry[1]

    def _keep_weights_and_slots(self, i: int, weights: Any, slots: Any) -> None:
        self._resident.pop(i, None)
        for leaf in jax.tree.leaves((weights, slots)):
            leaf.copy_to_host_async()
        self._pending.append((i, weights, slots))

    def _device_state(self, state: Any) -> Any:
        return devices.shard_per_device(state, self.mesh)

    def _keep_state(self, state: Any) -> Any:
        host = devices.local_rows(state)
        delete_arrays(state)
        return host

    def _keep_stack(self, stack: Any) -> Any:
        return devices.local_rows(stack)

    def _device_stack(self, kept: Any) -> Any:
        return devices.shard_per_device(kept, self.mesh) if _is_host(kept) else kept

    def _host_weights(self, i: int) -> Any:
        return self._w_on_host[i]

    def _host_slots(self, i: int) -> Any:
        return self._slots_on_host[i]

    def _host_state(self, i: int) -> Any:
        return jax.tree.map(lambda a: np.asarray(a)[0], self._states[i])

    # ----------------------------------------------------------------------------------
    # Prefetching and copying back.

    def _fetch(self, i: int, with_slots: bool) -> list:
        entry = self._resident.get(i)
        if entry is None:
            entry = self._resident[i] = [devices.replicate(self._w_on_host[i], self.mesh), None]
        if with_slots and entry[1] is None:
            entry[1] = devices.replicate(self._slots_on_host[i], self.mesh)
        return entry

    def _resolve_pending(self) -> None:
        for i, weights, slots in self._pending:
            self._w_on_host[i], self._slots_on_host[i] = devices.unreplicate((weights, slots))
            delete_arrays((weights, slots))
        self._pending = []

    def _begin_step(self, schedule: list[int]) -> None:
        n = len(self.layers)
        self._schedule = [(i, _FORWARD) for i in schedule[:n - 1]] + [(n - 1, _LOSS)] + [
            (i, _BACKWARD) for i in schedule[n:]]
        self.max_resident_layers = 0

    def _before_layer(self, position: int) -> None:
        self._resolve_pending()
        window = self._schedule[position:position + 1 + self.n_async_layers]
        wanted = {i for i, _ in window}
        for i in [i for i in self._resident if i not in wanted]:
            delete_arrays(self._resident.pop(i))
        for i, phase in window:
            self._fetch(i, with_slots=phase != _FORWARD)
        self.max_resident_layers = max(self.max_resident_layers, len(self._resident))
        phase = self._schedule[position][1]
        if position == 0 or phase != self._schedule[position - 1][1]:
            self._log_memory(f"{phase}_start")

    def _end_forward(self, stack: Any) -> Any:
        if not self.free_accelerators_on_step:
            return stack
        host = devices.local_rows(stack)
        delete_arrays(stack)
        self._free_resident()
        return host

    def _end_step(self) -> None:
        self._resolve_pending()
        if self.free_accelerators_on_step:
            self._free_resident()
        self._log_memory("backward_end")
        self._step += 1

    def _free_resident(self) -> None:
        for entry in self._resident.values():
            delete_arrays(entry)
        self._resident = {}

    def _log_memory(self, phase: str) -> None:
        if self._step % self.n_steps_per_log:
            return
        if phase == "forward_start":
            self.memory_log = []
        from revtrain import memory  # Local: memory imports nothing from trainers.
        device = self.mesh.devices.flat[0]
        in_use = memory.bytes_in_use(device)
        record = {"step": self._step, "phase": phase, "host_rss_bytes":
                  psutil.Process().memory_info().rss,
                  "accelerator_bytes_in_use": (in_use if in_use is not None
                                               else memory.live_device_bytes(device))}
        self.memory_log.append(record)
        logging.info("MemoryEfficientTrainer step %d %s: host RSS %s, accelerator %s in use",
                     self._step, phase, memory.format_bytes(record["host_rss_bytes"]),
                     memory.format_bytes(record["accelerator_bytes_in_use"]))


def _is_host(tree: Any) -> bool:
    return all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(tree))
