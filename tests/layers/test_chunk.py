"""Tests for revtrain.layers.chunk: Chunk equals the unchunked layer, holds one chunk's
activations, and refuses what it cannot run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain import layers as tl

SDS = jax.ShapeDtypeStruct


def _ff(d=8, d_ff=32, dropout=0.0):
    return tl.Serial(tl.LayerNorm(), tl.Dense(d_ff), tl.Relu(), tl.Dropout(dropout),
                     tl.Dense(d))


def _pair(length, chunk_size, dropout=0.0):
    plain = _ff(dropout=dropout)
    weights, _ = plain.init(SDS((2, length, 8), jnp.float32), rng=jax.random.key(0))
    chunked = tl.Chunk(_ff(dropout=dropout), chunk_size)
    chunked.init(SDS((2, length, 8), jnp.float32), rng=jax.random.key(5))
    chunked.weights = (weights,)
    return plain, chunked


@pytest.mark.parametrize("length, chunk_size", [(12, 4), (13, 4), (5, 8), (1, 3), (64, 7)])
def test_chunked_equals_unchunked_in_outputs_and_gradients(length, chunk_size):
    plain, chunked = _pair(length, chunk_size)
    x = jax.random.normal(jax.random.key(1), (2, length, 8))
    ct = jax.random.normal(jax.random.key(2), (2, length, 8))

    def run(layer, weights, x):
        return layer.pure_fn(x, weights, layer.state, None)[0]

    y, vjp = jax.vjp(lambda w, x: run(plain, w, x), plain.weights, x)
    y_c, vjp_c = jax.vjp(lambda w, x: run(chunked, w, x), chunked.weights, x)
    np.testing.assert_allclose(y_c, y, rtol=1e-6, atol=1e-6)
    (dw, dx), ((dw_c,), dx_c) = vjp(ct), vjp_c(ct)
    np.testing.assert_allclose(dx_c, dx, rtol=1e-6, atol=1e-6)
    # A weight gradient sums over every row; chunked, it is a sum of per-chunk sums, which
    # rounds differently, so an entry near zero is compared against its leaf's scale.
    for a, b in zip(jax.tree.leaves(dw_c), jax.tree.leaves(dw), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))


def test_dropout_masks_are_drawn_per_chunk_and_repeat_with_the_key():
    _, chunked = _pair(16, 4, dropout=0.5)
    x = jnp.ones((2, 16, 8))
    a = chunked.pure_fn(x, chunked.weights, chunked.state, jax.random.key(0))[0]
    b = chunked.pure_fn(x, chunked.weights, chunked.state, jax.random.key(0))[0]
    np.testing.assert_array_equal(a, b)
    chunks = np.asarray(a).reshape(2, 4, 4, 8)
    assert not np.allclose(chunks[:, 0], chunks[:, 1])  # Not one mask repeated per chunk.


def test_the_gradient_program_holds_one_chunk_of_the_hidden_activation():
    length, d_ff = 4096, 512

    def temp_bytes(layer):
        layer.init(SDS((1, length, 8), jnp.float32), rng=jax.random.key(0))

        def loss(w, x):
            return jnp.sum(layer.pure_fn(x, w, layer.state, None)[0] ** 2)
        x = jnp.ones((1, length, 8))
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(layer.weights, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    hidden = 4 * length * d_ff  # one float32 [1, length, d_ff] buffer
    whole = temp_bytes(_ff(d_ff=d_ff))
    chunked = temp_bytes(tl.Chunk(_ff(d_ff=d_ff), 256))
    assert whole >= 2 * hidden  # the activation and its cotangent, at least
    assert chunked < hidden / 2 and chunked < whole / 8


@pytest.mark.parametrize("chunk_size", [0, -2, 1.5, True, None])
def test_bad_chunk_size_is_a_one_line_error(chunk_size):
    with pytest.raises(ValueError, match=f"chunk_size={chunk_size!r} must be a positive int"):
        tl.Chunk(_ff(), chunk_size)


def test_layers_it_cannot_chunk_are_refused():
    with pytest.raises(ValueError, match="inputs and one output"):
        tl.Chunk(tl.Dup(), 4)
    with pytest.raises(tl.LayerError, match="keeps state"):
        tl.Chunk(tl.BatchNorm(), 4).init(SDS((2, 8, 4), jnp.float32))


def test_several_inputs_are_chunked_alike():
    layer = tl.Serial(tl.Concatenate(), tl.LayerNorm())
    chunked = tl.Chunk(tl.Serial(tl.Concatenate(), tl.LayerNorm()), 3)
    a, b = (jax.random.normal(jax.random.key(i), (2, 10, 4)) for i in range(2))
    signature = (SDS(a.shape, a.dtype),) * 2
    layer.init(signature, rng=jax.random.key(0))
    chunked.init(signature, rng=jax.random.key(0))
    chunked.weights = (layer.weights,)
    assert chunked.n_in == 2
    np.testing.assert_allclose(chunked((a, b)), layer((a, b)), rtol=1e-6, atol=1e-6)
    with pytest.raises(tl.LayerError, match="one batch and length"):
        chunked((a, b[:, :9]))
