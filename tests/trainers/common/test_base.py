"""Tests for revtrain.trainers.common.base: input checks shared by every trainer."""
import tracemalloc

import jax
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
from tests.trainers.conftest import adam, deep_blocks, initialised_blocks, signature
from tests.tree_utils import assert_trees_close

KINDS = ["plain", "reversible", "memory_efficient"]


def _trainer(kind, batch, n_devices=2, blocks_and_loss=None):
    blocks, loss = blocks_and_loss or initialised_blocks("one", batch)
    if kind in ("plain", "plain_unrolled"):
        return Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), adam, n_devices=n_devices,
                       scan_layers=kind == "plain")
    make = ReversibleSerialTrainer if kind == "reversible" else MemoryEfficientTrainer
    return make(blocks, loss, adam, n_devices=n_devices)


@pytest.mark.parametrize("kind", ["plain", "reversible"])
def test_empty_batch_is_a_clear_error_and_weights_are_unchanged(kind, batch):
    trainer = _trainer(kind, batch)
    trainer.one_step(batch, jax.random.key(0))
    before = trainer.weights
    empty = tuple(b[:0] for b in batch)
    with pytest.raises(ValueError, match=r"batch size 0"):
        trainer.one_step(empty, jax.random.key(1))
    assert_trees_close(trainer.weights, before, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["plain", "reversible"])
def test_setting_a_wrong_empty_state_is_rejected_and_leaves_the_trainer_usable(kind, batch):
    trainer = _trainer(kind, batch, n_devices=1)
    values = trainer.train_state
    with pytest.raises(ValueError, match=r"state structure mismatch"):
        trainer.restore(values._replace(state=()))
    assert_trees_close(trainer.train_state, values, rtol=0, atol=0)
    assert np.isfinite(float(trainer.one_step(batch, jax.random.key(0))[0]))


@pytest.mark.parametrize("kind", ["reversible", "memory_efficient"])
def test_non_scalar_loss_is_rejected(kind, batch):
    blocks, _ = initialised_blocks("one", batch)
    per_example = tl.Serial(tl.Concatenate(), tl.Dense(1), tl.Mean(axis=(1, 2)),
                            tl.Select([0], n_in=3))
    tl.init_reversible_blocks(blocks, per_example, signature(batch), jax.random.key(0))
    trainer = _trainer(kind, batch, n_devices=1, blocks_and_loss=(blocks, per_example))
    with pytest.raises(ValueError, match=r"scalar"):
        trainer.one_step(batch, jax.random.key(0))


@pytest.mark.parametrize("kind", KINDS)
def test_int_seed_as_rng_is_a_clear_error(kind, batch):
    trainer = _trainer(kind, batch, n_devices=1)
    with pytest.raises((TypeError, ValueError), match=r"rng=0.*jax\.random\.key"):
        trainer.one_step(batch, 0)


def test_string_learning_rate_is_a_clear_error(batch):
    trainer = _trainer("reversible", batch, n_devices=1)
    with pytest.raises((TypeError, ValueError), match=r"learning_rate='0\.1'"):
        trainer.one_step(batch, jax.random.key(0), learning_rate="0.1")


@pytest.mark.parametrize("kind", ["plain", "reversible"])
def test_batch_items_of_different_batch_sizes_are_rejected(kind, batch):
    trainer = _trainer(kind, batch)
    inputs, targets, _ = batch
    mismatched = (inputs, targets, np.ones((2, inputs.shape[1]), np.float32))
    with pytest.raises(ValueError, match=r"batch size"):
        trainer.one_step(mismatched, jax.random.key(0))


def test_block_list_using_one_layer_with_weights_twice_is_rejected(batch):
    d = 8
    embed = tl.Serial(tl.Embedding(16, d), tl.Dup())
    shared = tl.ReversibleHalfResidual(tl.Dense(d))
    loss = tl.Serial(tl.Concatenate(), tl.Dense(16), tl.LogSoftmax(), tl.CrossEntropyLoss())
    x = jax.ShapeDtypeStruct(batch[0].shape + (d,), np.float32)
    embed.init(signature(batch)[0])
    shared.init((x, x))
    loss.init((x, x) + signature(batch)[1:])
    with pytest.raises(ValueError, match=r"used more than once"):
        ReversibleSerialTrainer([(embed, [shared, tl.ReversibleSwap(), shared])], loss, adam,
                                n_devices=1)


def test_reversible_trainer_frees_activations_but_not_the_callers_batch(batch):
    import gc
    blocks, loss = initialised_blocks("one", batch)
    trainer = ReversibleSerialTrainer(blocks, loss, adam, n_devices=2,
                                      free_accelerators_on_step=True)
    user_batch = tuple(jax.numpy.asarray(b) for b in batch)
    gc.collect()
    before = {id(a) for a in jax.live_arrays()}
    trainer.one_step(user_batch, jax.random.key(0))
    gc.collect()
    assert not any(b.is_deleted() for b in user_batch)
    activation_shape = (2, batch[0].shape[0] // 2) + batch[0].shape[1:] + (8,)
    new = [a for a in jax.live_arrays() if id(a) not in before]
    assert not [a for a in new if a.shape == activation_shape]


@pytest.mark.parametrize("kind", KINDS)
def test_a_learning_rate_schedule_inside_the_optimizer_trains_and_refuses_overrides(kind,
                                                                                   batch):
    scheduled = lambda: optax.inject_hyperparams(optax.sgd)(
        learning_rate=optax.linear_schedule(0.5, 0.0, 10))
    blocks, loss = initialised_blocks("one", batch)
    if kind == "plain":
        trainer = Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), scheduled, 1)
    else:
        make = ReversibleSerialTrainer if kind == "reversible" else MemoryEfficientTrainer
        trainer = make(blocks, loss, scheduled, n_devices=1)
    assert trainer.learning_rate == pytest.approx(0.5)
    losses = [float(trainer.one_step(batch, jax.random.key(s))[0]) for s in range(2)]
    assert all(np.isfinite(losses))
    with pytest.raises(ValueError, match=r"no injectable learning rate .*schedule"):
        trainer.one_step(batch, jax.random.key(2), learning_rate=0.1)


@pytest.mark.parametrize("rate", [np.float32(3e-3), jax.numpy.float32(3e-3), np.array(3e-3)])
def test_numpy_and_jax_scalar_learning_rates_are_accepted(rate, batch):
    trainer = _trainer("reversible", batch, n_devices=1)
    _, stats = trainer.one_step(batch, jax.random.key(0), learning_rate=rate)
    assert float(stats["learning_rate"]) == pytest.approx(3e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_restore_takes_lists_for_tuples_and_never_aliases_the_callers_arrays(kind, batch):
    trainer = _trainer(kind, batch)
    values = jax.tree.map(np.array, trainer.train_state)  # writable host copies
    # What orbax gives back without a target tree: lists where the trainer has tuples.
    as_lists = type(values)(*(list(part) if type(part) is tuple else part
                              for part in values))
    trainer.restore(as_lists)
    for leaf in jax.tree.leaves(values.weights):
        leaf += 100.0  # The caller changes its arrays after restoring from them.
    assert_trees_close(trainer.train_state.weights,
                       jax.tree.map(lambda a: a - 100.0, values.weights), rtol=0, atol=1e-4)
    assert np.isfinite(float(trainer.one_step(batch, jax.random.key(0))[0]))


@pytest.mark.parametrize("kind", [*KINDS, "plain_unrolled"])
def test_restoring_saved_values_a_later_step_donated_is_a_clear_error(kind, batch):
    # One device: with several, restoring the deleted arrays crashed the CPU runtime.
    trainer = _trainer(kind, batch, n_devices=1)
    trainer.one_step(batch, jax.random.key(0))
    saved = type(trainer.train_state)(*(trainer.saved_values(p)
                                        for p in ("weights", "state", "slots")))
    trainer.one_step(batch, jax.random.key(1))
    donated = any(isinstance(a, jax.Array) and a.is_deleted() for a in jax.tree.leaves(saved))
    # The memory-efficient trainer keeps host copies, and `Trainer` with stacked runs
    # hands out per-layer copies of them: none donated.
    assert donated == (kind not in ("memory_efficient", "plain"))
    if not donated:
        trainer.restore(saved)
    else:
        with pytest.raises(ValueError, match=r"restore: weights\[0\].* is a deleted jax.Array"):
            trainer.restore(saved)
    assert np.isfinite(float(trainer.one_step(batch, jax.random.key(2))[0]))


_FAILED_STEP_SCRIPT = """
import sys
import tracemalloc

import jax
import numpy as np
from revtrain import layers as tl
from tests.trainers.conftest import initialised_blocks, make_batch, signature
from tests.trainers.common.test_base import _trainer

failing = {"on": False}

def check(x):
    if failing["on"]:
        raise RuntimeError("simulated device failure")
    return x

@jax.custom_vjp
def fragile(x):  # Its backward pass fails at run time, on the device, when asked to.
    return x

def backward(_, g):
    return (g + jax.pure_callback(check, jax.ShapeDtypeStruct((), g.dtype), g.dtype.type(0)),)

fragile.defvjp(lambda x: (x, None), backward)
batch = make_batch()
for kind in ("plain", "reversible", "memory_efficient"):
    blocks, loss = initialised_blocks("one", batch)
    head = tl.Serial(tl.Fn("fragile", fragile), *loss.sublayers)
    tl.init_reversible_blocks(blocks, head, signature(batch), jax.random.key(0))
    # One device: with several, the others would wait for the failed one in an all-reduce.
    trainer = _trainer(kind, batch, n_devices=1, blocks_and_loss=(blocks, head))
    good = jax.tree.map(np.array, trainer.train_state)
    failing["on"] = True
    try:
        jax.block_until_ready(trainer.one_step(batch, jax.random.key(0)))
        trainer.train_state
        print(kind, "no error")
    except Exception as e:
        print(kind, "failed:", "simulated device failure" in str(e))
    failing["on"] = False
    trainer.restore(good)
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trainer.train_state),
                                                   jax.tree.leaves(good)))
    value = float(trainer.one_step(batch, jax.random.key(1))[0])
    print(kind, "restored:", same, "next step finite:", bool(np.isfinite(value)), flush=True)
"""


def test_restore_recovers_a_trainer_after_a_step_failed_on_the_device():
    # In a fresh process: a failed host callback leaves JAX's runtime token in error, which
    # JAX reports again at interpreter exit.
    import os
    import subprocess
    import sys

    from tests.subprocesses import ROOT as root
    out = subprocess.run([sys.executable, "-c", _FAILED_STEP_SCRIPT], cwd=root,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu")).stdout
    for kind in KINDS:
        assert f"{kind} failed: True" in out, out
        assert f"{kind} restored: True next step finite: True" in out, out


@pytest.mark.parametrize("kind", KINDS)
def test_block_until_ready_waits_for_every_value_without_host_copies(kind, batch):
    d = 512  # A layer's weights (1 MiB) dwarf the call's Python objects.
    trainer = _trainer(kind, batch, n_devices=1, blocks_and_loss=deep_blocks(4, d, batch))
    trainer.one_step(batch, jax.random.key(0))
    trainer.block_until_ready()
    trainer.one_step(batch, jax.random.key(1))  # Dispatched; its last updates may still run.
    tracemalloc.start()  # Counts numpy's array buffers: a host copy of weights would show.
    try:
        trainer.block_until_ready()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert all(a.is_ready() for a in jax.live_arrays())
    assert peak < (d * d + d) * 4, f"{peak} bytes of host arrays while waiting"
