"""`MemoryEfficientTrainer`: weights and optimizer slots in host memory, a layer at a time.

For models whose weights plus optimizer state do not fit on the accelerator. It is a
`BlockTrainer` -- the same plan and the same compiled per-layer programs as
`ReversibleSerialTrainer` -- whose `ParamStore` is a `HostStore`:

* between steps every layer's weights, slots and state are numpy arrays in host memory;
* just before a layer's function runs its weights (and, for its fbo, its slots) are put on
  the accelerator, and the next ``n_async_layers`` layers' are prefetched while it
  computes (``jax.device_put`` is asynchronous);
* new weights and slots are copied back to host asynchronously (``copy_to_host_async``),
  into the same host buffers every step (allocated once: a step makes no host arrays of a
  layer's size, so the C heap does not fragment), and their device buffers released
  before the next layer runs, so at most ``1 + n_async_layers`` layers' weights are on
  the accelerator at once; on the CPU backend, where device buffers are host memory too,
  a layer's device arrays may share its host buffers' memory, and the model is held once;
* block-boundary activations and layer states wait on the host between the forward and
  backward passes.

With ``fsdp=True`` a put sends each device only its shard of the host value (the gather
to whole weights runs on the devices, inside the layer's function) and a copy-back brings
only shards home, so each device holds ``1 / n_devices`` of the resident layers' weights
and slots.

Trax's ``trainer.MemoryEfficientTrainer`` is the model for this design.

By default every layer runs as its own program (99 dispatches per step for a
``ReversibleTransformerLM`` at depth 16, ``6 * depth + 3`` in general). With
``scan_window=W`` the runs of equal reversible layers that `ReversibleSerialTrainer` scans
whole are cut into windows of at most ``W`` repetitions of their group
(`revtrain.trainers.block.plan.windows`), each one forward and one reverse-and-fbo
``lax.scan`` program: the window's weights, slots and states go to the accelerator as a few
stacked arrays (the host buffers are kept in that layout: `HostStore`), its layers update
inside the program, and its new values come back as one copy. A window is one op of the
prefetch window, so ``1 + n_async_layers`` windows' values may be on the accelerator at
once: ``(1 + n_async_layers) * W`` repetitions of the group (a ``ReversibleTransformerLM``
layer: its attention and feed-forward half-residuals) instead of ``1 + n_async_layers``
flat layers. ``n_async_layers=0`` holds one window at a time and prefetches nothing;
``n_async_layers=1`` overlaps the next window's transfer with the current one's work at
twice the memory. Most of this trainer's host time per step is the puts of dozens of small
leaves per layer (weights, Adam's slots, the injected hyperparameters), which a window
stacks: the host-overhead table of ``docs/benchmarks.md`` (``benchmarks/host_overhead.py``)
gives the programs and host time per step of both modes.

What it cannot do on the CPU backend: "accelerator" memory is host memory there, so the
transfers are copies within one RAM and neither mode saves memory traffic, and the CPU
runtime starts running a program on the calling thread (a scan of small layers runs there
in good part), so a window's program overlaps the host's next put only in part. JAX's
``pinned_host`` memory kind (present on CPU in JAX 0.10; a scan that reads each layer's
weights from it and writes them back runs there) would stream a whole run from host memory
inside one program instead of windows; that store is not built.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import psutil
from jax.sharding import Mesh

from revtrain.layers.base import Layer
from revtrain.layers.blocks import Block
from revtrain.parallel.placement import Placement
from revtrain.trainers.block.block_trainer import BlockTrainer
from revtrain.trainers.block.host_store import HostStore
from revtrain.trainers.block.options import BlockOptions, resolve_options
from revtrain.trainers.block.precompile import AbstractHostStore
from revtrain.trainers.common.base import OptimizerFn, resolve_placement
from revtrain.trainers.common.protocols import TrainState

logger = logging.getLogger(__name__)

_LOGGED_PHASES = {"step_start": "forward_start", "loss_start": "loss_start",
                  "backward_start": "backward_start", "step_end": "backward_end"}


class MemoryLog:
    """An observer that measures host RSS and accelerator bytes in use at the phases of
    every ``n_steps_per_log``-th step and logs them (logger ``revtrain.trainers``, INFO).

    Attributes:
      records: the measurements of the last logged step: dicts with ``step``, ``phase``
        (``forward_start``, ``loss_start``, ``backward_start``, ``backward_end``),
        ``host_rss_bytes`` and ``accelerator_bytes_in_use``.
    """

    def __init__(self, device: Any, n_steps_per_log: int):
        self._device, self._every = device, n_steps_per_log
        self._step = 0
        self.records: list[dict[str, Any]] = []

    def on_phase(self, label: str) -> None:
        logging_step = self._step % self._every == 0
        if label == "step_end":
            self._step += 1
        if not logging_step or label not in _LOGGED_PHASES:
            return
        from revtrain import memory  # Local: memory imports nothing from trainers.
        phase = _LOGGED_PHASES[label]
        if phase == "forward_start":
            self.records = []
        in_use = memory.bytes_in_use(self._device)
        record = {"step": self._step - (label == "step_end"), "phase": phase,
                  "host_rss_bytes": psutil.Process().memory_info().rss,
                  "accelerator_bytes_in_use": (in_use if in_use is not None
                                               else memory.live_device_bytes(self._device))}
        self.records.append(record)
        logger.info("MemoryEfficientTrainer step %d %s: host RSS %s, accelerator %s in use",
                    record["step"], phase, memory.format_bytes(record["host_rss_bytes"]),
                    memory.format_bytes(record["accelerator_bytes_in_use"]))


# The host-memory configuration frees the devices on every step, and scans only in windows.
_DEFAULTS = BlockOptions(free_accelerators_on_step=True, scan_layers=False)


class MemoryEfficientTrainer(BlockTrainer):
    """A block trainer whose weights, slots and states live in host memory.

    Args:
      blocks: ``[(std_layer, [rev_layers]), ...]``, all layers initialised.
      loss_layer: maps the final stack to a scalar loss.
      optimizer_fn: returns an optax ``GradientTransformation`` (called once per layer).
      placement: where values live (`revtrain.parallel.placement.Placement`): all local
        devices by default. ``n_devices=``, ``mesh=`` and ``fsdp=`` are a convenience that
        builds one (`Placement.resolve`; see `Trainer`); ``fsdp`` moves weights and slots
        to the devices as shards (FSDP / ZeRO-3; see `HostStore`).
      n_async_layers: how many upcoming ops' weights to prefetch (layers, or windows
        with ``scan_window``).
      n_steps_per_log: log host RSS and accelerator bytes in use at the forward, loss and
        backward phases every this many steps (logger ``revtrain.trainers``, INFO).
      n_devices: a convenience for ``placement``: devices to use (default: all local).
      mesh: a convenience for ``placement``: a named ``jax.sharding.Mesh`` (axes among
        ``data``, ``fsdp``, ``seq``) instead of ``n_devices``.
      fsdp: a convenience for ``placement``: shard weights and slots over the mesh.
      free_accelerators_on_step: the `BlockOptions` field (default True).
      keep_every: the `BlockOptions` field: an exact stack copy every this many
        reversible layers of a block, bounding reconstruction drift; None keeps only block
        inputs.
      clip_global_norm: the `BlockOptions` field: clip the whole model's gradient to this
        global L2 norm before any update, as `Trainer` with ``optax.clip_by_global_norm``
        (an extra backward pass); None does not clip.
      scan_window: the `BlockOptions` field: scan runs of equal reversible layers in
        windows of at most this many repetitions (below); None runs layer by layer.
      options: how the step runs, one value
        (`revtrain.trainers.block.options.BlockOptions`), or its fields as keyword
        arguments (`resolve_options`). Here ``free_accelerators_on_step`` defaults to True:
        after the forward pass and after the step, every device buffer this trainer owns
        is deleted (the final activations wait on the host for the loss layer; the
        caller's buffers are never deleted); ``keep_every`` copies wait in host memory;
        ``clip_global_norm``'s extra backward pass moves weights but no slots; and
        ``scan_window`` (``scan_layers`` follows it) runs each run of equal reversible
        layers (a `ReversibleTransformerLM`'s blocks) as windows of at most this many
        repetitions of its group, one forward and one reverse-and-fbo scan program each,
        the window's values moved as stacked arrays (see the module docstring): fewer
        dispatches and host work per step, and up to ``(1 + n_async_layers) *
        scan_window`` repetitions of the group on the accelerator instead of ``1 +
        n_async_layers`` flat layers. A last window of one repetition runs layer by
        layer. None (the default) runs one program per layer. Results do not change.

    Raises:
      TypeError: for a ``scan_window`` that is not an int.
      ValueError: for ``n_async_layers < 0``, ``n_steps_per_log < 1`` or ``scan_window <
        2`` (before anything is put on a device), and as `BlockTrainer`.
    """

    def __init__(self, blocks: Sequence[Block], loss_layer: Layer, optimizer_fn: OptimizerFn,
                 n_devices: int | None = None, free_accelerators_on_step: bool = True,
                 n_async_layers: int = 1, n_steps_per_log: int = 100,
                 keep_every: int | None = None, clip_global_norm: float | None = None,
                 mesh: Mesh | None = None, fsdp: bool = False,
                 placement: Placement | None = None, scan_window: int | None = None,
                 options: BlockOptions | None = None):
        if n_async_layers < 0:
            raise ValueError(f"n_async_layers={n_async_layers} must be >= 0")
        if n_steps_per_log < 1:
            raise ValueError(f"n_steps_per_log={n_steps_per_log} must be >= 1")
        self.n_async_layers = n_async_layers
        self.n_steps_per_log = n_steps_per_log
        options = resolve_options(options, _DEFAULTS,
                                  free_accelerators_on_step=free_accelerators_on_step,
                                  keep_every=keep_every, clip_global_norm=clip_global_norm,
                                  scan_window=scan_window)
        options = dataclasses.replace(options, scan_layers=options.scan_window is not None)

        def make_store(placement_, values, schedule):
            return HostStore(placement_, values, schedule, n_async_layers,
                             options.free_accelerators_on_step)

        super().__init__(blocks, loss_layer, optimizer_fn, make_store,
                         resolve_placement(n_devices, mesh, fsdp, placement), options)
        self.scan_window = options.scan_window
        self._memory_log = MemoryLog(self.placement.first_local_device, n_steps_per_log)
        self.observers.append(self._memory_log)

    def abstract_store(self, device: Any = None) -> AbstractHostStore:
        """An abstract store that keeps values as `HostStore` does: in host memory but
        the current and the next ``n_async_layers`` ops'
        (`revtrain.trainers.block.precompile.AbstractHostStore`, whose ``device``
        accounts for the copies it makes and frees).
        """
        signature = TrainState(*map(self.value_signature, TrainState._fields))
        return AbstractHostStore(self.placement, signature, self.runs, self.schedule,
                                 self.n_async_layers, self.free_accelerators_on_step,
                                 device)

    @property
    def max_resident_layers(self) -> int:
        """The most layers whose weights were on the accelerator at once in the last step."""
        return self._store.max_resident_layers

    @property
    def memory_log(self) -> list[dict[str, Any]]:
        """The phase measurements of the last logged step (see `MemoryLog`)."""
        return self._memory_log.records
