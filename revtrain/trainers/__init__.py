"""revtrain.trainers: three trainers with one `one_step` API, on three floors.

- top: `trainer` (`Trainer`, plain data-parallel training of the whole model), and
  `reversible` and `memory_efficient` (`ReversibleSerialTrainer`, `MemoryEfficientTrainer`:
  two configurations of the block trainer);
- `block/`: the block trainer, whose step is a plan of ops run against a store of values;
- `common/`: what all three share (the contract and protocols, `TrainerBase`, dispatch,
  the learning rate, the optimizer update, the loss over the global batch, structure
  checks). It imports neither floor above it.

Where values live and how they move (mesh, `Placement`, batches, rngs, collectives,
transfers) is `revtrain.parallel`, one floor below; its helpers are re-exported here, at
the import paths the trainers have always had.
"""

from revtrain.layers.blocks import (
    blocks_to_layers,
    extract_reversible_blocks,
    init_reversible_blocks,
)
from revtrain.parallel import (
    Placement,
    for_n_devices,
    on_accelerator,
    on_cpu,
    per_device_rngs,
    replicate,
    reshape_by_device,
    unreplicate,
)
from revtrain.trainers.block import (
    BlockOptions,
    BlockTrainer,
    CompileTimes,
    DeviceStore,
    HeldValues,
    HostStore,
    Op,
    OpKind,
    ParamStore,
    Run,
    StepValues,
    StoreFactory,
    build_schedule,
    find_runs,
)
from revtrain.trainers.common.protocols import (
    DeviceFootprint,
    Observer,
    Params,
    TrainState,
)
from revtrain.trainers.common.protocols import Trainer as TrainerProtocol
from revtrain.trainers.memory_efficient import MemoryEfficientTrainer, MemoryLog
from revtrain.trainers.reversible import ReversibleSerialTrainer
from revtrain.trainers.trainer import Trainer

__all__ = [
    "Trainer", "ReversibleSerialTrainer", "MemoryEfficientTrainer", "BlockTrainer",
    "BlockOptions",
    "TrainerProtocol", "TrainState", "DeviceFootprint", "Placement", "ParamStore",
    "StepValues", "HeldValues", "StoreFactory", "Params", "Observer", "DeviceStore",
    "HostStore", "MemoryLog", "Op", "OpKind", "Run", "build_schedule", "find_runs",
    "CompileTimes",
    "blocks_to_layers", "extract_reversible_blocks", "init_reversible_blocks",
    "for_n_devices", "on_accelerator", "on_cpu", "per_device_rngs", "replicate",
    "reshape_by_device", "unreplicate",
]
