"""Tests for revtrain.layers.attention.blockwise: exact against the full path, in outputs and
every gradient, dropout included, with memory and program size that do not grow as the
full path's do."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from revtrain.layers import einsum_attention
from revtrain.layers.attention.blockwise import blockwise_attention
from revtrain.layers.dropout_masks import mask_seed, position_keep_mask, quantised_rate


def _qkv(length, batch=2, heads=2, d_head=8, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, ct = (jax.random.normal(key, (batch, length, heads, d_head), dtype)
                   for key in keys)
    return q, k, v, ct


def _full(q, k, v, rate=0.0, rng=None):
    return einsum_attention(q, k, v, None, rate, rng, is_causal=True)


def _blockwise(block_size, rate=0.0, rng=None):
    return lambda q, k, v: blockwise_attention(q, k, v, block_size=block_size,
                                               dropout_rate=rate, rng=rng)


def _compare(length, block_size, rate=0.0, batch=2, heads=2, atol=1e-5):
    q, k, v, ct = _qkv(length, batch, heads)
    rng = jax.random.key(3)
    out, vjp = jax.vjp(_blockwise(block_size, rate, rng), q, k, v)
    ref, ref_vjp = jax.vjp(lambda q, k, v: _full(q, k, v, rate, rng), q, k, v)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=atol)
    for name, got, want in zip("qkv", vjp(ct), ref_vjp(ct), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol, err_msg=f"d{name}")


@pytest.mark.parametrize("length, block_size", [
    (1, 4), (7, 7), (7, 3), (128, 32), (128, 48), (1000, 128), (1000, 100)])
def test_equals_full_attention_in_outputs_and_gradients(length, block_size):
    _compare(length, block_size)


def test_equals_full_attention_at_4096():
    _compare(4096, 512, batch=1, heads=1)
    _compare(4096, 700, batch=1, heads=1)


@pytest.mark.parametrize("block_size", [5, 16, 64])
def test_dropout_equals_full_attention_with_the_same_key_for_any_block_size(block_size):
    """Masks are drawn per element from its global (row, column): the block size cannot
    change them, so the full path is the reference."""
    _compare(64, block_size, rate=0.3)


def test_dropout_drops_and_depends_on_the_key():
    q, k, v, _ = _qkv(32)
    plain = _blockwise(8)(q, k, v)
    dropped = _blockwise(8, 0.5, jax.random.key(0))(q, k, v)
    again = _blockwise(8, 0.5, jax.random.key(0))(q, k, v)
    other = _blockwise(8, 0.5, jax.random.key(1))(q, k, v)
    np.testing.assert_array_equal(dropped, again)
    assert not np.allclose(dropped, plain, atol=1e-3)
    assert not np.allclose(dropped, other, atol=1e-3)


@pytest.mark.parametrize("mask_bits", [8, 16])
def test_position_masks_of_blocks_tile_the_whole_mask(mask_bits):
    seed = mask_seed(jax.random.key(4))
    shape, length = (2, 3, 40, 40), 40
    whole = position_keep_mask(seed, shape, 0, 0, length, 0.25, mask_bits)
    for row, col, rows, cols in [(0, 0, 7, 9), (13, 5, 11, 17), (33, 31, 7, 9)]:
        part = position_keep_mask(seed, shape[:2] + (rows, cols), row, col, length, 0.25,
                                  mask_bits)
        np.testing.assert_array_equal(part, whole[:, :, row:row + rows, col:col + cols])
    big = position_keep_mask(seed, (4, 4, 256, 256), 0, 0, 256, 0.25, mask_bits)
    assert 1 - float(jnp.mean(big)) == pytest.approx(quantised_rate(0.25, mask_bits),
                                                     abs=0.01)


def test_check_grads_second_order_free_first_order():
    q, k, v, _ = _qkv(10, batch=1, heads=1, d_head=4, dtype=jnp.float32)
    check_grads(_blockwise(4), (q, k, v), order=1, modes=["rev"], atol=2e-2, rtol=2e-2)


def test_bfloat16_inputs_accumulate_in_float32():
    q, k, v, _ = _qkv(200, dtype=jnp.float32)
    out = blockwise_attention(*(a.astype(jnp.bfloat16) for a in (q, k, v)), block_size=64)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), _full(q, k, v), atol=3e-2)


def _grad_program(fn, length):
    q, k, v, _ = _qkv(length, batch=1, heads=2, d_head=16)

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v) ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v)


def test_the_gradient_program_holds_no_length_by_length_buffer():
    length = 4096
    square = 4 * 2 * length * length  # float32 [batch=1, heads=2, length, length]
    full = _grad_program(_full, length).compile().memory_analysis().temp_size_in_bytes
    blockwise = _grad_program(_blockwise(256), length).compile().memory_analysis()
    assert full >= square
    assert blockwise.temp_size_in_bytes < square / 16


def test_the_program_does_not_grow_with_the_length():
    """Loops over blocks: 4K and 64K lower to programs of the same size (so compile time
    does not grow with the length)."""
    sizes = [len(_grad_program(_blockwise(512), n).as_text().splitlines())
             for n in (4096, 65536)]
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("block_size", [0, -1, 2.5, True, "8"])
def test_bad_block_size_is_a_one_line_error(block_size):
    q, k, v, _ = _qkv(8)
    with pytest.raises(ValueError, match=f"block_size={block_size!r} must be a positive"):
        blockwise_attention(q, k, v, block_size=block_size)


def test_dropout_without_rng_and_mismatched_shapes_are_errors():
    q, k, v, _ = _qkv(8)
    with pytest.raises(ValueError, match="needs an rng"):
        blockwise_attention(q, k, v, dropout_rate=0.1)
    with pytest.raises(ValueError, match="alike"):
        blockwise_attention(q, k[:, :4], v)


def test_a_call_per_head_draws_the_masks_of_one_call_over_all_heads():
    q, k, v, _ = _qkv(24, heads=3)
    rng = jax.random.key(6)
    whole = blockwise_attention(q, k, v, block_size=8, dropout_rate=0.4, rng=rng)
    for h in range(3):
        one = blockwise_attention(q[:, :, h:h + 1], k[:, :, h:h + 1], v[:, :, h:h + 1],
                                  block_size=8, dropout_rate=0.4, rng=rng, head_start=h,
                                  total_heads=3)
        np.testing.assert_allclose(one[:, :, 0], whole[:, :, h], rtol=1e-6, atol=1e-6)


def test_replicated_operands_inside_shard_map_get_summed_cotangents():
    """A replicated k/v beside per-device queries: the cotangents keep their types (the
    kernel casts them to varying, and autodiff sums over the axis)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:2]), ("batch",))
    q = jax.random.normal(jax.random.key(1), (4, 11, 2, 4))
    kv = jax.random.normal(jax.random.key(0), (2, 11, 2, 4))
    q_sharded = jax.device_put(q, NamedSharding(mesh, P("batch")))
    kv_replicated = jax.device_put(kv, NamedSharding(mesh, P()))

    def grads(q, kv):
        return jax.grad(lambda q, kv: blockwise_attention(q, kv, kv, block_size=4).sum(),
                        (0, 1))(q, kv)

    dq, dkv = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P("batch"), P()),
                                    out_specs=(P("batch"), P())))(q_sharded, kv_replicated)
    ref_dq, ref_dkv = jax.grad(lambda q, kv: sum(
        _full(q[2 * d:2 * d + 2], kv, kv).sum() for d in range(2)), (0, 1))(q, kv)
    np.testing.assert_allclose(dq, ref_dq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dkv, ref_dkv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dropout_rate=1.0), "rate=1.0 must be in"), (dict(dropout_rate=-0.1), "must be in"),
])
def test_bad_dropout_rates_are_refused(kwargs, message):
    q, k, v, _ = _qkv(8)
    with pytest.raises(ValueError, match=message):
        blockwise_attention(q, k, v, rng=jax.random.key(0), **kwargs)


def test_integer_and_empty_inputs_are_refused():
    q, k, v, _ = _qkv(8)
    with pytest.raises(ValueError, match="needs float q, k, v"):
        blockwise_attention(q.astype(jnp.int32), k, v)
    with pytest.raises(ValueError, match="length-0"):
        blockwise_attention(q[:, :0], k[:, :0], v[:, :0])
