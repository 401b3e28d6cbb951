"""Tests for revtrain.layers.sequence_parallel: the striped layout, the tracing context, and
the layers under a split -- a sharded forward (and reverse) pass equals the unsharded one,
and layers a shard cannot compute alone are one-line errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from revtrain.layers import (
    BatchNorm,
    CausalAttention,
    Concatenate,
    Conv,
    Dropout,
    Flatten,
    LayerError,
    LayerNorm,
    LogSoftmax,
    LSHCausalAttention,
    MaxPool,
    Mean,
    PositionalEncoding,
    ReversibleHalfResidual,
    ReversibleReshape,
    ShapeDtype,
    ShiftRight,
    Split,
    sequence_layout,
    sequence_sharded,
)
from revtrain.layers import sequence_parallel as sp
from revtrain.layers.position_tables import sinusoidal_encoding, sinusoidal_rows
from revtrain.models import ReversibleTransformerLM
from tests.tree_utils import assert_trees_close

N = 4
SPLIT = P(None, "seq")


def _mesh(n=N):
    return Mesh(np.array(jax.devices()[:n]), ("seq",))


def _sharded(fn, length, in_specs, out_specs, n=N):
    """``fn`` traced under ``sequence_sharded('seq', n, length)`` in a jitted shard_map."""
    def body(*args):
        with sequence_sharded("seq", n, length):
            return fn(*args)
    return jax.jit(jax.shard_map(body, mesh=_mesh(n), in_specs=in_specs, out_specs=out_specs))


def test_layout_is_striped_and_the_identity_on_one_shard():
    np.testing.assert_array_equal(sequence_layout(1, 5), np.arange(5))
    perm = sequence_layout(4, 12)
    np.testing.assert_array_equal(perm.reshape(4, 3), [[0, 4, 8], [1, 5, 9], [2, 6, 10],
                                                       [3, 7, 11]])
    with pytest.raises(ValueError, match=r"length 10 is not divisible by .* n_shards=4; use a "
                                         r"length that is a multiple of 4 \(e.g. 8 or 12\)"):
        sequence_layout(4, 10)
    with pytest.raises(ValueError, match="n_shards=0 must be a positive int"):
        sequence_layout(0, 8)


def test_the_context_is_set_while_tracing_and_restored_after():
    assert sp.current() is None
    with sequence_sharded("seq", 4, 64) as outer:
        assert sp.current() == outer == ("seq", 4, 64) and outer.local_length == 16
        with pytest.raises(RuntimeError), sequence_sharded("other", 1, 64):
            assert sp.current().axis_name == "other" and sp.split() is None
            raise RuntimeError
        assert sp.current() is outer and sp.split() is outer
    assert sp.current() is None and sp.split() is None
    with pytest.raises(ValueError, match="length 30 is not divisible"):
        sequence_sharded("seq", 4, 30).__enter__()
    with pytest.raises(ValueError, match="axis_name='' must be a mesh axis name"):
        sequence_sharded("", 4, 32).__enter__()


def _positions(n_shards, length):
    """This shard's ``local_positions()`` under ``sequence_sharded('seq', n_shards, ...)``,
    traced on the 4-device mesh."""
    def body(x):
        with sequence_sharded("seq", n_shards, length):
            return sp.current().local_positions()[None]
    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(SPLIT,), out_specs=SPLIT))(
        jnp.zeros((1, length)))


def test_local_positions_are_the_layout_s_rows_of_each_shard():
    np.testing.assert_array_equal(_positions(N, 32)[0], sequence_layout(N, 32))
    with pytest.raises(ValueError, match="n_shards=2 but mesh axis 'seq' has size 4; pass "
                                         "n_shards=4"):
        _positions(2, 32)


def test_sinusoidal_rows_at_positions_equal_the_table():
    length, d = 16384, 33
    positions = np.random.default_rng(0).integers(0, length, 300)
    np.testing.assert_allclose(sinusoidal_rows(jnp.asarray(positions), d, length),
                               sinusoidal_encoding(length, d)[positions], rtol=0, atol=1e-6)


def test_positional_encoding_under_the_split_adds_the_unsplit_rows():
    """Each shard computes its global positions' rows as the unsplit layer does: equal up
    to the float rounding of the two programs' fusions (FMA or not: 2 ulp of 1)."""
    length, d = 32, 12
    layer = PositionalEncoding(max_len=64)
    x = jnp.zeros((2, length, d))
    want = layer.pure_fn(x, (), (), None)[0]
    perm = sequence_layout(N, length)
    got = _sharded(lambda x: layer.pure_fn(x, (), (), None)[0], length, (SPLIT,), SPLIT)(
        x[:, perm])
    np.testing.assert_allclose(got, want[:, perm], rtol=0, atol=2.5e-7)


@pytest.mark.parametrize("widths", [{}, {"d_attention_key": 6, "d_attention_value": 10}])
def test_reversible_lm_sharded_forward_equals_unsharded(widths):
    """Embedding, the position table's rows at global positions, a reversible block with
    ring attention (at the default and at Trax's non-default per-head widths), the head
    (rotary positions: the reverse-pass test below)."""
    length = 128
    model = ReversibleTransformerLM(vocab_size=32, d_model=16, d_ff=32, n_layers=1,
                                    n_heads=2, max_len=length, dropout=0.0,
                                    attention_type=functools.partial(CausalAttention,
                                                                     block_size=8), **widths)
    model.init(ShapeDtype((2, length), jnp.int32), rng=jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(0), (2, length), 0, 32)
    perm = sequence_layout(N, length)

    def run(tokens, weights):
        return model.pure_fn(tokens, weights, model.state, None)[0]

    want = jax.jit(run)(tokens, model.weights)
    got = _sharded(run, length, (SPLIT, P()), SPLIT)(tokens[:, perm], model.weights)
    np.testing.assert_allclose(got, want[:, perm], rtol=0, atol=1e-5)


def test_reverse_pass_of_a_rotary_attention_block_with_dropout_reruns_the_ring():
    """``ReversibleHalfResidual(LayerNorm, CausalAttention(rotary, dropout))``:
    ``reverse_and_grad`` of the unsplit output, run under the split, rebuilds the input and
    gives the unsplit cotangents (``jax.grad`` inside ``shard_map`` sums the gradients of
    replicated weights over the shards itself); every shard gets the same key, so
    attention dropout drops alike."""
    length, d = 64, 16
    block = ReversibleHalfResidual(LayerNorm(), attention_layer=CausalAttention(
        d, n_heads=2, dropout=0.25, rotary=True, block_size=8))
    block.init((ShapeDtype((2, length, d), jnp.float32),) * 2, rng=jax.random.key(0))
    x = tuple(jax.random.normal(jax.random.key(i), (2, length, d)) for i in (1, 2))
    ct = tuple(jax.random.normal(jax.random.key(i), (2, length, d)) for i in (3, 4))
    rng = jax.random.key(5)
    forward = jax.jit(lambda x, rng: block.pure_fn(x, block.weights, block.state, rng))
    y, new_state = forward(x, rng)

    def reverse(y, weights, ct):
        return block.reverse_and_grad(y, ct, weights, block.state, new_state, rng)

    rebuilt, (x_ct, w_ct) = jax.jit(reverse)(y, block.weights, ct)
    perm = sequence_layout(N, length)
    rebuilt_s, (x_ct_s, w_ct_s) = _sharded(reverse, length, (SPLIT, P(), SPLIT),
                                           (SPLIT, (SPLIT, P())))(
        tuple(a[:, perm] for a in y), block.weights, tuple(a[:, perm] for a in ct))
    for got, want in [(rebuilt_s, x), (rebuilt_s, rebuilt), (x_ct_s, x_ct)]:
        assert_trees_close(got, tuple(a[:, perm] for a in want), rtol=0, atol=2e-5)
    assert_trees_close(w_ct_s, w_ct, rtol=1e-4, atol=1e-4)
    assert not np.allclose(y[0], forward(x, jax.random.key(6))[0][0], atol=1e-3)  # drops


def test_dropout_masks_differ_between_shards_unless_shared_along_the_length():
    length = 32

    def masks(x, layer):
        return layer.pure_fn(x, (), (), jax.random.key(0))[0]

    ones = jnp.ones((1, length, 8))
    for shared, same in [((), False), ((1,), True)]:
        y = _sharded(functools.partial(masks, layer=Dropout(0.5, shared_axes=shared)),
                     length, (SPLIT,), SPLIT)(ones)
        shards = np.asarray(y).reshape(1, N, length // N, 8)
        assert np.array_equal(shards[:, 0], shards[:, 1]) == same


def _lm_predict_encoding():
    """The decoding `PositionalEncoding` of a ``'predict'``-mode LM."""
    model = ReversibleTransformerLM(vocab_size=8, d_model=8, d_ff=8, n_layers=0, n_heads=1,
                                    max_len=16, mode="predict")
    pending = [model]
    while pending:
        layer = pending.pop()
        if layer.name == "PositionalEncoding":
            return layer
        pending.extend(layer.sublayers)
    raise AssertionError("no PositionalEncoding in the LM")


@pytest.mark.parametrize("layer, shape, message", [
    (lambda: LSHCausalAttention(8, chunk_len=4), (1, 4, 8), "LSHCausalAttention sorts"),
    (lambda: CausalAttention(8, mode="predict", max_len=16), (1, 4, 8),
     r"CausalAttention\(mode='predict'\) decodes"),
    (_lm_predict_encoding, (1, 4, 8), r"PositionalEncoding \(mode='predict'\) counts"),
    (ShiftRight, (1, 4, 8), "ShiftRight moves positions"),
    (lambda: Conv(2, (3,)), (1, 4, 8), "Conv slides windows"),
    (lambda: MaxPool((2,)), (1, 4, 8), "MaxPool slides windows"),
    (lambda: BatchNorm(axis=(0, 1)), (1, 4, 8), r"BatchNorm\(axis=\(0, 1\)\) averages"),
    (lambda: Mean(axis=1), (1, 4, 8), r"Mean\(axis=1\) averages"),
    (Flatten, (1, 4, 8), r"Flatten\(n_axes_to_keep=1\) merges axis 1"),
    (lambda: Concatenate(axis=1), ((1, 4, 8), (1, 4, 8)), r"Concatenate\(axis=1\) joins"),
    (lambda: Split(axis=1), (1, 4, 8), r"Split\(axis=1\) cuts"),
    (lambda: LogSoftmax(axis=1), (1, 4, 8), r"LogSoftmax\(axis=1\) normalises"),
    (lambda: ReversibleReshape((32,), (4, 8)), (1, 4, 8), "ReversibleReshape reshapes"),
    (lambda: CausalAttention(8), (1, 8, 8), "length-8 input .* give each device"),
])
def test_layers_a_shard_cannot_compute_alone_are_one_line_errors(layer, shape, message):
    layer = layer()
    nested = isinstance(shape[0], tuple)
    signature = (tuple(ShapeDtype(s, jnp.float32) for s in shape) if nested
                 else ShapeDtype(shape, jnp.float32))
    layer.init(signature, rng=jax.random.key(0))
    x = tuple(jnp.ones(s) for s in shape) if nested else jnp.ones(shape)
    with sequence_sharded("seq", 4, 16), pytest.raises(LayerError, match=message) as error:
        layer.pure_fn(x, layer.weights, layer.state, jax.random.key(1))
    assert "\n" not in str(error.value.original)
    assert "sequence_sharded(axis_name='seq', n_shards=4, length=16)" in str(error.value)


def test_rank_2_rows_are_not_taken_for_a_split_length():
    """A fused loss applies LogSoftmax to ``[positions, vocab]`` rows under the split."""
    rows = jnp.ones((16, 8))
    with sequence_sharded("seq", 4, 16):
        np.testing.assert_allclose(LogSoftmax().pure_fn(rows, (), (), None)[0],
                                   jnp.full((16, 8), -np.log(8)), rtol=1e-6)


def test_trace_split_finds_a_refusing_layer_and_passes_ring_attention():
    """The abstract trace sees each shard's length and raises the layer's own refusal; a
    model every layer of which accepts the split gives its per-shard output shapes."""
    x = ShapeDtype((2, 16, 8), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:N]).reshape(1, 1, N), ("data", "fsdp", "seq"))
    ring = CausalAttention(8, n_heads=2)
    ring.init(x, rng=jax.random.key(0))
    seen = []

    def forward(layer):
        def fn(batch, weights, state, rng):
            seen.append(batch.shape)
            return layer.pure_fn(batch, weights, state, rng)[0]
        return fn

    out = sp.trace_split(forward(ring), x, ring.weights, ring.state, jax.random.key(1),
                         mesh=mesh)
    assert seen == [(2, 16 // N, 8)] and out.shape == (2, 16 // N, 8)
    lsh = LSHCausalAttention(8, chunk_len=4)
    lsh.init(x, rng=jax.random.key(0))
    with pytest.raises(LayerError) as error:
        sp.trace_split(forward(lsh), x, lsh.weights, lsh.state, jax.random.key(1), mesh=mesh)
    assert isinstance(error.value.original, sp.SequenceSplitError)
    assert str(error.value.original).startswith(
        "LSHCausalAttention sorts positions into hash buckets along the length, which "
        "sequence_sharded(axis_name='seq', n_shards=4, length=16) splits over devices")
