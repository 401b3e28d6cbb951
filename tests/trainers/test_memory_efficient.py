"""MemoryEfficientTrainer: same results as Trainer, weights in host memory between steps."""
import gc
import re
import tracemalloc

import jax
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain import memory
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
from tests.trainers.conftest import (
    adam,
    deep_blocks,
    flat_weights,
    initialised_blocks,
    make_batch,
    run_steps,
    stepped_stats,
)
from tests.tree_utils import assert_trees_close


def _weight_buffers(trainer):
    values = trainer.train_state
    leaves = jax.tree.leaves((values.weights, values.slots))
    return {(leaf.shape, leaf.dtype) for leaf in leaves if leaf.size > 1}


@pytest.mark.parametrize("kind,n_devices", [("one", 1), ("one", 2), ("empty", 2)])
def test_matches_trainer(kind, n_devices, batch):
    blocks, loss = initialised_blocks(kind, batch)
    w0 = flat_weights(blocks, loss)
    met = MemoryEfficientTrainer(blocks, loss, adam, n_devices=n_devices)
    blocks2, loss2 = initialised_blocks(kind, batch, weights=w0, seed=1)
    plain = Trainer(tl.Serial(tl.blocks_to_layers(blocks2, loss2)), adam, n_devices=n_devices)
    np.testing.assert_allclose(run_steps(met, batch), run_steps(plain, batch), rtol=1e-5)
    assert_trees_close(met.weights, plain.weights, rtol=1e-5, atol=1e-5)
    assert_trees_close(flat_weights(blocks, loss), flat_weights(blocks2, loss2),
                       rtol=1e-5, atol=1e-5)


def test_matches_reversible_serial_trainer_exactly(batch):
    blocks, loss = initialised_blocks("two", batch)
    w0 = flat_weights(blocks, loss)
    met = MemoryEfficientTrainer(blocks, loss, adam, n_devices=2, n_async_layers=2)
    # Bitwise: the same per-layer programs (a scanned run is fused differently by XLA, so
    # it agrees to rounding; tests/trainers/block/test_scan_programs.py checks that).
    rev = ReversibleSerialTrainer(*initialised_blocks("two", batch, weights=w0), adam, 2,
                                  scan_layers=False)
    np.testing.assert_array_equal(run_steps(met, batch), run_steps(rev, batch))
    assert_trees_close(met.weights, rev.weights, rtol=0, atol=0)
    assert_trees_close(met.slots, rev.slots, rtol=0, atol=0)


def test_weights_and_slots_live_in_host_memory_between_steps(batch):
    blocks, loss = initialised_blocks("one", batch)
    # Layers hold numpy weights, so no device array of these shapes is the caller's.
    tl.Serial(tl.blocks_to_layers(blocks, loss)).weights = flat_weights(blocks, loss)
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}
    met = MemoryEfficientTrainer(blocks, loss, adam, n_devices=2)
    for step in range(2):
        _, stats = met.one_step(batch, jax.random.key(step))
        # Dispatch is asynchronous: wait for all of the step's work (its programs hold
        # their inputs, e.g. rng slices and per-device stats, until they finish; on a
        # loaded machine the last layer's stats can be ready before the rest is).
        jax.block_until_ready(stats)
        met.block_until_ready()
        gc.collect()
        assert met.device_footprint() == (0, 0, 0, 0)
        assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(met.train_state))
        shapes = _weight_buffers(met)
        new = [a for a in jax.live_arrays() if id(a) not in before]
        on_device = {(a.shape, a.dtype) for a in new if a.size > 1}
        assert not shapes & on_device, f"weights or slots left on device: {shapes & on_device}"
        # Only the returned loss and stats remain: scalars and the [n_layers] vectors.
        per_layer = (len(met.layers),)
        assert all(a.size == 1 or a.shape == per_layer for a in new), [
            (a.shape, a.dtype) for a in new if a.size > 1 and a.shape != per_layer]


@pytest.mark.parametrize("n_async_layers", [0, 1, 3])
def test_at_most_one_plus_n_async_layers_on_device(n_async_layers, batch):
    blocks, loss = initialised_blocks("one", batch)
    met = MemoryEfficientTrainer(blocks, loss, adam, n_devices=1,
                                 n_async_layers=n_async_layers)
    met.one_step(batch, jax.random.key(0))
    assert met.max_resident_layers == min(1 + n_async_layers, len(met.layers))
    # Between steps (free_accelerators_on_step) no weights or slots stay on the device.
    assert met.device_footprint() == (0, 0, 0, 0)


def test_logs_host_rss_and_device_bytes(batch):
    blocks, loss = initialised_blocks("one", batch)
    met = MemoryEfficientTrainer(blocks, loss, adam, n_devices=1, n_steps_per_log=2)
    met.one_step(batch, jax.random.key(0))
    phases = [r["phase"] for r in met.memory_log]
    assert phases == ["forward_start", "loss_start", "backward_start", "backward_end"]
    assert all(r["host_rss_bytes"] > 0 and r["accelerator_bytes_in_use"] > 0
               for r in met.memory_log)
    met.one_step(batch, jax.random.key(1))  # step 1: not logged
    assert met.memory_log[0]["step"] == 0


def test_deep_model_trains_with_device_memory_near_one_layer():
    batch = make_batch(batch_size=4)
    d = 128
    blocks, loss = deep_blocks(24, d, batch)
    slow_adam = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-4)
    met = MemoryEfficientTrainer(blocks, loss, slow_adam, n_devices=1, n_async_layers=1)
    layer_bytes = 3 * (d * d + d) * 4  # weights + two Adam slots of one Dense(d)
    values = met.train_state
    total_bytes = sum(a.nbytes for a in jax.tree.leaves((values.weights, values.slots)))
    limit = total_bytes // 4
    assert total_bytes > 12 * layer_bytes
    losses = []
    with memory.track_peak(met) as report:
        for step in range(3):
            loss_value, _ = met.one_step(batch, jax.random.key(step))
            losses.append(float(loss_value))
    # The ledger counts every live device array; what was live before the block is not ours.
    peak = report.peak_bytes - report.baseline_bytes
    print(f"weights+slots {memory.format_bytes(total_bytes)}, trainer's device peak "
          f"{memory.format_bytes(peak)} ({report.method}), one layer "
          f"{memory.format_bytes(layer_bytes)}")
    assert report.method == "ledger"
    assert peak < limit
    assert peak < (2 + met.n_async_layers) * layer_bytes
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("free,scan_window", [(True, None), (False, None), (True, 2)])
def test_a_step_makes_no_host_copies_of_weights_or_slots(free, scan_window, batch):
    # The host buffers are updated in place; on the CPU backend a device array can share
    # their memory, so a step needs no host (numpy) array of a layer's size at all (a
    # scanned window's stacked buffers included).
    d = 512  # A layer's buffers (1 MiB) dwarf the step's Python objects (~0.2 MiB).
    met = MemoryEfficientTrainer(*deep_blocks(4, d, batch), adam, n_devices=1,
                                 free_accelerators_on_step=free, scan_window=scan_window)
    scans = [name for name in met.trace_counts() if re.search(r"x\d+x\d+#", name)]
    assert bool(scans) == bool(scan_window)
    dense_bytes = (d * d + d) * 4  # the weights alone of one of its Dense(d) layers
    met.one_step(batch, jax.random.key(0))
    before = met.train_state
    tracemalloc.start()  # Counts numpy's array buffers.
    try:
        for step in range(1, 3):
            met.one_step(batch, jax.random.key(step))
            met.block_until_ready()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < dense_bytes, f"{peak} bytes of host arrays at once in a step"
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), met.train_state, before)
    assert all(jax.tree.leaves(changed.weights)), "every layer with weights is updated"


# Scanned windows: a run of 5 repetitions (deep_blocks(10): half-residual + swap, period 2)
# in windows of 2 is two windows and one repetition run layer by layer.
WINDOW_CASES = {"one_device": (1, {}),
                "fsdp_kept_clipped": (2, {"fsdp": True, "keep_every": 3,
                                          "clip_global_norm": 0.5})}


def _counted(trainer):
    seen = []

    class Watch:
        def on_dispatch(self, label, fn, args):
            seen.append(label)
    trainer.observers.append(Watch())
    return seen


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_scan_windows_give_what_one_program_per_layer_gives(case, batch):
    """Windows of ``scan_window`` repetitions: the per-layer trainer's losses, stats,
    weights and slots (dropout-free layers, Adam with an injected rate; FSDP shards, kept
    copies and the norm-only scan in the second case), and those of
    `ReversibleSerialTrainer` scanning the whole run; fewer programs per step, each
    compiled once."""
    n_devices, kwargs = WINDOW_CASES[case]
    w0 = flat_weights(*deep_blocks(10, 32, batch))
    made = {}
    for name, cls, extra in (("windows", MemoryEfficientTrainer, {"scan_window": 2}),
                             ("per_layer", MemoryEfficientTrainer, {}),
                             ("scanned", ReversibleSerialTrainer, {})):
        blocks, loss = deep_blocks(10, 32, batch)
        tl.Serial(tl.blocks_to_layers(blocks, loss)).weights = w0
        made[name] = cls(blocks, loss, adam, n_devices=n_devices, **kwargs, **extra)
    seen = {name: _counted(t) for name, t in made.items()}
    stats = {name: stepped_stats(t, batch, steps=3) for name, t in made.items()}
    for other in ("per_layer", "scanned"):
        for got, want in zip(stats["windows"], stats[other], strict=True):
            assert got.keys() == want.keys()
            np.testing.assert_allclose([got[k] for k in want], list(want.values()),
                                       rtol=1e-5, atol=1e-6)
        assert_trees_close(made["windows"].train_state, made[other].train_state,
                           rtol=1e-5, atol=1e-6)
    counts = made["windows"].trace_counts()
    assert set(counts.values()) == {1}
    clipped = "clip_global_norm" in kwargs
    assert {name.split("#")[0] for name in counts if "x2x2" in name} == {
        f"{prefix}{kind}/ReversibleHalfResidualx2x2" for kind in ("forward", "backward")
        for prefix in ("", "norm_") if prefix == "" or kind == "backward" and clipped}
    # Per layer: 6 forward (swaps dispatch nothing), then the loss and 11 backward ops
    # (twice with clipping); windows: the 2 windows' scans instead of 8 layers' ops.
    per_step = {name: len(labels) // 3 for name, labels in seen.items()}
    assert (per_step["per_layer"], per_step["windows"]) == ((30, 16) if clipped else (18, 10))
    assert "forward/layers1-4" in seen["windows"] and "backward/layers5-8" in seen["windows"]


@pytest.mark.parametrize("n_async_layers", [0, 1])
def test_scan_windows_bound_what_is_on_the_devices(n_async_layers, batch):
    """At most ``1 + n_async_layers`` ops' values on the devices, a window counting all
    its flat layers; nothing between steps; values live in host memory."""
    met = MemoryEfficientTrainer(*deep_blocks(10, 32, batch), adam, n_devices=1,
                                 n_async_layers=n_async_layers, scan_window=2)
    met.one_step(batch, jax.random.key(0))
    window = 2 * 2  # Repetitions x period, in flat layers.
    assert met.max_resident_layers == (window if n_async_layers == 0 else 2 * window)
    assert met.device_footprint() == (0, 0, 0, 0)
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(met.train_state))


def test_scan_window_values_restore_exactly_and_keep_one_entry_per_layer(batch):
    blocks, loss = deep_blocks(10, 32, batch)
    met = MemoryEfficientTrainer(blocks, loss, adam, n_devices=2, scan_window=2)
    per_layer = MemoryEfficientTrainer(*deep_blocks(10, 32, batch), adam, n_devices=2)
    assert jax.tree.structure(met.train_state) == jax.tree.structure(per_layer.train_state)
    run_steps(met, batch, steps=2)
    saved = met.train_state
    untouched = jax.tree.map(np.copy, saved)
    other = MemoryEfficientTrainer(*deep_blocks(10, 32, batch), adam, n_devices=2,
                                   scan_window=2)
    per_layer.restore(saved)
    other.restore(saved)
    for a, b in zip(jax.tree.leaves(other.train_state), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)
    losses = [float(t.one_step(batch, jax.random.key(9))[0]) for t in (other, met, per_layer)]
    assert losses[0] == losses[1] == pytest.approx(losses[2], rel=1e-5)
    # The restored values are the stores' own buffers: stepping writes none of the caller's.
    assert_trees_close(saved, untouched, rtol=0, atol=0)
    met.sync_to()
    assert_trees_close(flat_weights(blocks, loss), met.train_state.weights, 0, 0)


@pytest.mark.parametrize("scan_window,error", [(1, ValueError), (0, ValueError),
                                               (True, TypeError), (2.0, TypeError)])
def test_scan_window_is_checked_before_anything_is_put(scan_window, error, batch):
    blocks, loss = deep_blocks(4, 8, batch)
    with pytest.raises(error, match="scan_window"):
        MemoryEfficientTrainer(blocks, loss, adam, n_devices=1, scan_window=scan_window)


def test_a_window_with_dropout_trains_what_the_per_layer_trainer_trains(batch):
    """Dropout inside a scanned window: each layer's mask comes from its own key, so the
    windowed trainer reconstructs and updates as the per-layer one does (2 devices)."""
    w0 = flat_weights(*initialised_blocks("one", batch))
    made = [MemoryEfficientTrainer(*initialised_blocks("one", batch, w0), adam, n_devices=2,
                                   **extra) for extra in ({"scan_window": 2}, {})]
    assert any(name.startswith("backward/") and "x2#" in name
               for name in made[0].trace_counts())
    got, want = (stepped_stats(t, batch, steps=2) for t in made)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose([a[k] for k in b], list(b.values()), rtol=1e-5, atol=1e-6)
    assert_trees_close(made[0].train_state, made[1].train_state, rtol=1e-5, atol=1e-6)
