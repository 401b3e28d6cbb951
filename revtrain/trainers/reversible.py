"""`ReversibleSerialTrainer`: block-wise training with every value on the devices.

A `BlockTrainer` whose `ParamStore` is a `DeviceStore`: all layers' weights and optimizer
slots on the mesh (replicated, or sharded with ``fsdp=True``), one layer's activations at a
time (Trax's ``ReversibleSerialTrainer``).
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import Mesh

from revtrain.layers.base import Layer
from revtrain.layers.blocks import Block
from revtrain.parallel.placement import Placement
from revtrain.trainers.block.block_trainer import BlockTrainer
from revtrain.trainers.block.device_store import DeviceStore
from revtrain.trainers.block.plan import runs_of
from revtrain.trainers.common.base import OptimizerFn


class ReversibleSerialTrainer(BlockTrainer):
    """Trains ``blocks`` then ``loss_layer`` layer by layer, reversing reversible layers,
    with all weights and optimizer slots on the devices.

    See `BlockTrainer` for the step, the rng contract and the invariance.

    Args:
      blocks: ``[(std_layer, [rev_layers]), ...]``, from `extract_reversible_blocks`; all
        layers initialised (e.g. with `init_reversible_blocks`).
      loss_layer: maps the final stack to a scalar loss; consumes every stack item.
      optimizer_fn: returns an optax ``GradientTransformation`` (called once per layer).
      n_devices: devices to use (default: all local devices).
      free_accelerators_on_step: delete this trainer's transient device buffers (the
        batch, block inputs, final activations and cotangents) at the end of each step;
        the batch is then copied through host memory, so a caller's arrays are never
        deleted.
      keep_every: keep an exact copy of the stack every this many reversible layers of a
        block, bounding reconstruction drift (see `BlockTrainer`); None keeps only block
        inputs.
      clip_global_norm: clip the whole model's gradient to this global L2 norm before
        any update, exactly as `Trainer` with ``optax.clip_by_global_norm`` (an extra
        backward pass without updates; see `BlockTrainer`); None does not clip.
      mesh: a ``jax.sharding.Mesh`` instead of ``n_devices``: a named mesh of axes among
        ``data``, ``fsdp``, ``seq`` or a one-axis mesh (see `Trainer`).
      fsdp: keep weights and slots sharded over the mesh (FSDP / ZeRO-3; see
        `BlockTrainer`): per-device weight and slot bytes drop to about ``1 / n_devices``.
      placement: a `revtrain.parallel.placement.Placement` instead of ``n_devices``,
        ``mesh`` and ``fsdp``.
      scan_layers: run each run of equal reversible layers (a `ReversibleTransformerLM`'s
        blocks) as one forward and one reverse-and-fbo ``lax.scan`` program, its weights,
        slots and states stacked on the devices, so a step dispatches the same few
        programs at any depth (5 for a `ReversibleTransformerLM`, against ``6 * depth +
        3`` with False); False runs one program per layer and op, for debugging and
        comparison. The results and the public values (one entry per flat layer) are
        the same either way, and the activation part of the memory stays flat in depth
        (the scan's temporaries are one layer's; per flat layer only its scalar results
        and key remain, about 120 bytes: `tests/benchmarks/test_memory_regression.py`).
        See `revtrain.trainers.block.scan_programs`.

    Raises:
      TypeError: for a block member that is not a `ReversibleLayer`.
      ValueError: for uninitialised layers or an impossible ``n_devices``.
    """

    def __init__(self, blocks: Sequence[Block], loss_layer: Layer, optimizer_fn: OptimizerFn,
                 n_devices: int | None = None, free_accelerators_on_step: bool = False,
                 keep_every: int | None = None, clip_global_norm: float | None = None,
                 mesh: Mesh | None = None, fsdp: bool = False,
                 placement: Placement | None = None, scan_layers: bool = True):
        def make_store(placement_, values, schedule):
            return DeviceStore(placement_, values, runs_of(schedule))

        super().__init__(blocks, loss_layer, optimizer_fn, make_store, n_devices=n_devices,
                         free_accelerators_on_step=free_accelerators_on_step,
                         keep_every=keep_every, clip_global_norm=clip_global_norm,
                         mesh=mesh, fsdp=fsdp, placement=placement,
                         scan_layers=scan_layers)
