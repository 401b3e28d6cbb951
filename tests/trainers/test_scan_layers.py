"""`Trainer(scan_layers=True)`: runs of equal layers held stacked, one copy per run in the step.

The scanned trainer computes what the unrolled one (``scan_layers=False``) computes:
losses, weights and slots *bitwise* on 1 and 2 devices and with FSDP for element-wise
optimizers (the same float operations per element, only batched over a repetition axis);
the ``gradients_l2``/``weights_l2`` stats and global-norm clipping to float rounding (the
sum of squares over all leaves is grouped differently); its public values and
checkpoints are the unrolled trainer's tree; and its compiled step does not grow with depth.
"""
import jax
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain.trainers import Trainer
from tests.trainers.conftest import adam, deep_blocks, make_batch, stepped_stats
from tests.tree_utils import assert_trees_close


def _model(n_layers, d, batch):
    blocks, loss = deep_blocks(n_layers, d, batch)
    return tl.Serial(tl.blocks_to_layers(blocks, loss))


def _pair(batch, n_layers=8, d=8, optimizer_fn=adam, **kwargs):
    return [Trainer(_model(n_layers, d, batch), optimizer_fn, scan_layers=scan, **kwargs)
            for scan in (True, False)]


def _assert_same_stats(a, b):
    """Losses and rates bitwise; the norms (a sum over all leaves, grouped differently) to
    float rounding."""
    for x, y in zip(a, b, strict=True):
        assert (x["loss"], x["learning_rate"]) == (y["loss"], y["learning_rate"])
        assert x == pytest.approx(y, rel=1e-6)


def _assert_bitwise(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class _StepSize:
    """Observer: the HLO size of the step program, lowered for the arguments it gets."""

    def __init__(self):
        self.chars = None

    def on_dispatch(self, label, fn, args):
        if label == "train_step" and self.chars is None:
            self.chars = len(fn.lower(*args).as_text())


def _step_size(trainer, batch):
    observer = _StepSize()
    trainer.observers.append(observer)
    trainer.one_step(batch, jax.random.key(1))
    return observer.chars


@pytest.mark.parametrize("placement", [dict(n_devices=1), dict(n_devices=2),
                                       dict(n_devices=2, fsdp=True)])
def test_scanned_steps_equal_the_unrolled_ones_bitwise(placement):
    batch = make_batch()
    scanned, unrolled = _pair(batch, d=32, **placement)  # d=32: FSDP shards 32x32 kernels.
    _assert_same_stats(stepped_stats(scanned, batch), stepped_stats(unrolled, batch))
    _assert_bitwise(scanned.train_state, unrolled.train_state)


def test_the_step_program_does_not_grow_with_depth():
    batch = make_batch()
    sizes = {(depth, scan): _step_size(Trainer(_model(depth, 8, batch), adam,
                                               scan_layers=scan), batch)
             for depth in (4, 16) for scan in (True, False)}
    assert sizes[16, True] < 1.1 * sizes[4, True]
    assert sizes[16, False] > 1.5 * sizes[4, False]  # Per-layer optimizer leaves did grow.


def test_checkpoints_are_interchangeable_between_scanned_and_unrolled_trainers():
    batch = make_batch()
    scanned, unrolled = _pair(batch)
    unrolled.one_step(batch, jax.random.key(1))
    for part in ("weights", "slots"):
        assert (jax.tree.structure(scanned.value_signature(part))
                == jax.tree.structure(unrolled.value_signature(part)))
        assert (jax.tree.structure(scanned.saved_values(part))
                == jax.tree.structure(scanned.value_signature(part)))
        assert (jax.tree.structure(scanned.value_shardings(part))
                == jax.tree.structure(unrolled.value_shardings(part)))
    scanned.restore(unrolled.train_state)  # An unrolled run's checkpoint, resumed scanned.
    _assert_bitwise(scanned.train_state, unrolled.train_state)
    _assert_same_stats(stepped_stats(scanned, batch), stepped_stats(unrolled, batch))
    _assert_bitwise(scanned.train_state, unrolled.train_state)
    unrolled.restore(scanned.train_state)  # And back.
    _assert_bitwise(scanned.train_state, unrolled.train_state)


def test_scanned_step_does_not_recompile():
    batch = make_batch()
    scanned, _ = _pair(batch)
    stepped_stats(scanned, batch)
    assert scanned.trace_counts() == {"train_step": 1}


@pytest.mark.parametrize("optimizer", ["lamb", "lars"])
def test_optimizers_with_per_leaf_norms_keep_their_per_layer_meaning(optimizer):
    batch = make_batch()
    scanned, unrolled = _pair(batch, optimizer_fn=lambda: optax.inject_hyperparams(
        getattr(optax, optimizer))(learning_rate=1e-2))
    assert stepped_stats(scanned, batch) == stepped_stats(unrolled, batch)
    _assert_bitwise(scanned.train_state, unrolled.train_state)


def test_global_norm_clipping_agrees_to_rounding():
    batch = make_batch()

    def clipped():
        return optax.inject_hyperparams(lambda learning_rate: optax.chain(
            optax.clip_by_global_norm(1e-2), optax.adam(learning_rate)))(learning_rate=1e-2)
    scanned, unrolled = _pair(batch, optimizer_fn=clipped)
    for a, b in zip(stepped_stats(scanned, batch), stepped_stats(unrolled, batch), strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert_trees_close(scanned.train_state.weights, unrolled.train_state.weights,
                       rtol=1e-6, atol=1e-7)


def _dense_serial(n_layers):
    model = tl.Serial(*[tl.Dense(2) for _ in range(n_layers)], tl.LogSoftmax(),
                      tl.CrossEntropyLoss())
    rs = np.random.RandomState(0)
    batch = (rs.randn(8, 2).astype(np.float32), rs.randint(0, 2, (8,)).astype(np.int32),
             np.ones((8,), np.float32))
    model.init(tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in batch),
               jax.random.key(0))
    return model, batch


def test_a_plain_serial_of_800_dense_layers_is_one_run():
    """google/trax#1697: 2,000 layers never finished step 1 there."""
    sizes = {}
    for n_layers in (100, 800):
        model, batch = _dense_serial(n_layers)
        trainer = Trainer(model, lambda: optax.sgd(1e-3), n_devices=1)
        sizes[n_layers] = _step_size(trainer, batch)
        loss, _ = trainer.one_step(batch, jax.random.key(2))
        assert np.isfinite(float(loss))
    assert sizes[800] < 1.1 * sizes[100]


def _remat_every_second(n_layers, batch):
    """``deep_blocks`` with every second half-residual under `Remat`: a run of groups of
    four layers (``Remat(half-residual), swap, half-residual, swap``)."""
    blocks, loss = deep_blocks(n_layers, 8, batch)
    flat = tl.blocks_to_layers(blocks, loss)
    half_residuals = [i for i, layer in enumerate(flat)
                      if isinstance(layer, tl.ReversibleHalfResidual)]
    return tl.Serial([tl.Remat(layer) if i in half_residuals[::2] else layer
                      for i, layer in enumerate(flat)])


def test_remat_every_second_layer_scans_over_groups_and_equals_the_unrolled_step():
    batch = make_batch()
    scanned, unrolled = (Trainer(_remat_every_second(8, batch), adam, scan_layers=scan)
                         for scan in (True, False))
    _assert_same_stats(stepped_stats(scanned, batch), stepped_stats(unrolled, batch))
    _assert_bitwise(scanned.train_state, unrolled.train_state)
    sizes = [_step_size(Trainer(_remat_every_second(depth, batch), adam), batch)
             for depth in (8, 32)]
    assert sizes[1] < 1.1 * sizes[0]


def _lm(n_layers, batch):
    from revtrain.models import ReversibleTransformerLM
    model = tl.Serial(ReversibleTransformerLM(vocab_size=16, d_model=8, d_ff=16,
                                              n_layers=n_layers, n_heads=2, max_len=8,
                                              mode="train"), tl.CrossEntropyLoss())
    model.init(tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in batch), jax.random.key(0))
    return model


def test_a_nested_lm_with_its_fused_head_is_stacked_inside():
    """The fused head is inside the LM's `Serial`: only its layers stay per layer."""
    batch = make_batch()
    scanned, unrolled = (Trainer(_lm(2, batch), adam, scan_layers=scan) for scan in (True, False))
    _assert_same_stats(stepped_stats(scanned, batch), stepped_stats(unrolled, batch))
    _assert_bitwise(scanned.train_state, unrolled.train_state)
    sizes = [_step_size(Trainer(_lm(depth, batch), adam), batch) for depth in (2, 8)]
    assert sizes[1] < 1.1 * sizes[0]
