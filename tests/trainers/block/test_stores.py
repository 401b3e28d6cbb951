"""Tests for revtrain.trainers.block.device_store and host_store through the trainers' public
API: where values live."""
import jax
import numpy as np
import pytest

from revtrain import layers as tl
from revtrain.trainers import (
    MemoryEfficientTrainer,
    ReversibleSerialTrainer,
    Trainer,
)
from tests.trainers.conftest import adam, initialised_blocks


def _model_bytes(trainer):
    values = trainer.train_state
    return (sum(a.nbytes for a in jax.tree.leaves(values.weights)),
            sum(a.nbytes for a in jax.tree.leaves(values.slots)))


def test_device_store_holds_every_layer_on_the_device(batch):
    trainer = ReversibleSerialTrainer(*initialised_blocks("one", batch), adam, n_devices=2)
    trainer.one_step(batch, jax.random.key(0))
    weights, slots = _model_bytes(trainer)
    footprint = trainer.device_footprint()
    assert (footprint.weights_bytes, footprint.slots_bytes) == (weights, slots)
    assert footprint.total_bytes == weights + slots
    assert footprint.resident_layers == sum(
        1 for w in trainer.train_state.weights if jax.tree.leaves(w))


def test_plain_trainer_footprint_is_the_whole_model(batch):
    from revtrain import layers as tl
    blocks, loss = initialised_blocks("one", batch)
    trainer = Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), adam, n_devices=2)
    weights, slots = _model_bytes(trainer)
    assert trainer.device_footprint()[:2] == (weights, slots)


@pytest.mark.parametrize("free", [True, False])
def test_host_store_keeps_at_most_the_window_on_the_device(free, batch):
    trainer = MemoryEfficientTrainer(*initialised_blocks("one", batch), adam, n_devices=2,
                                     n_async_layers=1, free_accelerators_on_step=free)
    footprints = []

    class Watch:
        def on_dispatch(self, label, fn, args):
            footprints.append(trainer.device_footprint())

    trainer.observers.append(Watch())
    trainer.one_step(batch, jax.random.key(0))
    weights, slots = _model_bytes(trainer)
    assert max(f.resident_layers for f in footprints) <= 2 + 1  # window + one copy-back
    assert max(f.total_bytes for f in footprints) < weights + slots
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(trainer.train_state))
    if free:
        assert trainer.device_footprint() == (0, 0, 0, 0)


def test_observers_see_every_dispatch_and_the_phases(batch):
    trainer = ReversibleSerialTrainer(*initialised_blocks("two", batch), adam, n_devices=1,
                                      scan_layers=False)  # One program per layer and op.
    seen = []

    class Record:
        def on_dispatch(self, label, fn, args):
            seen.append(label)

        def on_phase(self, label):
            seen.append(label)

    trainer.observers.append(Record())
    trainer.one_step(batch, jax.random.key(0))
    n = len(trainer.layers)
    swaps = [i for i, layer in enumerate(trainer.layers)
             if isinstance(layer, tl.ReversibleSwap)]
    forward = [f"forward/layer{i}" for i in range(n - 1) if i not in swaps]
    # The second block's standard layer (``Parallel(Dense, None)``) donates its two input
    # items, which its block's stash still holds: each is copied first, by a dispatch.
    second = forward.index("forward/layer9")
    forward[second:second] = ["copy/forward/layer9"] * 2
    assert swaps and seen[0] == "step_start" and seen[-1] == "step_end"
    # Every forward but the swaps' (which only reorder the stack, on the host) dispatches.
    assert seen[1:seen.index("loss_start")] == forward
    m = len(forward) + 1
    assert seen[m + 1] == f"loss/layer{n - 1}" and seen[m + 2] == "backward_start"
    assert sum(label.startswith("backward/") for label in seen) == n - 1
