"""Tests for revtrain.layers.attention.ring: on 4 (and 2) devices over a sequence split
striped over a mesh axis, equal to one-device blockwise attention in outputs and in every
gradient, dropout and padding included, with every shard doing the same causal work."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from revtrain.layers import (
    blockwise_attention,
    einsum_attention,
    ring_attention,
    sequence_layout,
    sequence_sharded,
)
from revtrain.layers.dropout_masks import mask_seed, position_keep_mask
from revtrain.layers.sequence_parallel import ring_block_counts

SPLIT = P(None, "seq")


def _qkv(length, batch=2, heads=2, d_head=8, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(key, (batch, length, heads, d_head), dtype) for key in keys)


def _ring(n_shards, **kwargs):
    """``ring_attention`` over an ``n_shards`` mesh, on whole (already striped) arrays."""
    mesh = Mesh(np.array(jax.devices()[:n_shards]), ("seq",))
    body = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq", **kwargs),
                         mesh=mesh, in_specs=(SPLIT,) * 3, out_specs=SPLIT)
    return jax.jit(body)


def _compare(length, n_shards=4, block_size=16, atol=1e-5, dtype=jnp.float32, **kwargs):
    q, k, v, ct = _qkv(length, dtype=dtype)
    perm = sequence_layout(n_shards, length)
    out, vjp = jax.vjp(_ring(n_shards, block_size=block_size, **kwargs),
                       q[:, perm], k[:, perm], v[:, perm])
    ref, ref_vjp = jax.vjp(jax.jit(lambda q, k, v: blockwise_attention(
        q, k, v, block_size=block_size, **kwargs)), q, k, v)
    f32 = np.float32
    np.testing.assert_allclose(np.asarray(out, f32), np.asarray(ref, f32)[:, perm], rtol=0,
                               atol=atol)
    for name, got, want in zip("qkv", vjp(ct[:, perm]), ref_vjp(ct), strict=True):
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, f32), np.asarray(want, f32)[:, perm],
                                   rtol=0, atol=atol, err_msg=f"d{name}")


def test_equals_one_device_blockwise_attention_in_outputs_and_gradients():
    _compare(464, block_size=32)   # 116 rows per shard: 4 blocks, the last one padded


def test_bfloat16_inputs_accumulate_in_float32_across_the_ring():
    _compare(256, dtype=jnp.bfloat16, atol=3e-2)


def test_strided_blocks_of_the_dropout_mask_are_the_whole_mask_s_elements():
    """Ring attention's blocks hold rows and columns ``n`` apart: their keep bits are the
    whole matrix's at those global positions, so the split cannot change them (8-bit
    lanes here; the reverse-pass test of `test_sequence_parallel` runs the ring with
    16-bit dropout masks against the unsplit layer)."""
    mask_bits = 8
    shape, length, n = (2, 3, 40, 40), 40, 4
    row, col, rows, cols = 6, 5, 7, 9

    @jax.jit
    def masks(seed):
        return (position_keep_mask(seed, shape, 0, 0, length, 0.25, mask_bits),
                position_keep_mask(seed, shape[:2] + (rows, cols), row, col, length, 0.25,
                                   mask_bits, stride=n))

    whole, part = masks(mask_seed(jax.random.key(4)))
    np.testing.assert_array_equal(part, whole[:, :, row:row + rows * n:n,
                                              col:col + cols * n:n])


def test_striped_layout_gives_every_shard_the_same_work_at_every_step():
    """The imbalance figure: block pairs needing work per shard per ring step, max over
    shards / mean. Striped: 1 at every step, and exactly the kernel's nb (nb + 1) / 2
    visits; contiguous shards: the last step waits for one shard doing n times the mean."""
    n, length, block = 4, 1024, 32
    nb = length // n // block
    striped = ring_block_counts(sequence_layout(n, length), n, block)
    assert (striped == nb * (nb + 1) // 2).all()
    contiguous = ring_block_counts(np.arange(length), n, block)
    assert contiguous.max(1)[-1] / contiguous.mean(1)[-1] == n
    slowdown = contiguous.max(1).sum() / contiguous.mean(1).sum()
    assert slowdown > 1.7
    assert contiguous.sum() < striped.sum()   # fewer visits, but on the wrong shards


def test_outside_shard_map_and_direct_one_device_kernels_under_a_split_are_errors():
    q, k, v, _ = _qkv(16)
    with pytest.raises(ValueError, match="runs inside shard_map over that mesh axis"):
        ring_attention(q, k, v, axis_name="seq")
    with sequence_sharded("seq", 4, 64):
        with pytest.raises(ValueError, match="blockwise_attention attends to keys along the "
                                             "length.*use revtrain.layers.attention.ring"):
            blockwise_attention(q, k, v)
        with pytest.raises(ValueError, match="einsum_attention attends"):
            einsum_attention(q, k, v, is_causal=True)


def test_bad_arguments_are_refused_as_blockwise_attention_refuses_them():
    q, k, v, _ = _qkv(16)
    with pytest.raises(ValueError, match="block_size=0 must be a positive"):
        ring_attention(q, k, v, axis_name="seq", block_size=0)
    with pytest.raises(ValueError, match="alike"):
        ring_attention(q, k[:, :8], v, axis_name="seq")
    with pytest.raises(ValueError, match="needs an rng"):
        _ring(4, dropout_rate=0.1)(q, k, v)
