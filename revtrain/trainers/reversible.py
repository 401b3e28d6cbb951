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
from revtrain.trainers.block.options import BlockOptions, resolve_options
from revtrain.trainers.block.plan import runs_of
from revtrain.trainers.common.base import OptimizerFn, resolve_placement


class ReversibleSerialTrainer(BlockTrainer):
    """Trains ``blocks`` then ``loss_layer`` layer by layer, reversing reversible layers,
    with all weights and optimizer slots on the devices.

    See `BlockTrainer` for the step, the rng contract and the invariance.

    Args:
      blocks: ``[(std_layer, [rev_layers]), ...]``, from `extract_reversible_blocks`; all
        layers initialised (e.g. with `init_reversible_blocks`).
      loss_layer: maps the final stack to a scalar loss; consumes every stack item.
      optimizer_fn: returns an optax ``GradientTransformation`` (called once per layer).
      placement: where values live (`revtrain.parallel.placement.Placement`): all local
        devices by default. ``n_devices=``, ``mesh=`` and ``fsdp=`` are a convenience that
        builds one (`Placement.resolve`; see `Trainer`); ``fsdp`` keeps weights and slots
        sharded over the mesh (FSDP / ZeRO-3): per-device weight and slot bytes drop to
        about ``1 / n_devices``.
      n_devices: a convenience for ``placement``: devices to use (default: all local).
      mesh: a convenience for ``placement``: a named ``jax.sharding.Mesh`` (axes among
        ``data``, ``fsdp``, ``seq``) instead of ``n_devices``.
      fsdp: a convenience for ``placement``: shard weights and slots over the mesh.
      free_accelerators_on_step: the `BlockOptions` field (default False).
      keep_every: the `BlockOptions` field: an exact stack copy every this many
        reversible layers of a block, bounding reconstruction drift; None keeps only block
        inputs.
      clip_global_norm: the `BlockOptions` field: clip the whole model's gradient to this
        global L2 norm before any update, as `Trainer` with ``optax.clip_by_global_norm``
        (an extra backward pass); None does not clip.
      scan_layers: the `BlockOptions` field: scan runs of equal reversible layers.
      options: how the step runs, one value
        (`revtrain.trainers.block.options.BlockOptions`); default ``BlockOptions()``: all
        runs of equal reversible layers scanned (a `ReversibleTransformerLM`'s blocks: one
        forward and one reverse-and-fbo ``lax.scan`` program each, so a step dispatches
        the same 5 programs at any depth, against ``6 * depth + 3`` unscanned), nothing
        kept, nothing clipped. Its fields (``free_accelerators_on_step``, ``keep_every``,
        ``clip_global_norm``, ``scan_layers``) may be given as keyword arguments instead
        (`resolve_options`). Scanning changes neither the results nor the public values
        (one entry per flat layer), and the activation part of the memory stays flat in
        depth (`tests/benchmarks/test_memory_regression.py`).

    Raises:
      TypeError: for a block member that is not a `ReversibleLayer`, or as
        `BlockOptions`.
      ValueError: for uninitialised layers, an impossible ``n_devices``, ``options`` given
        with a field set to other than its default, or as `BlockOptions`.
    """

    def __init__(self, blocks: Sequence[Block], loss_layer: Layer, optimizer_fn: OptimizerFn,
                 n_devices: int | None = None, free_accelerators_on_step: bool = False,
                 keep_every: int | None = None, clip_global_norm: float | None = None,
                 mesh: Mesh | None = None, fsdp: bool = False,
                 placement: Placement | None = None, scan_layers: bool = True,
                 options: BlockOptions | None = None):
        def make_store(placement_, values, schedule):
            return DeviceStore(placement_, values, runs_of(schedule))

        options = resolve_options(options, BlockOptions(),
                                  free_accelerators_on_step=free_accelerators_on_step,
                                  keep_every=keep_every, clip_global_norm=clip_global_norm,
                                  scan_layers=scan_layers)
        super().__init__(blocks, loss_layer, optimizer_fn, make_store,
                         resolve_placement(n_devices, mesh, fsdp, placement), options)
