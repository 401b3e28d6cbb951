"""Tests for revtrain.trainers.block.block_trainer: exact global-norm clipping
(``clip_global_norm``) and kept stack copies (``keep_every``) in both block trainers."""
import jax
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
from tests.trainers.conftest import (
    adam,
    flat_weights,
    gradient_recorder,
    initialised_blocks,
    relative_errors,
    run_steps,
)
from tests.tree_utils import assert_trees_close

BLOCK_TRAINERS = [ReversibleSerialTrainer, MemoryEfficientTrainer]
MAX_NORM = 0.05  # The model's gradient norm is ~2: every step clips.


def _sgd():
    return optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)


def _clipped(inner):
    return lambda: optax.chain(optax.clip_by_global_norm(MAX_NORM), inner())


def _pair(trainer_cls, n_devices, batch, optimizer, plain_optimizer, **kwargs):
    blocks, loss = initialised_blocks("two", batch)
    w0 = flat_weights(blocks, loss)
    block = trainer_cls(blocks, loss, optimizer, n_devices=n_devices, **kwargs)
    blocks2, loss2 = initialised_blocks("two", batch, weights=w0, seed=1)
    plain = Trainer(tl.Serial(tl.blocks_to_layers(blocks2, loss2)), plain_optimizer,
                    n_devices=n_devices)
    return block, plain


@pytest.mark.parametrize("trainer_cls,n_devices,keep_every,optimizer", [
    (ReversibleSerialTrainer, 1, None, _sgd), (ReversibleSerialTrainer, 4, 2, _sgd),
    (ReversibleSerialTrainer, 2, None, adam), (MemoryEfficientTrainer, 1, 3, _sgd),
    (MemoryEfficientTrainer, 4, None, _sgd)])
def test_clip_global_norm_equals_trainer_with_optax_clipping(trainer_cls, n_devices,
                                                             keep_every, optimizer, batch):
    block, plain = _pair(trainer_cls, n_devices, batch, optimizer, _clipped(optimizer),
                         clip_global_norm=MAX_NORM, keep_every=keep_every)
    for step in range(2):
        rng = jax.random.key(100 + step)
        block_loss, block_stats = block.one_step(batch, rng)
        plain_loss, plain_stats = plain.one_step(batch, rng)
        np.testing.assert_allclose(float(block_loss), float(plain_loss), rtol=1e-5)
        assert float(block_stats["gradients_l2"]) == pytest.approx(
            float(plain_stats["gradients_l2"]), rel=1e-5)
        assert float(block_stats["gradients_l2"]) > 10 * MAX_NORM  # It really clips.
        if step == 0:
            counts = block.trace_counts()
            assert counts["step_summary"] == 1 and set(counts.values()) == {1}
    assert block.trace_counts() == counts  # Nothing recompiled in step 2.
    assert_trees_close(block.weights, plain.weights, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trainer_cls", BLOCK_TRAINERS)
def test_per_layer_clipping_differs_from_the_exact_global_mode(trainer_cls, batch):
    exact, plain = _pair(trainer_cls, 1, batch, _sgd, _clipped(_sgd),
                         clip_global_norm=MAX_NORM)
    per_layer, _ = _pair(trainer_cls, 1, batch, _clipped(_sgd), _sgd)
    for trainer in (exact, per_layer, plain):
        trainer.one_step(batch, jax.random.key(0))
    assert_trees_close(exact.weights, plain.weights, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):
        assert_trees_close(per_layer.weights, plain.weights, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("trainer_cls,keep_every", [
    (ReversibleSerialTrainer, 1), (ReversibleSerialTrainer, 3), (MemoryEfficientTrainer, 2)])
def test_keep_every_matches_trainer_and_compiles_once(trainer_cls, keep_every, batch):
    block, plain = _pair(trainer_cls, 2, batch, adam, adam, keep_every=keep_every)
    np.testing.assert_allclose(run_steps(block, batch, steps=1),
                               run_steps(plain, batch, steps=1), rtol=1e-5)
    counts = block.trace_counts()
    assert set(counts.values()) == {1}
    np.testing.assert_allclose(run_steps(block, batch), run_steps(plain, batch), rtol=1e-5)
    assert block.trace_counts() == counts
    assert_trees_close(block.weights, plain.weights, rtol=1e-5, atol=1e-5)


def test_kept_bytes_grow_with_the_kept_copies(batch):
    kept = {}
    for keep_every in (None, 4, 2, 1):
        trainer = ReversibleSerialTrainer(*initialised_blocks("two", batch), adam,
                                          n_devices=1, keep_every=keep_every)
        trainer.one_step(batch, jax.random.key(0))
        kept[keep_every] = trainer.device_footprint().kept_bytes
    # Block "two": 8 + 4 reversible layers; a kept copy is two [8, 6, 8] float32 streams.
    copy_bytes = 2 * 8 * 6 * 8 * 4
    assert kept[4] - kept[None] == (1 + 0) * copy_bytes
    assert kept[2] - kept[None] == (3 + 1) * copy_bytes
    # Every layer's input kept: a swap's output is its input's arrays reordered (no
    # program), so a copy kept after a swap shares the one kept before it.
    assert (3 + 1) * copy_bytes < kept[1] - kept[None] < (7 + 3) * copy_bytes


@pytest.mark.parametrize("trainer_cls", BLOCK_TRAINERS)
def test_bad_keep_every_and_clip_global_norm_are_clear_errors(trainer_cls, batch):
    with pytest.raises(ValueError, match="keep_every=0 must be >= 1 or None"):
        trainer_cls(*initialised_blocks("one", batch), adam, keep_every=0)
    with pytest.raises(ValueError,
                       match="clip_global_norm=0.0 must be a finite number > 0 or None"):
        trainer_cls(*initialised_blocks("one", batch), adam, clip_global_norm=0.0)


def test_keep_every_keeps_bfloat16_gradients_at_depth_32_close_to_trainers():
    """Issue 16: bf16 compute at depth 32 drifts when reversing; with ``keep_every=8``
    every layer's gradient is within 2e-2 of `Trainer`'s stored-activation gradient."""
    from revtrain.models import ReversibleTransformerLM
    tokens = np.random.RandomState(0).randint(0, 256, (4, 65)).astype(np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:], np.ones((4, 64), np.float32))

    def blocks():
        model = ReversibleTransformerLM(vocab_size=256, d_model=64, d_ff=128, n_layers=32,
                                        n_heads=4, max_len=64, dropout=0.0,
                                        compute_dtype="bfloat16")
        blocks, loss = tl.extract_reversible_blocks([model, tl.CrossEntropyLoss()])
        tl.init_reversible_blocks(blocks, loss, batch, jax.random.key(0))
        return blocks, loss

    def gradients(trainer):
        trainer.one_step(batch, jax.random.key(1))
        return trainer.slots

    reference = gradients(Trainer(tl.Serial(tl.blocks_to_layers(*blocks())),
                                  gradient_recorder, n_devices=1))
    errors = relative_errors(gradients(ReversibleSerialTrainer(
        *blocks(), gradient_recorder, n_devices=1, keep_every=8)), reference)
    print(f"bf16 depth 32, keep_every=8: worst per-layer gradient error {max(errors):.2e}")
    assert len(errors) > 64 and max(errors) <= 2e-2


def test_gin_configs_set_clip_global_norm_and_keep_every(batch):
    import gin

    from revtrain import configurables  # noqa: F401 -- registers the trainers with gin.
    gin.parse_config(["ReversibleSerialTrainer.clip_global_norm = 0.5",
                      "MemoryEfficientTrainer.keep_every = 4"])
    try:
        for name, expected in [("ReversibleSerialTrainer", (None, 0.5)),
                               ("MemoryEfficientTrainer", (4, None))]:
            trainer = gin.get_configurable(name)(*initialised_blocks("one", batch), adam,
                                                 n_devices=1)
            assert (trainer.keep_every, trainer.clip_global_norm) == expected
    finally:
        gin.clear_config()


@pytest.mark.parametrize("trainer_cls", BLOCK_TRAINERS)
def test_frees_host_heap_once_after_compiling_and_never_in_later_steps(trainer_cls, batch,
                                                                      monkeypatch):
    from revtrain import host_heap
    calls = []
    monkeypatch.setattr(host_heap, "release_free_host_memory", lambda: calls.append(1))
    trainer = trainer_cls(*initialised_blocks("two", batch), adam, n_devices=1)
    trainer.one_step(batch, jax.random.key(0))  # precompiles every function, then runs
    n_compiled = sum(trainer.trace_counts().values())
    assert len(calls) == 1 and n_compiled > 1
    for step in range(1, 4):
        trainer.one_step(batch, jax.random.key(step))
    assert len(calls) == 1
    assert sum(trainer.trace_counts().values()) == n_compiled
