"""Tests for revtrain.layers.blocks: block extraction, initialisation, drift measurement."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain import layers as tl
from revtrain.layers import (
    Add,
    Branch,
    Concatenate,
    CrossEntropyLoss,
    Dense,
    Dropout,
    Dup,
    L2Loss,
    ReversibleHalfResidual,
    ReversibleLayer,
    ReversibleSerial,
    ReversibleSwap,
    Serial,
    ShapeDtype,
    blocks_to_layers,
    extract_reversible_blocks,
    init_reversible_blocks,
    reconstruction_error,
)
from revtrain.layers.normalization import LayerNorm
from revtrain.models import ReversibleTransformerLM, RevNet, TransformerLM
from tests.tree_utils import assert_trees_close

D = 8
VOCAB, BATCH, LENGTH = 16, 2, 8


def _lm_batch():
    tokens = jax.random.randint(jax.random.key(0), (BATCH, LENGTH + 1), 0, VOCAB)
    return tokens[:, :-1], tokens[:, 1:], jnp.ones((BATCH, LENGTH), jnp.float32)


def _lm(n_layers=2, cls=ReversibleTransformerLM, **kwargs):
    return cls(vocab_size=VOCAB, d_model=D, d_ff=16, n_layers=n_layers, n_heads=2,
               max_len=LENGTH, **kwargs)


def _names(layer):
    return [s.name for s in layer.sublayers]


def _signature(x):
    return jax.tree.map(lambda a: ShapeDtype(a.shape, a.dtype), x)


def _stack(n_blocks, rate=0.1):
    """A reversible stack on [batch, length, D] floats with an L2 loss on (y, target, w)."""
    blocks = [[ReversibleHalfResidual(LayerNorm(), Dense(D), Dropout(rate)), ReversibleSwap()]
              for _ in range(n_blocks)]
    return [Dup(), ReversibleSerial(blocks), Concatenate(), Dense(D), L2Loss()]


def _stack_batch():
    x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, D))
    return x, jnp.zeros_like(x), jnp.ones_like(x)


def test_extract_reversible_lm():
    model = _lm(n_layers=3)
    loss = CrossEntropyLoss()
    blocks, loss_layer = extract_reversible_blocks([model, loss])
    assert len(blocks) == 1
    std, rev = blocks[0]
    assert _names(std) == ["Embedding", "Dropout", "PositionalEncoding", "Dup"]
    assert len(rev) == 12 and all(isinstance(r, ReversibleLayer) for r in rev)
    assert [r.name for r in rev[:4]] == ["ReversibleHalfResidual", "ReversibleSwap"] * 2
    assert rev[0] is model.sublayers[4].sublayers[0]  # the model's own layer objects
    assert _names(loss_layer) == ["Concatenate", "LayerNorm", "Dense", "LogSoftmax",
                                  "CrossEntropyLoss"]
    assert loss_layer.sublayers[-1] is loss


def test_extract_revnet_has_one_block_per_stage():
    model = RevNet(n_classes=5, widths=(4, 8, 8), n_blocks_per_stage=(1, 2, 1))
    blocks, loss_layer = extract_reversible_blocks(Serial(model, CrossEntropyLoss()))
    assert [len(rev) for _, rev in blocks] == [4, 8, 4]
    assert _names(blocks[0][0]) == ["Conv", "Split"]
    assert _names(blocks[1][0]) == ["Concatenate", "BatchNorm", "Relu", "Conv", "Split"]
    assert _names(loss_layer)[:4] == ["Concatenate", "BatchNorm", "Relu", "Mean"]


def test_extract_model_without_reversible_layers_gives_one_block_without_them():
    model = _lm(cls=TransformerLM, dropout=0.0)
    blocks, loss_layer = extract_reversible_blocks([model, CrossEntropyLoss()])
    assert len(blocks) == 1 and blocks[0][1] == []
    assert _names(loss_layer) == ["CrossEntropyLoss"]
    # Residual (a Serial subclass) is opened into Branch + Add.
    assert "Residual" not in _names(blocks[0][0]) and "Branch" in _names(blocks[0][0])
    batch = _lm_batch()
    whole = Serial(model, CrossEntropyLoss())
    whole.init(_signature(batch), jax.random.key(0))
    flat = Serial(*blocks_to_layers(blocks, loss_layer))
    expected = whole.pure_fn(batch, whole.weights, whole.state, None)[0]
    weights = (blocks[0][0].weights, loss_layer.weights)
    states = (blocks[0][0].state, loss_layer.state)
    assert_trees_close(flat.pure_fn(batch, weights, states, None)[0], expected)


def test_extract_block_starting_with_reversible_layer_and_std_between_blocks():
    rev_a, rev_b = ReversibleSwap(), ReversibleSwap()
    dense, loss = Dense(D), L2Loss()
    blocks, loss_layer = extract_reversible_blocks(
        [ReversibleSerial(rev_a), Serial(dense, Branch(None, None)), [Add(), rev_b], loss])
    assert len(blocks) == 2
    assert blocks[0][0].sublayers == () and blocks[0][1] == [rev_a]
    assert _names(blocks[1][0]) == ["Dense", "Branch", "Add"] and blocks[1][1] == [rev_b]
    assert loss_layer.sublayers == (loss,)
    assert blocks_to_layers(blocks, loss_layer) == [blocks[0][0], rev_a, blocks[1][0], rev_b,
                                                    loss_layer]


def test_extract_model_ending_in_reversible_layer_is_an_error():
    with pytest.raises(ValueError, match="add a loss layer"):
        extract_reversible_blocks([Dense(D), Dup(), ReversibleSerial(ReversibleSwap())])


def test_init_reversible_blocks_matches_serial_init_and_sets_layer_weights():
    batch = _lm_batch()
    rng = jax.random.key(5)
    blocks, loss_layer = extract_reversible_blocks([_lm(), CrossEntropyLoss()])
    weights, state = init_reversible_blocks(blocks, loss_layer, _signature(batch), rng)
    other_blocks, other_loss = extract_reversible_blocks([_lm(), CrossEntropyLoss()])
    expected = Serial(blocks_to_layers(other_blocks, other_loss)).init(_signature(batch), rng)
    assert_trees_close((weights, state), expected, rtol=0, atol=0)
    assert len(weights) == len(blocks_to_layers(blocks, loss_layer))
    assert_trees_close(blocks[0][1][0].weights, weights[1], rtol=0, atol=0)


def test_flat_rng_contract():
    """Flat layer i gets split(rng, n)[i]: a layer-by-layer run equals Serial(*flat)."""
    batch = _stack_batch()
    blocks, loss_layer = extract_reversible_blocks(_stack(3, rate=0.5))
    init_reversible_blocks(blocks, loss_layer, _signature(batch), jax.random.key(0))
    flat = blocks_to_layers(blocks, loss_layer)
    rng = jax.random.key(9)
    stack = batch
    for layer, r in zip(flat, jax.random.split(rng, len(flat)), strict=True):
        n = layer.n_in
        y, _ = layer.pure_fn(stack[0] if n == 1 else tuple(stack[:n]), layer.weights,
                             layer.state, r)
        stack = (y if isinstance(y, tuple) else (y,)) + tuple(stack[n:])
    serial = Serial(flat)
    expected, _ = serial.pure_fn(batch, serial.weights, serial.state, rng)
    assert_trees_close(stack[0], expected)


def test_reconstruction_error_small_for_float32_and_exact_for_swaps():
    batch = _stack_batch()
    model = _stack(4)
    blocks, loss_layer = extract_reversible_blocks(model)
    init_reversible_blocks(blocks, loss_layer, _signature(batch), jax.random.key(0))
    errors = reconstruction_error(model, batch, jax.random.key(2))
    assert len(errors) == 8
    print(f"float32, 4 blocks: reconstruction errors {errors}")
    assert errors[7] == 0.0  # the top swap reverses the stored output exactly
    assert errors[1::2][:3] == errors[2::2]  # swaps pass the drift from above on unchanged
    assert 0.0 < max(errors) < 1e-5
    assert reconstruction_error((blocks, loss_layer), batch, jax.random.key(2)) == errors


class _LossyHalfResidual(ReversibleHalfResidual):
    """A deliberately wrong reverse (off by 1e-3 of the input): the check must see it."""

    def reverse(self, output, weights, state, new_state, rng):
        x = super().reverse(output, weights, state, new_state, rng)
        return (x[0] * (1 + 1e-3),) + tuple(x[1:])


def test_reconstruction_error_detects_a_bad_reverse_and_accumulates_along_the_block():
    model = [Dup(), ReversibleSerial(ReversibleHalfResidual(Dense(D)), ReversibleSwap(),
                                     _LossyHalfResidual(Dense(D))),
             Concatenate(), Dense(D), L2Loss()]
    batch = _stack_batch()
    Serial(model).init(_signature(batch), jax.random.key(0))
    errors = reconstruction_error(model, batch, jax.random.key(0))
    np.testing.assert_allclose(errors[2], 1e-3, rtol=0.05)
    assert errors[1] == errors[2]  # the swap passes the drift on unchanged
    assert errors[0] > 1e-5  # and the layer below inherits it


def test_bfloat16_residual_streams_drift():
    """The reason ReversibleTransformerLM keeps float32 streams: bf16 streams drift."""
    x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, D)).astype(jnp.bfloat16)
    batch = (x, jnp.zeros_like(x), jnp.ones_like(x))
    model = _stack(8, rate=0.0)
    Serial(model).init(_signature(batch), jax.random.key(0))
    errors = reconstruction_error(model, batch, jax.random.key(0))
    print(f"bf16 streams, 8 blocks: max reconstruction error {max(errors):.2e}")
    assert max(errors) > 1e-3


def test_reconstruction_error_requires_initialised_layers():
    with pytest.raises(ValueError, match="not initialised"):
        reconstruction_error(_stack(1), _stack_batch(), jax.random.key(0))


def test_reconstruction_error_on_lm_with_log_softmax_loss_layer():
    batch = _lm_batch()
    model = Serial(_lm(dropout=0.2), CrossEntropyLoss())
    model.init(_signature(batch), jax.random.key(3))
    errors = reconstruction_error(model, batch, jax.random.key(4))
    assert len(errors) == 8 and max(errors) < 1e-5
    assert isinstance(errors[0], float)


# --------------------------------------------------------------------------------------
# Edge cases.


def test_reconstruction_error_of_a_reversible_serial_needs_no_loss_layer():
    model = tl.ReversibleSerial(tl.ReversibleHalfResidual(tl.Dense(4), tl.Dropout(0.3)),
                                tl.ReversibleSwap(), tl.ReversibleHalfResidual(tl.Dense(4)))
    keys = jax.random.split(jax.random.key(0), 2)
    x = tuple(jax.random.normal(k, (2, 4)) for k in keys)
    model.init(x, rng=jax.random.key(1))
    errors = tl.reconstruction_error(model, x, jax.random.key(2))
    assert len(errors) == 3
    assert all(0.0 <= e < 1e-5 for e in errors)
    assert errors[0] > 0.0  # float32 drift of the first half-residual is measured
    # As a one-element list of layers too.
    assert tl.reconstruction_error([model], x, jax.random.key(2)) == errors


def test_reconstruction_error_of_nothing_is_a_clear_error():
    with pytest.raises(ValueError, match=r"got no layers"):
        tl.reconstruction_error([], jnp.ones(2), jax.random.key(0))


def test_nest_flat_values_rebuilds_the_model_tree_without_touching_layers():
    model = _lm()
    model.init(_signature(_lm_batch()[0]))
    blocks, loss = extract_reversible_blocks([model, tl.CrossEntropyLoss()])
    flat = blocks_to_layers(blocks, loss)
    before = jax.tree.map(np.array, model.weights)
    doubled = [jax.tree.map(lambda a: 2 * np.asarray(a), layer.weights) for layer in flat]
    nested = tl.nest_flat_values(model, flat, doubled)
    assert_trees_close(nested, jax.tree.map(lambda a: 2 * a, before))
    assert_trees_close(model.weights, before)  # The layer objects are untouched.
    with pytest.raises(ValueError, match=r"got 1 values for \d+ flat layers"):
        tl.nest_flat_values(model, flat, doubled[:1])
    with pytest.raises(ValueError, match=r"is in none of the flat layers"):
        tl.nest_flat_values(model, flat[:1], doubled[:1])


def test_nest_flat_values_gives_an_empty_series_the_empty_tree():
    # ReversibleTransformerLM(n_layers=0) trained, then failed at its first eval: its
    # empty ReversibleSerial flattens to no layer, so no flat value stands for it.
    from revtrain.models import ReversibleTransformerLM
    model = ReversibleTransformerLM(vocab_size=16, d_model=8, d_ff=16, n_layers=0,
                                    n_heads=2, max_len=8, mode="eval")
    model.init(_signature(np.zeros((2, 8), np.int32)))
    blocks, loss = extract_reversible_blocks([model, tl.CrossEntropyLoss()])
    flat = blocks_to_layers(blocks, loss)
    nested = tl.nest_flat_values(model, flat, [layer.weights for layer in flat])
    assert jax.tree.structure(nested) == jax.tree.structure(model.weights)
    assert_trees_close(nested, model.weights)


def _lm_tokens(depth: int, compute_dtype: str):
    """The issue's model: ReversibleTransformerLM d_model 64, d_ff 128, 4 heads, seq 64,
    batch 4, dropout 0, initialised; and its tokens."""
    from revtrain.models import ReversibleTransformerLM
    model = ReversibleTransformerLM(vocab_size=256, d_model=64, d_ff=128, n_layers=depth,
                                    n_heads=4, max_len=64, dropout=0.0,
                                    compute_dtype=compute_dtype)
    tokens = np.random.RandomState(0).randint(0, 256, (4, 64)).astype(np.int32)
    model.init(jax.ShapeDtypeStruct(tokens.shape, tokens.dtype), rng=jax.random.key(0))
    return model, tokens


def test_keep_every_bounds_bfloat16_drift_and_float32_stays_small():
    model, tokens = _lm_tokens(32, "bfloat16")
    drifting = reconstruction_error(model, tokens, jax.random.key(1))
    kept = reconstruction_error(model, tokens, jax.random.key(1), keep_every=8)
    print(f"bf16 compute, depth 32: worst {max(drifting):.2e}, keep_every=8 {max(kept):.2e}")
    assert max(drifting) > 1e-2 and max(kept) <= 1e-2
    assert kept[8::8] == [0.0] * len(kept[8::8])  # Restarted from the kept copies.
    model, tokens = _lm_tokens(64, "float32")
    assert max(reconstruction_error(model, tokens, jax.random.key(1))) <= 1e-4


def test_reconstruction_error_rejects_keep_every_below_one():
    model, tokens = _lm_tokens(1, "float32")
    with pytest.raises(ValueError, match="keep_every=0 must be >= 1"):
        reconstruction_error(model, tokens, jax.random.key(1), keep_every=0)
