"""revtrain.trainers: three trainers with one `one_step` API, and their shared helpers."""

from revtrain.layers.blocks import (
    blocks_to_layers,
    extract_reversible_blocks,
    init_reversible_blocks,
)
from revtrain.trainers.block import BlockTrainer
from revtrain.trainers.devices import (
    for_n_devices,
    on_accelerator,
    on_cpu,
    per_device_rngs,
    replicate,
    reshape_by_device,
    unreplicate,
)
from revtrain.trainers.memory_efficient import MemoryEfficientTrainer, MemoryLog
from revtrain.trainers.precompile import CompileTimes
from revtrain.trainers.protocols import (
    DeviceFootprint,
    Observer,
    ParamStore,
    TrainState,
)
from revtrain.trainers.reversible import ReversibleSerialTrainer
from revtrain.trainers.schedule import Op, build_schedule
from revtrain.trainers.stores import DeviceStore, HostStore
from revtrain.trainers.trainer import Trainer

__all__ = [
    "Trainer", "ReversibleSerialTrainer", "MemoryEfficientTrainer", "BlockTrainer",
    "TrainState", "DeviceFootprint", "ParamStore", "Observer", "DeviceStore", "HostStore",
    "MemoryLog", "Op", "build_schedule", "CompileTimes",
    "blocks_to_layers", "extract_reversible_blocks", "init_reversible_blocks",
    "for_n_devices", "on_accelerator", "on_cpu", "per_device_rngs", "replicate",
    "reshape_by_device", "unreplicate",
]
