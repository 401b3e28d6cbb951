"""Tests for revtrain.layers.fused_head: fused LM heads equal the unfused layers, and fit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain import layers as tl
from revtrain.layers.fused_head import find_heads
from revtrain.models import ReversibleTransformerLM, TransformerLM

B, S, V = 2, 8, 13
SDS = jax.ShapeDtypeStruct


def _batch(seed=0, b=B, s=S):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(b, s)).astype(np.int32)
    mask = (rng.random((b, s)) > 0.25).astype(np.float32)
    return tokens, tokens, mask


def _lm(kind, vocab=V, mode="train"):
    make = ReversibleTransformerLM if kind == "reversible" else TransformerLM
    return make(vocab_size=vocab, d_model=8, d_ff=16, n_layers=2, n_heads=2, max_len=S,
                dropout=0.0, mode=mode)


def _value_and_grad(layer, weights, batch):
    rng = jax.random.key(1)
    return jax.jit(jax.value_and_grad(
        lambda w: layer.pure_fn(batch, w, layer.state, rng)[0]))(weights)


def _assert_close(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert jax.tree.structure(got[1]) == jax.tree.structure(want[1])
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


LOSSES = [
    (lambda n: tl.WeightedCategoryCrossEntropy(n_chunks=n)),
    (lambda n: tl.WeightedCategoryCrossEntropy(label_smoothing=0.1, n_chunks=n)),
    (lambda n: tl.CrossEntropyLoss(n_chunks=n)),
]


@pytest.mark.parametrize("kind,make_loss,n_chunks", [
    ("reversible", LOSSES[0], None), ("reversible", LOSSES[1], 4), ("plain", LOSSES[2], 4),
    ("plain", LOSSES[1], None)])
@pytest.mark.parametrize("scan", [True, False])
def test_serial_model_then_loss_equals_unfused(kind, make_loss, n_chunks, scan):
    model = _lm(kind)
    batch = _batch()
    fused = tl.fuse_loss_heads(tl.Serial(model, make_loss(n_chunks), scan=scan))
    unfused = tl.Serial(model, make_loss(1), scan=scan)
    fused.init(tuple(SDS(a.shape, a.dtype) for a in batch), rng=jax.random.key(0))
    assert type(fused) is tl.FusedSerial and fused.scan is scan and len(fused.heads) == 1
    assert tl.fuse_loss_heads(unfused) is unfused
    weights = fused.weights
    assert jax.tree.structure(weights) == jax.tree.structure((model.weights, ()))
    _assert_close(_value_and_grad(fused, weights, batch),
                  _value_and_grad(unfused, weights, batch))


@pytest.mark.parametrize("make_loss", LOSSES)
def test_block_trainers_loss_layer_equals_unfused(make_loss):
    model = _lm("reversible")
    batch = _batch(seed=2)
    model.init(SDS((B, S), jnp.int32), rng=jax.random.key(0))
    _, loss_layer = tl.extract_reversible_blocks([model, make_loss(None)])
    _, reference = tl.extract_reversible_blocks([model, make_loss(1)])
    assert [type(s).__name__ for s in loss_layer.sublayers][-3:] == [
        "Dense", "LogSoftmax", type(make_loss(1)).__name__]
    assert type(loss_layer) is tl.FusedSerial and type(reference) is tl.Serial
    assert find_heads(loss_layer.sublayers) == [((2,), (3,), (4,))]
    streams = np.random.default_rng(3).normal(size=(2, B, S, 8)).astype(np.float32)
    inputs = (*streams, *batch[1:])
    loss_layer.init(tuple(SDS(a.shape, a.dtype) for a in inputs))
    reference.weights = loss_layer.weights
    weights = loss_layer.weights
    got = _value_and_grad(loss_layer, weights, inputs)
    _assert_close(got, _value_and_grad(reference, weights, inputs))
    y, state = loss_layer.pure_fn(inputs, weights, loss_layer.state, None)
    assert state == loss_layer.state


def test_heads_are_found_across_nested_serials_and_trainer_layout():
    model = _lm("plain")
    blocks, loss = tl.extract_reversible_blocks([model, tl.WeightedCategoryCrossEntropy()])
    flat = tl.blocks_to_layers(blocks, loss)
    heads = find_heads(flat)
    assert len(heads) == 1
    dense_path, softmax_path, loss_path = heads[0]
    assert loss_path == (len(flat) - 1, 0) and dense_path[0] == softmax_path[0] == 0


@pytest.mark.parametrize("layers", [
    [tl.Dense(V), tl.LogSoftmax(), tl.WeightedCategoryCrossEntropy(n_chunks=1)],  # opt-out
    [tl.Dense(V), tl.LogSoftmax(axis=0), tl.WeightedCategoryCrossEntropy()],
    [tl.Dense(V), tl.Softmax(), tl.CrossEntropyLoss()],
    [tl.Dense(V), tl.WeightedCategoryCrossEntropy()],
    [tl.Dense(V), tl.LogSoftmax(), tl.Accuracy()],
    [tl.Dense(V), tl.Relu(), tl.LogSoftmax(), tl.CrossEntropyLoss()],
    [tl.Dense(V), tl.Residual(tl.LogSoftmax()), tl.CrossEntropyLoss()],
    [tl.Residual(tl.Dense(V)), tl.LogSoftmax(), tl.CrossEntropyLoss()],
])
def test_anything_else_is_not_fused(layers):
    assert find_heads(layers) == []


def test_subclasses_are_not_fused():
    class MyDense(tl.Dense):
        pass

    assert find_heads([MyDense(V), tl.LogSoftmax(), tl.CrossEntropyLoss()]) == []


def test_fuse_loss_heads_keeps_layers_without_a_head_and_the_weights_layout():
    plain = tl.Serial(tl.Dense(V), tl.Relu(), tl.LogSoftmax(), tl.CrossEntropyLoss())
    assert tl.fuse_loss_heads(plain) is plain
    residual = tl.Residual(tl.Dense(V), tl.LogSoftmax(), tl.CrossEntropyLoss())
    assert tl.fuse_loss_heads(residual) is residual
    dense = tl.Dense(V)
    serial = tl.Serial(dense, tl.LogSoftmax(), tl.CrossEntropyLoss(), name="head")
    serial.init((SDS((B, S, 4), jnp.float32), SDS((B, S), jnp.int32), SDS((B, S), jnp.float32)))
    fused = tl.fuse_loss_heads(serial)
    assert fused.name == "head" and fused.sublayers == serial.sublayers and fused.initialized
    assert jax.tree.structure(fused.weights) == jax.tree.structure(serial.weights)
    assert fused.heads == (((0,), (1,), (2,)),)


def test_bad_targets_give_the_unfused_layers_errors():
    layer = tl.fuse_loss_heads(
        tl.Serial(tl.Dense(V), tl.LogSoftmax(), tl.WeightedCategoryCrossEntropy()))
    features = np.ones((B, S, 4), np.float32)
    layer.init((SDS((B, S, 4), jnp.float32), SDS((B, S), jnp.int32), SDS((B, S), jnp.float32)))
    targets, mask = np.zeros((B, S), np.int32), np.ones((B, S), np.float32)
    with pytest.raises(tl.LayerError, match="integer class-index targets"):
        layer((features, targets.astype(np.float32), mask))
    with pytest.raises(tl.LayerError, match="targets of shape"):
        layer((features, targets[:, :5], mask[:, :5]))


def test_model_alone_and_decoding_layers_are_unchanged():
    model = _lm("plain", mode="eval")
    model.init(SDS((B, S), jnp.int32), rng=jax.random.key(0))
    assert find_heads(model.sublayers) == []
    log_probs = model(_batch()[0])
    assert log_probs.shape == (B, S, V)


def _peak_ratio(layer, inputs, logits_bytes):
    layer.init(inputs)
    step = jax.jit(jax.value_and_grad(
        lambda w, streams, labels: layer.pure_fn((*streams, *labels), w, layer.state, None)[0],
        argnums=(0, 1)))
    m = step.lower(layer.weights, inputs[:2], inputs[2:]).compile().memory_analysis()
    return (m.temp_size_in_bytes + m.output_size_in_bytes + m.argument_size_in_bytes
            - m.alias_size_in_bytes) / logits_bytes


def test_lm_loss_layer_at_vocab_32000_peaks_below_one_and_a_half_logits_buffers():
    b, s, d, v = 8, 256, 16, 32000
    model = ReversibleTransformerLM(vocab_size=v, d_model=d, d_ff=d, n_layers=1, n_heads=2,
                                    max_len=s)
    inputs = (SDS((b, s, d), jnp.float32), SDS((b, s, d), jnp.float32),
              SDS((b, s), jnp.int32), SDS((b, s), jnp.float32))

    def loss_layer(n_chunks):
        loss = tl.WeightedCategoryCrossEntropy(n_chunks=n_chunks)
        return tl.extract_reversible_blocks([model, loss])[1]

    logits_bytes = b * s * v * 4
    fused, unfused = (_peak_ratio(loss_layer(n), inputs, logits_bytes) for n in (None, 1))
    print(f"LM loss layer peak: {fused:.2f} logits buffers fused, {unfused:.2f} unfused")
    assert fused <= 1.5 < 2.0 < unfused


@pytest.mark.parametrize("n_devices", [1, 2])
def test_trainer_step_with_chunks_under_shard_map_equals_unfused(n_devices):
    import optax

    from revtrain.trainers import Trainer

    batch = _batch(seed=4, b=4)
    after = []
    for n_chunks in (4, 1):
        model = _lm("plain")
        model.init(SDS((4, S), jnp.int32), rng=jax.random.key(0))
        whole = tl.fuse_loss_heads(
            tl.Serial(model, tl.WeightedCategoryCrossEntropy(n_chunks=n_chunks)))
        trainer = Trainer(whole, lambda: optax.sgd(0.1), n_devices=n_devices)
        loss, stats = trainer.one_step(batch, jax.random.key(1))
        after.append((loss, stats["gradients_l2"]))
    np.testing.assert_allclose(after[0], after[1], rtol=1e-5)


def _chunked_lm(chunk):
    return ReversibleTransformerLM(vocab_size=V, d_model=8, d_ff=16, n_layers=2, n_heads=2,
                                   max_len=S, dropout=0.0, ff_chunk_size=chunk)


@pytest.mark.parametrize("chunk,n_chunks", [(4, None), (3, 4), (8, 2)])
def test_the_heads_position_wise_chunk_joins_the_fusion_and_changes_nothing(chunk, n_chunks):
    model = _chunked_lm(chunk)
    model.init(SDS((B, S), jnp.int32), rng=jax.random.key(0))
    _, loss_layer = tl.extract_reversible_blocks(
        [model, tl.WeightedCategoryCrossEntropy(n_chunks=n_chunks)])
    _, reference = tl.extract_reversible_blocks([model, tl.WeightedCategoryCrossEntropy(
        n_chunks=1)])
    names = [type(s).__name__ for s in loss_layer.sublayers]
    assert names[-4:] == ["Chunk", "Dense", "LogSoftmax", "WeightedCategoryCrossEntropy"]
    assert find_heads(loss_layer.sublayers) == [((0,), (1,), (2,), (3,))]
    streams = np.random.default_rng(5).normal(size=(2, B, S, 8)).astype(np.float32)
    inputs = (*streams, *_batch(seed=6)[1:])
    loss_layer.init(tuple(SDS(a.shape, a.dtype) for a in inputs))
    reference.weights = weights = loss_layer.weights
    _assert_close(_value_and_grad(loss_layer, weights, inputs),
                  _value_and_grad(reference, weights, inputs))


@pytest.mark.parametrize("inner", [
    lambda: tl.Serial(tl.Concatenate(), tl.LayerNorm(), tl.Dropout(0.1)),  # reads its rng
    lambda: tl.Serial(tl.Concatenate(axis=1), tl.LayerNorm()),  # joins along the length
    lambda: tl.Serial(tl.LayerNorm(), tl.Concatenate()),  # concatenation not first
])
def test_a_chunk_that_is_not_position_wise_stays_outside_the_fusion(inner):
    layers = [tl.Chunk(inner(), 4), tl.Dense(V), tl.LogSoftmax(), tl.CrossEntropyLoss()]
    assert find_heads(layers) == [((1,), (2,), (3,))]


def test_the_fused_chunk_keeps_the_loss_program_free_of_full_length_features():
    b, s, d, v, chunk = 1, 16384, 64, 256, 256
    model = ReversibleTransformerLM(vocab_size=v, d_model=d, d_ff=d, n_layers=1, n_heads=2,
                                    max_len=s, ff_chunk_size=chunk)
    inputs = (SDS((b, s, d), jnp.float32), SDS((b, s, d), jnp.float32),
              SDS((b, s), jnp.int32), SDS((b, s), jnp.float32))
    layer = tl.extract_reversible_blocks([model, tl.CrossEntropyLoss(n_chunks=s // chunk)])[1]
    assert len(layer.heads[0]) == 4
    layer.init(inputs)
    step = jax.jit(jax.value_and_grad(
        lambda w, x1, x2, t, m: layer.pure_fn((x1, x2, t, m), w, layer.state, None)[0],
        argnums=(0, 1, 2)))
    m = step.lower(layer.weights, *inputs).compile().memory_analysis()
    features = b * s * 2 * d * 4  # The [batch, length, 2 * d_model] features, float32.
    print(f"loss program temporaries: {m.temp_size_in_bytes / features:.2f} feature buffers")
    assert m.temp_size_in_bytes < 0.25 * features  # Was 3 buffers with the Chunk outside.


def test_an_empty_batch_and_a_prime_length_keep_the_unfused_answers():
    from revtrain.layers.fused_head import _prefix_chunk_count
    layers = [tl.Chunk(tl.Serial(tl.Concatenate(), tl.LayerNorm()), 4), tl.Dense(V),
              tl.LogSoftmax(), tl.CrossEntropyLoss()]
    fused = tl.fuse_loss_heads(tl.Serial(*layers))
    x = np.zeros((0, 10, 8), np.float32)
    batch = (x, x, np.zeros((0, 10), np.int32), np.zeros((0, 10), np.float32))
    fused.init(tuple(SDS(a.shape, a.dtype) for a in batch))
    assert float(fused(batch)) == 0.0
    assert _prefix_chunk_count(32768, V, 32) == 32
    assert _prefix_chunk_count(30, V, 7) == 10  # The next divisor up, within 2x.
    assert _prefix_chunk_count(32749, V, 32) == 1  # Prime: no divisor near; few chunks.


def test_a_subclass_of_a_position_wise_layer_is_not_absorbed_unless_it_says_so():
    class NoisyNorm(tl.LayerNorm):  # Might read its rng: it did not say position_wise.
        pass

    class PlainNorm(tl.LayerNorm):
        position_wise = True

    assert not NoisyNorm.position_wise and PlainNorm.position_wise
    head = [tl.Dense(V), tl.LogSoftmax(), tl.CrossEntropyLoss()]
    assert len(find_heads([tl.Chunk(NoisyNorm(), 4), *head])[0]) == 3
    assert len(find_heads([tl.Chunk(PlainNorm(), 4), *head])[0]) == 4
