"""revtrain.trainers.common: what all three trainers share, one floor below them.

- `protocols`: the vocabulary (`TrainState`, `DeviceFootprint`, `ResidentBytes`, `Params`)
  and the `Trainer` and `Observer` protocols;
- `base`: `TrainerBase`, optimizer set-up, batches, observers and the ownership of the
  training values;
- `dispatch`: how a trainer calls its programs and tells observers (`Dispatcher`,
  `LiveDispatcher`);
- `learning_rate`: where optax keeps the injected rate and how an override is checked;
- `updates`: one optimizer update, and clipping by a given global norm;
- `global_loss`: each device's share of the loss over the global batch;
- `structure`: checking a tree of training values against the one a trainer holds;
- `scanned_values`: `Trainer`'s weights and slots with each run of equal layers stacked in
  memory (the block trainers stack theirs in their stores), one entry per layer outside.

Nothing here imports `revtrain.trainers.block` or the trainers above it.
"""

from revtrain.trainers.common.base import TrainerBase
from revtrain.trainers.common.dispatch import Dispatcher, LiveDispatcher
from revtrain.trainers.common.protocols import (
    DeviceFootprint,
    Observer,
    Params,
    TrainState,
)

__all__ = ["DeviceFootprint", "Dispatcher", "LiveDispatcher", "Observer", "Params",
           "TrainState", "TrainerBase"]
