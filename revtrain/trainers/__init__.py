"""revtrain.trainers: three trainers with one `one_step` API, and their shared helpers."""

from revtrain.layers.blocks import (
    blocks_to_layers,
    extract_reversible_blocks,
    init_reversible_blocks,
)
from revtrain.trainers.devices import (
    for_n_devices,
    on_accelerator,
    on_cpu,
    per_device_rngs,
    replicate,
    reshape_by_device,
    unreplicate,
)
from revtrain.trainers.memory_efficient import MemoryEfficientTrainer
from revtrain.trainers.reversible import ReversibleSerialTrainer
from revtrain.trainers.trainer import Trainer

__all__ = [
    "Trainer", "ReversibleSerialTrainer", "MemoryEfficientTrainer",
    "blocks_to_layers", "extract_reversible_blocks", "init_reversible_blocks",
    "for_n_devices", "on_accelerator", "on_cpu", "per_device_rngs", "replicate",
    "reshape_by_device", "unreplicate",
]
