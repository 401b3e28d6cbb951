"""Tests for revtrain.trainers.block.scan_programs: a run of equal reversible layers as one forward
and one reverse-and-fbo scan, with the per-layer programs' results and public values."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain import layers as tl
from revtrain.trainers import ReversibleSerialTrainer, TrainState
from revtrain.trainers.block import scan_programs
from revtrain.trainers.block.plan import Run
from revtrain.trainers.block.scan_programs import find_runs
from tests.trainers.conftest import (
    D,
    adam,
    deep_blocks,
    flat_weights,
    initialised_blocks,
    make_batch,
    signature,
    stepped_stats,
)
from tests.tree_utils import assert_trees_close

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


WIDE = 32  # Dense weights of 32 x 32: FSDP shards them (not the 8 x 8 ones).


def _pair(batch, n_devices, d_model=D, **kwargs):
    """A scanning trainer and a per-layer one on the same initial weights."""
    w0 = flat_weights(*initialised_blocks("one", batch, d_model=d_model))
    return [ReversibleSerialTrainer(*initialised_blocks("one", batch, w0, d_model=d_model),
                                    adam, n_devices=n_devices, scan_layers=scan, **kwargs)
            for scan in (True, False)]


CASES = {"one_device": (1, {}),
         "fsdp_kept": (2, {"fsdp": True, "keep_every": 2, "d_model": WIDE})}


@pytest.fixture(scope="module")
def stepped():
    """Per case of `CASES` (built once, on first use): the scanning and the per-layer
    trainer after the same two steps, and the stats of each step."""
    done = {}

    def get(case):
        if case not in done:
            n_devices, kwargs = CASES[case]
            pair = _pair(make_batch(), n_devices, **kwargs)
            done[case] = (*pair, *(stepped_stats(t, make_batch(), steps=2, first_key=7)
                                   for t in pair))
        return done[case]
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_scanned_runs_give_what_one_program_per_layer_gives(case, stepped):
    """Dropout, Adam with an injected rate, per-device keys, FSDP gathers, kept copies
    (``keep_every=2`` keeps some positions of the group always and one only in the second
    repetition): losses, every stat, weights and slots agree. The scans against `Trainer`,
    exact global-norm clipping (the norm-only scan) included: tests/trainers/
    test_reversible.py, test_block.py, test_fsdp_block.py and test_invariance.py, which
    scan by default."""
    scanned, per_layer, got, want = stepped(case)
    scan = re.compile(r"x\d+x\d+#")  # A scan's name: 'kind/layer x period x repeats#k'.
    assert any(name.startswith("backward/") and scan.search(name)
               for name in scanned.trace_counts())
    assert not any(scan.search(name) for name in per_layer.trace_counts())
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        np.testing.assert_allclose([g[k] for k in w], list(w.values()), rtol=1e-5, atol=1e-6)
    assert_trees_close(scanned.train_state, per_layer.train_state, rtol=1e-5, atol=1e-6)


def test_a_step_dispatches_the_same_programs_at_any_depth_and_compiles_once():
    batch = make_batch()
    labels = {}
    for n_layers in (4, 12):
        trainer = ReversibleSerialTrainer(*deep_blocks(n_layers, D, batch), adam, n_devices=1,
                                          scan_layers=True)
        seen = []

        class Watch:
            def on_dispatch(self, label, fn, args, seen=seen):
                seen.append(label)

        trainer.observers.append(Watch())
        trainer.one_step(batch, jax.random.key(0))
        counts = trainer.trace_counts()
        assert set(counts.values()) == {1}
        compiles = []
        listener = lambda event, duration, compiles=compiles, **kw: compiles.append(
            event) if event == BACKEND_COMPILE else None
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            for step in range(1, 3):
                trainer.one_step(make_batch(seed=step), jax.random.key(step))
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        assert compiles == [] and trainer.trace_counts() == counts
        labels[n_layers] = seen[:len(seen) // 3]
        assert seen == labels[n_layers] * 3
    assert labels[4] == ["forward/layer0", "forward/layers1-4", "loss/layer5",
                         "backward/layers1-4", "backward/layer0"]
    assert [label.split("/")[0] for label in labels[12]] == [
        label.split("/")[0] for label in labels[4]]


def test_values_keep_one_entry_per_flat_layer_and_restore_exactly(stepped, batch):
    """Checkpointed values (`saved_values`, `value_shardings`) have the per-layer layout of
    ``scan_layers=False``; restoring them into another scanning trainer gives back the
    same values bit for bit, and the next steps agree."""
    scanned, per_layer, _, _ = stepped("fsdp_kept")
    n_devices, kwargs = CASES["fsdp_kept"]
    kwargs = dict(kwargs)
    d_model = kwargs.pop("d_model")
    for part in TrainState._fields:
        assert (jax.tree.structure(scanned.saved_values(part))
                == jax.tree.structure(per_layer.saved_values(part)))
        assert scanned.value_shardings(part) == per_layer.value_shardings(part)
        assert_trees_close(scanned.saved_values(part), per_layer.saved_values(part))
    saved = TrainState(*(scanned.saved_values(part) for part in TrainState._fields))
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(saved.slots))
    other_blocks = initialised_blocks("one", batch, seed=5, d_model=d_model)
    other = ReversibleSerialTrainer(*other_blocks, adam, n_devices=n_devices, **kwargs)
    other.restore(saved)
    for a, b in zip(jax.tree.leaves(other.train_state), jax.tree.leaves(scanned.train_state),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    # All three step on (so the fixture's pair stays in step, whatever the test order).
    losses = [float(t.one_step(batch, jax.random.key(1))[0])
              for t in (other, scanned, per_layer)]
    assert losses[0] == losses[1] == pytest.approx(losses[2], rel=1e-5)
    other.sync_to()  # The layer objects get one entry each, as the trainer holds them.
    assert_trees_close(flat_weights(*other_blocks), other.train_state.weights, 0, 0)


def test_find_runs_takes_groups_of_equal_layers_repeated_within_a_block():
    def pair(rate):
        return [tl.ReversibleHalfResidual(tl.Dense(D), tl.Dropout(rate)), tl.ReversibleSwap()]

    # Three equal groups of two, then one with another dropout rate: one run of three.
    revs = pair(0.1) + pair(0.1) + pair(0.1) + pair(0.2)
    blocks = [(tl.Serial(tl.Embedding(16, D), tl.Dup()), revs),
              (tl.Serial(), pair(0.1) + pair(0.1))]
    loss = tl.Serial(tl.Concatenate(), tl.Dense(16), tl.LogSoftmax(), tl.CrossEntropyLoss())
    tl.init_reversible_blocks(blocks, loss, signature(make_batch()), jax.random.key(0))
    layers = tl.blocks_to_layers(blocks, loss)
    assert find_runs(layers, [8, 4]) == (Run(1, 2, 3, 2), Run(10, 2, 2, 2))
    assert find_runs(layers, [8, 4])[0].layers == range(1, 7)


def test_the_updating_reverse_scan_runs_in_its_carry_and_donates_nothing_held_elsewhere():
    """The reverse scan's outputs (reconstructed items, their cotangents, new params) all
    alias its donated inputs, so it adds no output buffers beside them; the donated buffers
    were nobody else's (a second step runs)."""
    from revtrain import memory

    batch = make_batch()
    trainer = ReversibleSerialTrainer(*deep_blocks(4, D, batch), adam, n_devices=1,
                                      scan_layers=True)
    calls = {}

    class Watch:
        def on_dispatch(self, label, fn, args):
            calls[label] = (fn, jax.tree.map(memory._abstract_leaf, tuple(args)))

    trainer.observers.append(Watch())
    trainer.one_step(batch, jax.random.key(0))
    trainer.one_step(batch, jax.random.key(1))  # The donated buffers were nobody else's.
    fn, args = calls["backward/layers1-4"]
    stats = fn.lower(*args).compile().memory_analysis()
    scan_args, params, _ = args
    donated = sum(x.size * x.dtype.itemsize
                  for x in jax.tree.leaves((scan_args.y, scan_args.ct_y, params)))
    assert stats.alias_size_in_bytes >= donated > 0


def test_traced_once_replays_its_trace_without_running_the_function_again():
    calls = []

    def body(c, t):
        calls.append(t)
        return jnp.sin(c) * t + 1.0, c.sum()

    carry, steps = jnp.arange(3.0), jnp.arange(4, dtype=jnp.int32)
    replay, out_shape = scan_programs.traced_once(body, carry, steps[0])
    assert len(calls) == 1
    assert jax.tree.map(lambda s: (s.shape, s.dtype), out_shape) == (
        ((3,), jnp.float32), ((), jnp.float32))
    replayed = jax.jit(lambda c: jax.lax.scan(replay, c, steps))(carry)
    assert len(calls) == 1
    direct = jax.jit(lambda c: jax.lax.scan(body, c, steps))(carry)
    jax.tree.map(np.testing.assert_array_equal, replayed, direct)
