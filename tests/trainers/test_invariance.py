"""Data-parallel invariance: the device count must not change losses, gradients or weights.

For one global batch, model, rng and optimizer, every trainer gives the same losses, global
gradient norms and updated weights on 1, 2 and 4 devices (dropout off: each device draws its
own masks). Plain SGD is used because it shows a scaled gradient directly (Adam hides it),
global-norm clipping because the default configs clip, and masks whose non-zero counts
differ between devices (one device all padding) because the loss is the weighted mean over
the *global* batch, not the mean of per-device means.
"""
import jax
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from revtrain import layers as tl
from revtrain.models import ReversibleTransformerLM
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
from revtrain.training import optimizer_fn
from tests.tree_utils import assert_trees_close

VOCAB, LENGTH, BATCH = 16, 6, 8
DEVICE_COUNTS = (1, 2, 4)
TRAINERS = {"Trainer": Trainer, "ReversibleSerialTrainer": ReversibleSerialTrainer,
            "MemoryEfficientTrainer": MemoryEfficientTrainer}


def _batch(mask_kind: str, seed: int = 0):
    rs = np.random.RandomState(seed)
    tokens = rs.randint(0, VOCAB, (BATCH, LENGTH + 1)).astype(np.int32)
    mask = np.ones((BATCH, LENGTH), np.float32)
    if mask_kind == "uneven":
        # Rows 0-1 (device 0 of 4) keep 1 and 6 positions, rows 2-3 are full, rows 6-7
        # (device 3 of 4) are all padding: per-device totals 7, 12, 10, 0.
        mask[0, 1:] = 0
        mask[4, 2:] = 0
        mask[6:] = 0
    return tokens[:, :-1], tokens[:, 1:], mask


def _sgd():
    return optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)


def _clipped_sgd():
    return optimizer_fn("sgd", learning_rate=0.5, clip_gradient_norm=0.05)


def _model_and_loss(seed: int = 0, dropout: float = 0.0, mask_bits: int = 16,
                    n_chunks: int | None = None):
    model = ReversibleTransformerLM(vocab_size=VOCAB, d_model=8, d_ff=16, n_layers=2,
                                    n_heads=2, max_len=LENGTH, dropout=dropout,
                                    dropout_mask_bits=mask_bits)
    blocks, loss = tl.extract_reversible_blocks([model,
                                                 tl.CrossEntropyLoss(n_chunks=n_chunks)])
    tl.init_reversible_blocks(blocks, loss, _batch("full"), jax.random.key(seed))
    return blocks, loss


def _build(trainer_name: str, n_devices: int, optimizer=_sgd, **model_kwargs):
    blocks, loss = _model_and_loss(**model_kwargs)
    if trainer_name == "Trainer":
        return Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), optimizer,
                       n_devices=n_devices)
    return TRAINERS[trainer_name](blocks, loss, optimizer, n_devices=n_devices)


def _global_norm(stats, name: str) -> float:
    if name in stats:
        return float(stats[name])
    return float(np.sqrt(sum(float(v) ** 2 for k, v in stats.items()
                             if k.endswith("/" + name))))


def _two_steps(trainer, batch):
    losses, norms = [], []
    for step in range(2):
        loss, stats = trainer.one_step(batch, jax.random.key(10 + step), step=step)
        losses.append(float(loss))
        norms.append(_global_norm(stats, "gradients_l2"))
    return losses, norms, trainer.weights


@pytest.mark.parametrize("mask_kind", ["full", "uneven"])
@pytest.mark.parametrize("trainer_name", list(TRAINERS))
def test_device_count_does_not_change_the_result(trainer_name, mask_kind, n_chunks=None):
    batch = _batch(mask_kind)
    results = {n: _two_steps(_build(trainer_name, n, n_chunks=n_chunks), batch)
               for n in DEVICE_COUNTS}
    losses, norms, weights = results[1]
    assert losses[1] < losses[0]
    for n in DEVICE_COUNTS[1:]:
        np.testing.assert_allclose(results[n][0], losses, rtol=1e-5, err_msg=f"{n} devices")
        np.testing.assert_allclose(results[n][1], norms, rtol=1e-5, err_msg=f"{n} devices")
        assert_trees_close(results[n][2], weights, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trainer_name", list(TRAINERS))
def test_device_count_does_not_change_the_chunked_fused_loss(trainer_name):
    """The fused head computes the loss in chunks of each device's own positions, so the
    chunks differ with the device count; the result must not."""
    test_device_count_does_not_change_the_result(trainer_name, "uneven", n_chunks=4)


def test_the_trainers_draw_the_same_8_bit_dropout_masks():
    """Every trainer splits the step's key the same way, so with 8-bit masks too they take
    the same steps (and the masks differ from 16-bit ones: the setting reaches them)."""
    batch = _batch("uneven")
    results = {name: _two_steps(_build(name, 2, dropout=0.3, mask_bits=8), batch)
               for name in TRAINERS}
    losses, _, weights = results["Trainer"]
    for name in list(TRAINERS)[1:]:
        np.testing.assert_allclose(results[name][0], losses, rtol=1e-5, err_msg=name)
        assert_trees_close(results[name][2], weights, rtol=1e-5, atol=1e-5)
    sixteen = _two_steps(_build("Trainer", 2, dropout=0.3), batch)[0]
    assert abs(sixteen[0] - losses[0]) > 1e-4


@pytest.mark.parametrize("trainer_name", list(TRAINERS))
def test_global_norm_clipping_does_not_depend_on_the_device_count(trainer_name):
    batch = _batch("uneven")
    one = _two_steps(_build(trainer_name, 1, _clipped_sgd), batch)
    four = _two_steps(_build(trainer_name, 4, _clipped_sgd), batch)
    np.testing.assert_allclose(four[0], one[0], rtol=1e-5)
    assert_trees_close(four[2], one[2], rtol=1e-5, atol=1e-5)


def test_the_loss_is_the_weighted_mean_over_the_global_batch():
    batch = _batch("uneven")
    inputs, targets, mask = batch

    def fresh():
        model = ReversibleTransformerLM(vocab_size=VOCAB, d_model=8, d_ff=16, n_layers=2,
                                        n_heads=2, max_len=LENGTH, dropout=0.0)
        model.init(jax.ShapeDtypeStruct(inputs.shape, inputs.dtype), rng=jax.random.key(7))
        return model

    log_probs = np.asarray(fresh()(inputs))
    nll = -np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    expected = float(np.sum(mask * nll) / np.sum(mask))
    for n in DEVICE_COUNTS:
        blocks, loss_layer = tl.extract_reversible_blocks([fresh(), tl.CrossEntropyLoss()])
        trainer = ReversibleSerialTrainer(blocks, loss_layer, _sgd, n_devices=n)
        loss, _ = trainer.one_step(batch, jax.random.key(0))
        assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_an_all_padding_batch_gives_zero_loss_and_no_update():
    inputs, targets, mask = _batch("full")
    batch = (inputs, targets, np.zeros_like(mask))
    for n in (1, 4):
        trainer = _build("Trainer", n)
        before = trainer.weights
        loss, stats = trainer.one_step(batch, jax.random.key(0))
        assert float(loss) == 0.0 and float(stats["gradients_l2"]) == 0.0
        assert_trees_close(trainer.weights, before, rtol=0, atol=0)


@pytest.fixture(scope="module")
def plain_trainers():
    """One `Trainer` per device count with its initial values (reset before each use, so
    hypothesis examples reuse the compiled step)."""
    trainers = {}
    for n in DEVICE_COUNTS:
        trainer = _build("Trainer", n)
        trainers[n] = (trainer, trainer.train_state)
    return trainers


@settings(max_examples=8, deadline=None)
@given(mask_bits=st.lists(st.booleans(), min_size=BATCH * LENGTH, max_size=BATCH * LENGTH),
       seed=st.integers(0, 2 ** 16))
def test_any_mask_and_batch_give_the_same_step_on_1_2_and_4_devices(plain_trainers,
                                                                    mask_bits, seed):
    inputs, targets, _ = _batch("full", seed)
    mask = np.asarray(mask_bits, np.float32).reshape(BATCH, LENGTH)
    results = {}
    for n, (trainer, initial) in plain_trainers.items():
        trainer.restore(initial)
        loss, stats = trainer.one_step((inputs, targets, mask), jax.random.key(seed))
        results[n] = (float(loss), float(stats["gradients_l2"]), trainer.weights)
    for n in DEVICE_COUNTS[1:]:
        assert results[n][0] == pytest.approx(results[1][0], rel=1e-5, abs=1e-6)
        assert results[n][1] == pytest.approx(results[1][1], rel=1e-5, abs=1e-6)
        assert_trees_close(results[n][2], results[1][2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trainer_name", list(TRAINERS))
def test_layer_state_is_per_device_as_in_trax(trainer_name):
    """BatchNorm statistics come from each device's own rows; `state` shows device 0's."""
    batch = _batch("full")

    def build(n_devices):
        model = tl.Serial(tl.Embedding(VOCAB, 8), tl.BatchNorm(axis=(0, 1)),
                          tl.Dense(VOCAB), tl.LogSoftmax())
        blocks, loss = tl.extract_reversible_blocks([model, tl.CrossEntropyLoss()])
        tl.init_reversible_blocks(blocks, loss, batch, jax.random.key(0))
        if trainer_name == "Trainer":
            return Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), _sgd, n_devices)
        return TRAINERS[trainer_name](blocks, loss, _sgd, n_devices=n_devices)

    two = build(2)
    two.one_step(batch, jax.random.key(0))
    first_half = tuple(b[:BATCH // 2] for b in batch)
    one = build(1)
    one.one_step(first_half, jax.random.key(0))
    assert_trees_close(two.state, one.state, rtol=1e-6, atol=1e-6)
    whole = build(1)
    whole.one_step(batch, jax.random.key(0))
    moving_mean = [leaf for leaf in jax.tree.leaves(whole.state) if np.ndim(leaf) == 1][0]
    assert not np.allclose(
        moving_mean, [leaf for leaf in jax.tree.leaves(two.state) if np.ndim(leaf) == 1][0])


@pytest.mark.parametrize("trainer_name", ["ReversibleSerialTrainer", "MemoryEfficientTrainer"])
def test_exact_global_norm_clipping_does_not_depend_on_the_device_count(trainer_name):
    """``clip_global_norm`` gives `Trainer`'s clipped step on 1 and 4 devices."""
    batch = _batch("uneven")

    def build(n_devices):
        return TRAINERS[trainer_name](*_model_and_loss(), _sgd, n_devices=n_devices,
                                      clip_global_norm=0.05)

    plain = _two_steps(_build("Trainer", 1, _clipped_sgd), batch)
    for n in (1, 4):
        losses, norms, weights = _two_steps(build(n), batch)
        np.testing.assert_allclose(losses, plain[0], rtol=1e-5, err_msg=f"{n} devices")
        np.testing.assert_allclose(norms, plain[1], rtol=1e-5, err_msg=f"{n} devices")
        assert_trees_close(weights, plain[2], rtol=1e-5, atol=1e-5)
