"""Tests for revtrain.layers.position_chunks: a half-residual's reverse over chunks of
positions equals the whole reverse (reconstruct, then the vjp of ``pure_fn``) at chunk
sizes that divide the length, that do not, and that exceed it -- attention (blockwise,
full, LSH; rotary, dropout, Trax's widths) and chunked feed-forward with dropout -- falls
back to the whole pass where it cannot chunk, and holds fewer temporaries."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain import layers as tl
from revtrain.layers import (
    Chunk,
    Dense,
    Dropout,
    LayerNorm,
    Relu,
    ReversibleHalfResidual,
    ReversibleLayer,
    Serial,
    position_chunks,
)
from revtrain.layers.position_chunks import over_chunks
from revtrain.models.transformer import _Cast
from tests.tree_utils import assert_trees_close

B, L, D = 2, 37, 8


def _attention(kind):
    if kind == "lsh":
        return tl.LSHCausalAttention(D, n_heads=2, dropout=0.2, chunk_len=4, n_hashes=2,
                                     rotary=True)
    return tl.CausalAttention(D, n_heads=2, dropout=0.3, rotary=True, implementation=kind,
                              block_size=8, d_attention_key=6, d_attention_value=2)


def _feed_forward(chunk=5):
    return Chunk(Serial(LayerNorm(), Dense(16), Relu(), Dropout(0.3), Dense(D),
                        Dropout(0.3)), chunk)


def _whole_and_chunked(block, length=L):
    """``(whole, chunked)``: the base class's reverse_and_grad (reverse, then the vjp of
    pure_fn) and the block's own, jitted, on random outputs and cotangents."""
    block.init((jax.ShapeDtypeStruct((B, length, D), jnp.float32),) * 2, rng=jax.random.key(0))
    x = tuple(jax.random.normal(jax.random.key(i), (B, length, D)) for i in (1, 2))
    ct = tuple(jax.random.normal(jax.random.key(i), (B, length, D)) for i in (3, 4))
    rng = jax.random.key(5)
    y, new_state = block.pure_fn(x, block.weights, block.state, rng)

    def run(method):
        return jax.jit(lambda y, ct, w: method(block, y, ct, w, block.state, new_state,
                                               rng))(y, ct, block.weights)

    whole = run(ReversibleLayer.reverse_and_grad)
    chunked = run(type(block).reverse_and_grad)
    np.testing.assert_allclose(chunked[0][0], x[0], atol=1e-5)   # reconstructs the input
    return whole, chunked


@pytest.mark.parametrize("kind", ["blockwise", "xla", "lsh"])
@pytest.mark.parametrize("chunk_size", [5, 8, L, 64])
def test_chunked_attention_reverse_equals_the_whole_reverse(kind, chunk_size):
    """5 does not divide 37 (a short last chunk), 37 is the length, 64 exceeds it."""
    block = ReversibleHalfResidual(LayerNorm(), attention_layer=_attention(kind),
                                   chunk_size=chunk_size)
    whole, chunked = _whole_and_chunked(block)
    assert_trees_close(chunked, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_chunked_feed_forward_reverse_draws_the_chunk_layers_dropout_masks(chunk_size):
    """A Chunk sets the size (or must equal chunk_size); its dropout keys are per chunk,
    so the reverse must run exactly its chunks, the short last one padded."""
    block = ReversibleHalfResidual(_feed_forward(5), chunk_size=chunk_size)
    whole, chunked = _whole_and_chunked(block)
    assert_trees_close(chunked, whole, rtol=1e-5, atol=1e-5)


def test_where_it_cannot_chunk_it_runs_whole(monkeypatch):
    """A bfloat16 compute part (the heads' outputs would be rounded differently) and a
    non-position-wise compute layer run the whole reverse."""
    def refuse(*args):
        raise AssertionError("chunked where it should not be")

    monkeypatch.setattr(position_chunks, "chunked_reverse_and_grad", refuse)
    for block in (ReversibleHalfResidual(LayerNorm(), _Cast(jnp.bfloat16),
                                         attention_layer=_attention("blockwise"), chunk_size=8),
                  ReversibleHalfResidual(LayerNorm(), Dropout(0.5), chunk_size=8)):
        whole, chunked = _whole_and_chunked(block)
        assert_trees_close(chunked, whole, rtol=1e-2, atol=1e-2)


def test_a_chunk_size_other_than_the_chunk_layers_is_an_error():
    with pytest.raises(ValueError, match=r"chunk_size=4 differs from the chunk size \[5\]"):
        ReversibleHalfResidual(_feed_forward(5), chunk_size=4)
    with pytest.raises(ValueError, match=r"chunk_size=0 must be a positive int"):
        ReversibleHalfResidual(LayerNorm(), chunk_size=0)


def test_over_chunks_visits_every_position_once():
    def body(seen, index, start, n):
        return seen.at[start + jnp.arange(n)].add(1 + index * 0)

    for length, size in [(37, 5), (40, 8), (3, 8)]:
        seen = over_chunks(length, min(size, length), body, jnp.zeros(length + 8, jnp.int32))
        np.testing.assert_array_equal(seen, [1] * length + [0] * 8)


@pytest.mark.parametrize("kind", ["blockwise", "lsh"])
def test_the_chunked_reverse_holds_fewer_temporaries(kind):
    """XLA's memory_analysis of the reverse program at 4,096 positions: chunking removes
    the full-length position-wise temporaries (LayerNorm output and cotangent, head sum,
    ...), leaving one head's projections, core output and cotangents."""
    length, d = 4096, 64
    attention = (tl.LSHCausalAttention(d, n_heads=4, chunk_len=64, n_hashes=2)
                 if kind == "lsh" else tl.CausalAttention(d, n_heads=4,
                                                          implementation="blockwise"))

    def temp_bytes(chunk_size):
        block = ReversibleHalfResidual(LayerNorm(), attention_layer=attention,
                                       chunk_size=chunk_size)
        block.init((jax.ShapeDtypeStruct((1, length, d), jnp.float32),) * 2,
                   rng=jax.random.key(0))
        y = (jnp.zeros((1, length, d)),) * 2
        run = jax.jit(lambda y, ct, w: block.reverse_and_grad(y, ct, w, block.state,
                                                              block.state, jax.random.key(1)))
        return run.lower(y, y, block.weights).compile().memory_analysis().temp_size_in_bytes

    full = length * d * 4   # one [1, length, d_model] float32 array
    whole, chunked = temp_bytes(None), temp_bytes(512)
    assert chunked < whole - 2 * full, (whole / full, chunked / full)
