"""Tests of revtrain.planning.estimate: the predicted peak equals the ledger's measured one,
for every trainer and placement, and predicting allocates nothing of model size."""
import gc

import jax
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain import memory
from revtrain.models import ReversibleTransformerLM
from revtrain.planning import estimate
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer

VOCAB, LENGTH, BATCH = 64, 32, 8


def _model():
    return ReversibleTransformerLM(vocab_size=VOCAB, d_model=32, d_ff=64, n_layers=3,
                                   n_heads=2, max_len=LENGTH, dropout=0.0, mode="train")


def _batch():
    rs = np.random.RandomState(0)
    tokens = rs.randint(0, VOCAB, (BATCH, LENGTH + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:], np.ones((BATCH, LENGTH), np.float32)


def _optimizer():
    return optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)


def _abstract_model():
    signature = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in _batch())
    model, loss = _model(), tl.CrossEntropyLoss()
    model.weights, model.state = jax.eval_shape(
        lambda rng: _model().init(signature[0], rng=rng), jax.random.key(0))
    loss.init((model.output_signature(signature[0]), signature[1], signature[2]))
    return model, loss, signature


def _measured(trainer_class, **options):
    """The ledger's peak of a second real step (the first compiles), less the device
    bytes live before the trainer was built (other tests' arrays not yet collected)."""
    gc.collect()
    before = memory.live_device_bytes()
    model, loss = _model(), tl.CrossEntropyLoss()
    blocks, loss = tl.extract_reversible_blocks([model, loss])
    batch = _batch()
    signature = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in batch)
    tl.init_reversible_blocks(blocks, loss, signature, jax.random.key(0))
    flat = tl.blocks_to_layers(blocks, loss)
    for layer in flat:  # Host copies: the only device buffers are then the trainer's.
        layer.weights = jax.tree.map(np.array, layer.weights)
        layer.state = jax.tree.map(np.array, layer.state)
    if trainer_class is Trainer:
        trainer = Trainer(tl.fuse_loss_heads(tl.Serial(flat)), _optimizer, **options)
    else:
        trainer = trainer_class(blocks, loss, _optimizer, **options)
    trainer.one_step(batch, jax.random.key(0))
    trainer.block_until_ready()
    with memory.track_peak(trainer) as report:
        trainer.one_step(batch, jax.random.key(1))
        trainer.block_until_ready()
    return report.peak_bytes - before, report.peak_label


@pytest.mark.parametrize("trainer_class, options", [
    (Trainer, {"n_devices": 1}),
    (Trainer, {"n_devices": 1, "remat": "layer"}),
    (ReversibleSerialTrainer, {"n_devices": 1}),
    (MemoryEfficientTrainer, {"n_devices": 1}),
    (ReversibleSerialTrainer, {"n_devices": 4, "fsdp": True}),
    (MemoryEfficientTrainer, {"n_devices": 4}),
])
def test_predicted_peak_is_the_measured_ledger_peak(trainer_class, options):
    model, loss, signature = _abstract_model()
    predicted = estimate(model, loss, signature, _optimizer, trainer_class, **options)
    measured, label = _measured(trainer_class, **options)
    # The ledger also counts small arrays outside the step (the learning rate, indices).
    assert predicted.peak_bytes == pytest.approx(measured, rel=0.02), (predicted, measured)
    assert predicted.peak_program == label
    parts = (predicted.weights_bytes + predicted.slots_bytes + predicted.state_bytes
             + predicted.activation_bytes + predicted.temp_bytes)
    assert parts == predicted.peak_bytes
    assert predicted.n_dispatches >= predicted.n_programs >= 1


def test_estimating_leaves_the_model_alone_and_allocates_no_model_values():
    # A model with real values: it is given its shapes for the estimate only.
    model, loss = _model(), tl.CrossEntropyLoss()
    signature = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in _batch())
    model.init(signature[0], rng=jax.random.key(0))
    loss.init((model.output_signature(signature[0]), signature[1], signature[2]))
    weights = jax.tree.map(np.array, model.weights)
    model_bytes = sum(np.asarray(a).nbytes for a in jax.tree.leaves(weights))
    before = {id(a) for a in jax.live_arrays()}
    result = estimate(model, loss, signature, _optimizer, ReversibleSerialTrainer,
                      n_devices=1)
    new = [a for a in jax.live_arrays() if id(a) not in before]
    assert sum(a.nbytes for a in new) < model_bytes / 10
    assert result.weights_bytes >= model_bytes  # What it predicts is the model's.
    for a, b in zip(jax.tree.leaves(model.weights), jax.tree.leaves(weights), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_the_peak_grows_with_the_batch_and_a_trainer_built_on_shapes_cannot_step():
    model, loss, signature = _abstract_model()
    small = estimate(model, loss, signature, _optimizer, Trainer, batch_size=4, n_devices=1)
    large = estimate(model, loss, signature, _optimizer, Trainer, batch_size=16, n_devices=1)
    assert large.batch_size == 16 and large.peak_bytes > small.peak_bytes
    assert large.weights_bytes == small.weights_bytes
    assert large.work.dot_flops == pytest.approx(4 * small.work.dot_flops, rel=0.05)
    trainer = Trainer.from_model(model, loss, _optimizer, n_devices=1)
    assert trainer.abstract
    with pytest.raises(ValueError, match="built on abstract values.*cannot run a step"):
        trainer.one_step(_batch(), jax.random.key(0))
