"""Tests for revtrain.models.transformer: shapes, causality, dtypes, and reversible gradients."""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    CrossEntropyLoss,
    Fn,
    ReversibleSerial,
    Serial,
    ShapeDtype,
    blocks_to_layers,
    extract_reversible_blocks,
    inputs_from_stack,
    outputs_onto_stack,
    reconstruction_error,
)
from revtrain.models import ReversibleTransformerLM, TransformerLM
from tests.tree_utils import assert_trees_close

VOCAB, BATCH, LENGTH, D = 16, 2, 8, 8


def _lm(cls=ReversibleTransformerLM, n_layers=2, **kwargs):
    kwargs.setdefault("d_model", D)
    return cls(vocab_size=VOCAB, d_ff=16, n_layers=n_layers, n_heads=2, max_len=LENGTH,
               **kwargs)


def _batch(seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (BATCH, LENGTH + 1), 0, VOCAB)
    return tokens[:, :-1], tokens[:, 1:], jnp.ones((BATCH, LENGTH), jnp.float32)


def _signature(x):
    return jax.tree.map(lambda a: ShapeDtype(a.shape, a.dtype), x)


def _init(model, x, seed=1):
    model.init(_signature(x), jax.random.key(seed))
    return model


def test_same_arguments_and_defaults():
    rev = inspect.signature(ReversibleTransformerLM)
    assert rev == inspect.signature(TransformerLM)
    assert rev.parameters["d_model"].default == 512 and rev.parameters["mode"].default == "train"


@pytest.mark.parametrize("cls", [ReversibleTransformerLM, TransformerLM])
def test_log_probs_shape_and_causality(cls):
    tokens = _batch()[0]
    model = _init(_lm(cls, mode="eval"), tokens)
    y = model(tokens)
    assert y.shape == (BATCH, LENGTH, VOCAB) and y.dtype == jnp.float32
    np.testing.assert_allclose(jax.scipy.special.logsumexp(y, axis=-1), 0.0, atol=1e-5)
    changed = tokens.at[:, 5].set((tokens[:, 5] + 1) % VOCAB)
    y2 = model(changed)
    np.testing.assert_allclose(y2[:, :5], y[:, :5], atol=1e-6)
    assert not np.allclose(y2[:, 5:], y[:, 5:])


def test_reversible_lm_structure():
    model = _lm(n_layers=3)
    names = [s.name for s in model.sublayers]
    assert names == ["Embedding", "Dropout", "PositionalEncoding", "Dup", "ReversibleSerial",
                     "Concatenate", "LayerNorm", "Dense", "LogSoftmax"]
    rev = model.sublayers[4]
    assert isinstance(rev, ReversibleSerial) and len(rev.sublayers) == 12
    assert rev.sublayers[0].sublayers[1].name == "CausalAttention"
    assert [s.name for s in rev.sublayers[2].sublayers[0].sublayers] == [
        "LayerNorm", "Dense", "Relu", "Dropout", "Dense", "Dropout"]


def test_dropout_only_in_train_mode():
    tokens = _batch()[0]
    for mode, same in (("train", False), ("eval", True)):
        model = _init(_lm(mode=mode, dropout=0.3), tokens)
        a = model(tokens, rng=jax.random.key(0))
        b = model(tokens, rng=jax.random.key(1))
        assert np.allclose(a, b) == same


@pytest.mark.parametrize("cls", [ReversibleTransformerLM, TransformerLM])
def test_dropout_mask_bits_reach_every_dropout(cls):
    """8-bit masks change every dropout of the model (embedding, positional encoding,
    attention, feed-forward), and the layers' structure keys, so no compiled function is
    shared with the 16-bit model."""
    x, _, _ = _batch()
    outputs, keys = {}, {}
    for bits in (16, 8):
        model = _init(_lm(cls, dropout=0.3, dropout_mask_bits=bits), x)  # Same seed: weights.
        outputs[bits] = model(x, rng=jax.random.key(3))
        keys[bits] = {layer.structure_key for layer in _all_sublayers(model)
                      if "Dropout" in type(layer).__name__
                      or type(layer).__name__ in ("CausalAttention", "PositionalEncoding")}
    assert not np.allclose(outputs[8], outputs[16])
    assert len(keys[16]) == 3 and not keys[8] & keys[16]  # Dropout, attention, encoding


def _all_sublayers(layer):
    yield layer
    for sub in layer.sublayers:
        yield from _all_sublayers(sub)


def test_bfloat16_compute_keeps_float32_streams():
    tokens = _batch()[0]
    model = _init(_lm(compute_dtype=jnp.bfloat16, mode="eval"), tokens)
    stem = Serial(*model.sublayers[:4])
    streams = stem(tokens, weights=stem.weights, state=stem.state)
    rev = model.sublayers[4]
    out = rev(streams, weights=rev.weights, state=rev.state)
    assert [a.dtype for a in out] == [jnp.float32, jnp.float32]
    reference = _lm(mode="eval")
    reference.weights = model.weights[:4] + (_drop_casts(model.weights[4]),) + model.weights[5:]
    np.testing.assert_allclose(model(tokens), reference(tokens), atol=0.1)
    assert not np.allclose(model(tokens), reference(tokens), atol=1e-6)  # really bf16


def _drop_casts(rev_weights):
    """Weights of the float32 model from the bfloat16 one: drop each cast's ``()``."""
    out = []
    for w in rev_weights:
        if w == ():  # a swap
            out.append(w)
        else:  # a half-residual: (compute, attention); the cast follows the LayerNorm
            compute, attention = w
            assert compute[1] == ()
            out.append((compute[:1] + compute[2:], attention))
    return tuple(out)


def _grads_by_reversal(blocks, loss_layer, batch, rng):
    """Weight gradients of the loss, storing only each block's std-layer input.

    Forward: store the input of every std layer, keep nothing for reversible layers.
    Backward: reconstruct reversible layers' inputs with ``reverse_and_grad`` from the
    block's output, as `ReversibleSerialTrainer` does.
    """
    flat = blocks_to_layers(blocks, loss_layer)
    rngs = iter(jax.random.split(rng, len(flat)))
    stack, saved = batch, []
    for std, revs in blocks:
        r_std, records = next(rngs), []
        saved.append((std, stack, r_std, records))
        stack = _apply(std, stack, r_std)[0]
        for layer in revs:
            r = next(rngs)
            stack, new_state = _apply(layer, stack, r)
            records.append((layer, new_state, r))
    r_loss = next(rngs)
    assert loss_layer.n_in == len(stack), "the loss must consume the whole stack"

    def loss_fn(x, w):
        return loss_layer.pure_fn(x, w, loss_layer.state, r_loss)[0]

    loss, vjp_fn = jax.vjp(loss_fn, tuple(stack), loss_layer.weights)
    ct, loss_grads = vjp_fn(jnp.ones_like(loss))
    grads = [loss_grads]
    for std, std_input, r_std, records in reversed(saved):
        for layer, new_state, r in reversed(records):
            y, y_ct = inputs_from_stack(stack, layer.n_out), inputs_from_stack(ct, layer.n_out)
            x, (x_ct, w_ct) = layer.reverse_and_grad(y, y_ct, layer.weights, layer.state,
                                                     new_state, r)
            stack = outputs_onto_stack(x, stack, layer.n_out)
            ct = outputs_onto_stack(x_ct, ct, layer.n_out)
            grads.append(w_ct)
        x_ct, w_ct = _std_vjp(std, inputs_from_stack(std_input, std.n_in), r_std,
                              inputs_from_stack(ct, std.n_out))
        ct, stack = outputs_onto_stack(x_ct, ct, std.n_out), std_input
        grads.append(w_ct)
    return tuple(grads[::-1])


def _std_vjp(layer, x, rng, ct):
    _, vjp_fn = jax.vjp(lambda x, w: layer.pure_fn(x, w, layer.state, rng)[0], x,
                        layer.weights)
    return vjp_fn(ct)


def _apply(layer, stack, rng):
    y, new_state = layer.pure_fn(inputs_from_stack(stack, layer.n_in), layer.weights,
                                 layer.state, rng)
    return outputs_onto_stack(y, stack, layer.n_in), new_state


def _max_relative_error(actual, expected):
    """Max over flat layers of ``max |a - e| / max |e|`` within that layer's gradients.

    Per layer rather than per leaf: some leaves (e.g. the attention key bias, which
    softmax ignores) have mathematically zero gradients that are pure rounding noise.
    """
    worst = 0.0
    for a_layer, e_layer in zip(actual, expected, strict=True):
        e_leaves = jax.tree.leaves(e_layer)
        if not e_leaves:
            continue
        scale = max(float(jnp.max(jnp.abs(e))) for e in e_leaves)
        diff = max(float(jnp.max(jnp.abs(a - e)))
                   for a, e in zip(jax.tree.leaves(a_layer), e_leaves, strict=True))
        worst = max(worst, diff / max(scale, 1e-12))
    return worst


def test_grad_of_32_layer_reversible_lm_equals_reversal_grads():
    batch = _batch()
    model = Serial(_lm(n_layers=32, dropout=0.1), CrossEntropyLoss())
    blocks, loss_layer = extract_reversible_blocks(model)
    flat = Serial(blocks_to_layers(blocks, loss_layer))
    flat.init(_signature(batch), jax.random.key(2))
    rng = jax.random.key(3)

    def loss(weights):
        return flat.pure_fn(batch, weights, flat.state, rng)[0]

    stored = jax.grad(loss)(flat.weights)  # plain jax.grad: stores every activation
    reversed_grads = _grads_by_reversal(blocks, loss_layer, batch, rng)
    error = _max_relative_error(reversed_grads, stored)
    print(f"32-layer reversible LM: max relative gradient error {error:.2e}")
    assert error < 1e-4
    assert float(jnp.max(jnp.abs(stored[1][0][0][0][0]))) > 0  # real, non-zero gradients


def test_reversible_model_equals_its_flat_blocks_without_dropout():
    batch = _batch()
    model = Serial(_lm(dropout=0.0), CrossEntropyLoss())
    _init(model, batch)
    blocks, loss_layer = extract_reversible_blocks(model)
    flat = blocks_to_layers(blocks, loss_layer)
    weights = tuple(layer.weights for layer in flat)
    states = tuple(layer.state for layer in flat)
    expected = model.pure_fn(batch, model.weights, model.state, None)[0]
    assert_trees_close(Serial(flat).pure_fn(batch, weights, states, None)[0], expected)


def test_reconstruction_error_of_64_layer_stack():
    batch = _batch()
    model = Serial(_lm(n_layers=64, dropout=0.1), CrossEntropyLoss())
    _init(model, batch)
    errors = reconstruction_error(model, batch, jax.random.key(5))
    assert len(errors) == 4 * 64
    print(f"64-layer reversible LM, float32: max reconstruction error {max(errors):.2e} "
          f"(bottom layer; median {np.median(errors):.2e})")
    assert max(errors) < 1e-4


def test_bfloat16_compute_with_float32_streams_reconstructs_far_better_than_bf16_streams():
    batch = _batch()
    medians = {}
    for streams in ("float32", "bfloat16"):
        lm = _lm(n_layers=16, dropout=0.1, compute_dtype=jnp.bfloat16)
        layers = list(lm.sublayers)
        if streams == "bfloat16":  # cast the embedded input, so both streams are bf16
            layers.insert(3, Fn("ToBf16", lambda x: x.astype(jnp.bfloat16)))
        model = Serial(Serial(layers), CrossEntropyLoss())
        _init(model, batch)
        medians[streams] = float(np.median(reconstruction_error(model, batch,
                                                                jax.random.key(5))))
    print(f"16-layer LM, bf16 compute: median reconstruction error {medians}")
    assert medians["float32"] < 1e-5 and medians["bfloat16"] > 1e-3


@pytest.mark.parametrize("cls", [ReversibleTransformerLM, TransformerLM])
def test_every_layer_has_a_structure_key_so_trainers_share_compiled_blocks(cls):
    def layers(layer):
        yield layer
        for sub in layer.sublayers:
            yield from layers(sub)

    model = _lm(cls, compute_dtype=jnp.bfloat16)
    assert [layer.name for layer in layers(model) if layer.structure_key is None] == []
    if cls is ReversibleTransformerLM:  # the half-residuals of both layers are alike
        (stack,) = [layer for layer in model.sublayers if isinstance(layer, ReversibleSerial)]
        keys = {sub.structure_key for sub in stack.sublayers}
        assert len(keys) == 3  # attention half, feed-forward half, swap


# --------------------------------------------------------------------------------------
# Edge cases.


@pytest.mark.parametrize("cls", [ReversibleTransformerLM, TransformerLM])
def test_trained_position_table_starts_sinusoidal_trains_and_decodes(cls):
    """pos_type='trained' (Trax's default): a [max_len, d_model] weight that starts as the
    fixed table (same outputs as 'sinusoidal'), gets a gradient, and decodes step by step."""
    inputs, targets, weights = _batch()
    fixed, trained = _lm(cls, dropout=0.0), _lm(cls, dropout=0.0, pos_type="trained")
    fixed.init(_signature(inputs), rng=jax.random.key(0))
    trained.init(_signature(inputs), rng=jax.random.key(0))
    table = trained.weights[2]
    assert table.shape == (LENGTH, D) and fixed.weights[2] == ()
    np.testing.assert_allclose(trained(inputs), fixed(inputs), rtol=1e-5, atol=1e-6)
    model = Serial(trained, CrossEntropyLoss())
    model.init(_signature((inputs, targets, weights)), rng=jax.random.key(0))
    grads = jax.grad(lambda w: model.pure_fn((inputs, targets, weights), w, model.state,
                                             None)[0])(model.weights)
    assert float(jnp.abs(grads[0][2]).max()) > 0
    predict = _lm(cls, dropout=0.0, pos_type="trained", mode="predict")
    predict.init(_signature(inputs[:, :1]), rng=jax.random.key(0))
    state, steps = predict.state, []
    for t in range(LENGTH):
        y, state = predict.pure_fn(inputs[:, t:t + 1], trained.weights, state, None)
        steps.append(y)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), trained(inputs), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("make", [ReversibleTransformerLM, TransformerLM])
@pytest.mark.parametrize("kwargs,message", [
    ({"n_layers": -1}, r"n_layers=-1 must be >= 0"),
    ({"compute_dtype": "int8"}, r"compute_dtype=int8 is not a float dtype"),
    ({"compute_dtype": "bflaot16"}, r"compute_dtype='bflaot16' is not a dtype"),
    ({"dropout_mask_bits": 4}, r"dropout_mask_bits=4 is not one of \(8, 16\)"),
    ({"dropout_mask_bits": True}, r"dropout_mask_bits=True is not one of \(8, 16\)"),
    ({"dropout_mask_bits": 8.0}, r"dropout_mask_bits=8.0 is not one of \(8, 16\)"),
    ({"dropout_mask_bits": "8"}, r"dropout_mask_bits='8' is not one of \(8, 16\)"),
])
def test_bad_arguments_are_rejected_naming_them(make, kwargs, message):
    args = dict(vocab_size=4, d_model=4, d_ff=8, n_layers=1, n_heads=2, max_len=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        make(**args)


@pytest.mark.parametrize("make", [ReversibleTransformerLM, TransformerLM])
def test_vocab_one_length_one_batch_one(make):
    model = make(vocab_size=1, d_model=4, d_ff=8, n_layers=1, n_heads=2, max_len=4,
                 dropout=0.0)
    tokens = np.zeros((1, 1), np.int32)
    model.init(tokens, rng=jax.random.key(0))
    log_probs = model(tokens)
    assert log_probs.shape == (1, 1, 1)
    np.testing.assert_allclose(log_probs, 0.0, atol=1e-6)  # one class: probability 1


def test_zero_layers_is_embedding_then_head():
    model = ReversibleTransformerLM(vocab_size=3, d_model=4, d_ff=8, n_layers=0, n_heads=2,
                                    max_len=4, dropout=0.0)
    tokens = np.array([[0, 1, 2]], np.int32)
    model.init(tokens, rng=jax.random.key(0))
    y = model(tokens)
    assert y.shape == (1, 3, 3)
    np.testing.assert_allclose(jnp.exp(y).sum(-1), 1.0, rtol=1e-5)


# --------------------------------------------------------------------------------------
# Long-context options: attention_type, ff_chunk_size, pos_type.

def _long_context(cls, implementation, ff_chunk_size, pos_type="sinusoidal", **kwargs):
    import functools

    from revtrain.layers import CausalAttention
    attention = functools.partial(CausalAttention, implementation=implementation,
                                  block_size=3)
    return _lm(cls, attention_type=attention, ff_chunk_size=ff_chunk_size,
               pos_type=pos_type, **kwargs)


@pytest.mark.parametrize("cls, pos_type", [(ReversibleTransformerLM, "rotary"),
                                           (TransformerLM, "sinusoidal")])
def test_blockwise_and_chunked_model_equals_the_full_one(cls, pos_type):
    """Same weights (the chunked tree nests the feed-forward one level deeper), same
    log-probabilities and gradients."""
    inputs, targets, _ = _batch()
    full = _long_context(cls, "xla", None, pos_type, dropout=0.0)
    long = _long_context(cls, "blockwise", 3, pos_type, dropout=0.0)
    full.init(_signature(inputs), rng=jax.random.key(0))
    long.init(_signature(inputs), rng=jax.random.key(1))

    # Chunking nests the feed-forward weights one level deeper, in the same order.
    long.weights = jax.tree.unflatten(jax.tree.structure(long.weights),
                                      jax.tree.leaves(full.weights))

    def loss(model, weights):
        log_probs = model.pure_fn(inputs, weights, model.state, None)[0]
        return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], -1))

    np.testing.assert_allclose(long(inputs), full(inputs), rtol=1e-5, atol=1e-5)
    g_full = jax.grad(lambda w: loss(full, w))(full.weights)
    g_long = jax.grad(lambda w: loss(long, w))(long.weights)
    for a, b in zip(jax.tree.leaves(g_long), jax.tree.leaves(g_full), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_rotary_model_has_no_position_table_and_reverses_exactly():
    model = _long_context(ReversibleTransformerLM, "blockwise", 3, "rotary", dropout=0.2)
    assert "PositionalEncoding" not in repr(model)
    batch = _batch()
    model = Serial(model, CrossEntropyLoss())
    _init(model, batch)
    errors = reconstruction_error(model, batch, jax.random.key(2))
    assert max(errors) < 1e-5


@pytest.mark.parametrize("implementation", [None, "blockwise"])
def test_rotary_blockwise_model_decodes_the_tokens_of_the_full_forward(implementation):
    """Greedy decoding with the key/value cache gives the argmax of the full forward."""
    train = _long_context(ReversibleTransformerLM, implementation, 3, "rotary", dropout=0.0)
    predict = _long_context(ReversibleTransformerLM, implementation, 3, "rotary",
                            dropout=0.0, mode="predict")
    inputs, _, _ = _batch()
    train.init(_signature(inputs), rng=jax.random.key(0))
    predict.init(_signature(inputs[:, :1]), rng=jax.random.key(0))
    state = predict.state
    steps = []
    for t in range(LENGTH):
        y, state = predict.pure_fn(inputs[:, t:t + 1], train.weights, state, None)
        steps.append(y)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), train(inputs), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("make", [ReversibleTransformerLM, TransformerLM])
@pytest.mark.parametrize("kwargs,message", [
    ({"ff_chunk_size": 0}, r"ff_chunk_size=0 must be a positive int"),
    ({"ff_chunk_size": -8}, r"ff_chunk_size=-8 must be a positive int"),
    ({"pos_type": "axial"}, r"pos_type='axial' is not one of \('sinusoidal', 'rotary', "
                            r"'trained'\)"),
    ({"attention_type": "CausalAttention"}, r"attention_type='CausalAttention' is not "
                                            r"callable"),
    ({"attention_type": lambda d, **kw: 3}, r"gave 3, not a layer"),
    ({"pos_type": "rotary", "d_model": 6, "n_heads": 2}, r"d_head=3 is odd"),
])
def test_bad_long_context_arguments_are_rejected_naming_them(make, kwargs, message):
    args = dict(vocab_size=4, d_model=4, d_ff=8, n_layers=1, n_heads=2, max_len=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message) as info:
        make(**args)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("cls", [ReversibleTransformerLM, TransformerLM])
def test_attention_widths_reach_the_attention_and_the_default_keeps_the_weights(cls):
    """Trax's ``d_attention_key`` / ``d_attention_value``: the LM passes them to its
    ``attention_type`` only when set, so the default model and its checkpoints are as
    before, and a factory that does not take them still works."""
    def shapes(model):
        weights, _ = model.init(ShapeDtype((BATCH, LENGTH), jnp.int32), rng=jax.random.key(0))
        return weights, {w.shape for w in jax.tree.leaves(weights)}

    default, default_shapes = shapes(_lm(cls, n_layers=1))
    same, _ = shapes(_lm(cls, n_layers=1, d_attention_key=D // 2, d_attention_value=D // 2))
    assert_trees_close(same, default, rtol=0, atol=0)
    _, wide = shapes(_lm(cls, n_layers=1, d_attention_key=3, d_attention_value=5))
    assert {(D, 6), (D, 10), (10, D)} <= wide and (D, 6) not in default_shapes
    seen = []

    def attention(d_model, **kwargs):
        seen.append(kwargs)
        return Fn("Identity", lambda x: x)

    _lm(cls, n_layers=1, attention_type=attention)
    assert "d_attention_key" not in seen[-1] and "d_attention_value" not in seen[-1]
