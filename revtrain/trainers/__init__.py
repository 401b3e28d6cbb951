"""revtrain.trainers: three trainers with one `one_step` API, and their shared helpers.

A block trainer's step is a value: `plan` (its ops, each with its compiled program),
`executor` (the one function that runs it against a store) and `programs` (what each
program computes; a scanned `Run` of equal layers is one program each way:
`scan_programs`). Where values live is a `Placement` (the mesh and what is sharded over
which axis) and a `ParamStore` (`DeviceStore`, `HostStore`, or your own).
"""

from revtrain.layers.blocks import (
    blocks_to_layers,
    extract_reversible_blocks,
    init_reversible_blocks,
)
from revtrain.trainers.batches import for_n_devices, reshape_by_device
from revtrain.trainers.block_trainer import BlockTrainer
from revtrain.trainers.device_store import DeviceStore
from revtrain.trainers.host_store import HostStore
from revtrain.trainers.memory_efficient import MemoryEfficientTrainer, MemoryLog
from revtrain.trainers.placement import Placement
from revtrain.trainers.plan import Op, OpKind, Run, build_schedule
from revtrain.trainers.precompile import CompileTimes
from revtrain.trainers.protocols import (
    DeviceFootprint,
    Observer,
    Params,
    TrainState,
)
from revtrain.trainers.protocols import Trainer as TrainerProtocol
from revtrain.trainers.reversible import ReversibleSerialTrainer
from revtrain.trainers.rngs import per_device_rngs
from revtrain.trainers.scan_programs import find_runs
from revtrain.trainers.stores import HeldValues, ParamStore, StepValues, StoreFactory
from revtrain.trainers.trainer import Trainer
from revtrain.trainers.transfers import on_accelerator, on_cpu, replicate, unreplicate

__all__ = [
    "Trainer", "ReversibleSerialTrainer", "MemoryEfficientTrainer", "BlockTrainer",
    "TrainerProtocol", "TrainState", "DeviceFootprint", "Placement", "ParamStore",
    "StepValues", "HeldValues", "StoreFactory", "Params", "Observer", "DeviceStore",
    "HostStore", "MemoryLog", "Op", "OpKind", "Run", "build_schedule", "find_runs",
    "CompileTimes",
    "blocks_to_layers", "extract_reversible_blocks", "init_reversible_blocks",
    "for_n_devices", "on_accelerator", "on_cpu", "per_device_rngs", "replicate",
    "reshape_by_device", "unreplicate",
]
