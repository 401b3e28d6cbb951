"""LSHCausalAttention: the dense limit, the chunked kernel against a dense reference of the
same rules, invariants (loop grouping, rng, hash_seed, values after a position), dropout,
predict mode, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from revtrain import layers as tl
from revtrain.layers.attention import lsh as la
from revtrain.layers.attention import lsh_chunks
from revtrain.models import TransformerLM

D, HEADS = 16, 2


def _init(layer, x):
    weights, state = layer.init(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.random.key(0))
    return jax.tree.map(lambda w: w.astype(x.dtype), weights), state


def _dense_reference(x, weights, length):
    """The rules written out over the whole sequence: shared query/key (keys normalised),
    causal by position, a position's own logit lowered by 1e5."""
    qk = (x @ weights[0][0] + weights[0][1]).reshape(x.shape[0], length, HEADS, -1)
    v = (x @ weights[1][0] + weights[1][1]).reshape(x.shape[0], length, HEADS, -1)
    k = qk / jnp.sqrt(jnp.sum(qk ** 2, -1, keepdims=True) + 1e-6)
    s = jnp.einsum("bqhd,bkhd->bhqk", qk, k) / np.sqrt(qk.shape[-1])
    rows, cols = np.arange(length)[:, None], np.arange(length)[None, :]
    s = jnp.where(cols <= rows, s, -jnp.inf) - 1e5 * (cols == rows)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(
        x.shape[0], length, -1)
    return out @ weights[2][0] + weights[2][1]


@pytest.mark.parametrize("length,chunk_len,n_hashes,n_chunks_before,widths",
                         [(40, 64, 1, 1, {}), (40, 40, 3, 0, {}), (33, 48, 2, 2, {}),
                          (40, 64, 2, 1, {"d_attention_key": 6, "d_attention_value": 10})])
def test_one_chunk_equals_the_dense_reference_outputs_and_gradients(
        length, chunk_len, n_hashes, n_chunks_before, widths):
    """The last case: Trax's per-head widths, keys narrower and values wider than
    d_feature // n_heads (weights [16, 12], [16, 20], [20, 16])."""
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(1), (2, length, D), jnp.float64)
        layer = tl.LSHCausalAttention(D, n_heads=HEADS, chunk_len=chunk_len,
                                      n_hashes=n_hashes, n_chunks_before=n_chunks_before,
                                      **widths)
        weights, state = _init(layer, x)
        if widths:
            assert [w.shape for w, _ in weights] == [(D, 12), (D, 20), (20, D)]

        def lsh(x, w):
            return jnp.sum(jnp.sin(layer.pure_fn(x, w, state, jax.random.key(3))[0]))

        def dense(x, w):
            return jnp.sum(jnp.sin(_dense_reference(x, w, length)))

        y = layer.pure_fn(x, weights, state, jax.random.key(3))[0]
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(y, _dense_reference(x, weights, length), atol=1e-5)
        got = jax.grad(lsh, argnums=(0, 1))(x, weights)
        want = jax.grad(dense, argnums=(0, 1))(x, weights)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


def _round_reference(qk, v, rotations, chunk_len, n_chunks_before):
    """One round written densely: query ``i`` sees key ``j`` when ``j``'s sorted chunk is
    ``i``'s or one of the ``n_chunks_before`` before it, and ``pos_j <= pos_i``."""
    batch, length, _ = qk.shape
    buckets = la.hash_buckets(qk, rotations)
    order = jnp.stack([jnp.lexsort((jnp.arange(length), b)) for b in buckets])
    chunk = jnp.zeros_like(order).at[jnp.arange(batch)[:, None], order].set(
        jnp.arange(length) // chunk_len)
    k = qk / jnp.sqrt(jnp.sum(qk ** 2, -1, keepdims=True) + 1e-6)
    s = jnp.einsum("bqd,bkd->bqk", qk, k) / np.sqrt(qk.shape[-1])
    rows, cols = np.arange(length)[:, None], np.arange(length)[None, :]
    near = (chunk[:, None, :] <= chunk[:, :, None]) & (
        chunk[:, None, :] >= chunk[:, :, None] - n_chunks_before)
    s = jnp.where(near & (cols <= rows), s, -jnp.inf) - 1e5 * (cols == rows)
    lse = jax.nn.logsumexp(s, -1)
    return jnp.einsum("bqk,bkd->bqd", jnp.exp(s - lse[..., None]), v), lse


@pytest.mark.parametrize("length,chunk_len,n_chunks_before,group_rows,d_value",
                         [(64, 8, 1, 16, 8), (61, 8, 1, 8, 8), (64, 4, 2, 4096, 8),
                          (50, 8, 0, 24, 8), (61, 8, 1, 8, 3)])
def test_a_round_equals_its_dense_reference(monkeypatch, length, chunk_len,
                                            n_chunks_before, group_rows, d_value):
    """Many chunks, padding (61, 50), several loop groups (_GROUP_ROWS small) and one;
    values of another width than the keys (3)."""
    monkeypatch.setattr(lsh_chunks, "_GROUP_ROWS", group_rows)
    qk = jax.random.normal(jax.random.key(1), (2, length, 8))
    v = jax.random.normal(jax.random.key(2), (2, length, d_value))
    rotations = [jax.random.normal(jax.random.key(4), (8, 2)),
                 jax.random.normal(jax.random.key(5), (8, 1))]  # 4 x 2 buckets

    def lsh(qk, v):
        return la.lsh_round(qk, v, rotations, chunk_len=chunk_len,
                            n_chunks_before=n_chunks_before)

    def ref(qk, v):
        return _round_reference(qk, v, rotations, chunk_len, n_chunks_before)

    (out, lse), (out_ref, lse_ref) = lsh(qk, v), ref(qk, v)
    np.testing.assert_allclose(out, out_ref, atol=2e-5)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-6, atol=2e-5)

    def loss(f):
        return lambda qk, v: jnp.sum(jnp.sin(f(qk, v)[0])) + jnp.sum(
            jnp.cos(f(qk, v)[1] / 10))

    got = jax.grad(loss(lsh), argnums=(0, 1))(qk, v)
    want = jax.grad(loss(ref), argnums=(0, 1))(qk, v)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=5e-5)


def test_outputs_do_not_depend_on_the_values_of_later_positions():
    qk = jax.random.normal(jax.random.key(1), (1, 48, 8))
    v = jax.random.normal(jax.random.key(2), (1, 48, 8))
    rotations = [jax.random.normal(jax.random.key(4), (8, 4))]
    before, _ = la.lsh_round(qk, v, rotations, chunk_len=8, n_chunks_before=1)
    after, _ = la.lsh_round(qk, v.at[:, 30:].set(100.0), rotations, chunk_len=8,
                            n_chunks_before=1)
    np.testing.assert_array_equal(before[:, :30], after[:, :30])
    assert not np.allclose(before[:, 30:], after[:, 30:])


def _layer_output(layer, x, rng, weights=None):
    w, state = _init(layer, x) if weights is None else (weights, ())
    return layer.pure_fn(x, w, state, rng)[0]


def test_loop_grouping_changes_nothing(monkeypatch):
    x = jax.random.normal(jax.random.key(1), (2, 96, D))
    layer = tl.LSHCausalAttention(D, n_heads=HEADS, chunk_len=8, n_hashes=2, dropout=0.2)
    one = _layer_output(layer, x, jax.random.key(7))
    monkeypatch.setattr(lsh_chunks, "_GROUP_ROWS", 16)
    np.testing.assert_allclose(_layer_output(layer, x, jax.random.key(7)), one, atol=1e-6)


def test_the_hash_comes_from_the_rng_unless_a_hash_seed_fixes_it():
    x = jax.random.normal(jax.random.key(1), (1, 128, D))
    layer = tl.LSHCausalAttention(D, n_heads=HEADS, chunk_len=8, n_hashes=1, mode="eval")
    a, b = (_layer_output(layer, x, jax.random.key(s)) for s in (1, 2))
    np.testing.assert_array_equal(_layer_output(layer, x, jax.random.key(1)), a)
    assert not np.allclose(a, b)
    fixed = tl.LSHCausalAttention(D, n_heads=HEADS, chunk_len=8, mode="eval", hash_seed=5)
    np.testing.assert_array_equal(_layer_output(fixed, x, jax.random.key(1)),
                                  _layer_output(fixed, x, jax.random.key(2)))
    np.testing.assert_array_equal(_layer_output(fixed, x, None),
                                  _layer_output(fixed, x, jax.random.key(2)))


def test_dropout_is_deterministic_per_key_and_its_gradients_check():
    x = jax.random.normal(jax.random.key(1), (2, 40, D))
    layer = tl.LSHCausalAttention(D, n_heads=HEADS, chunk_len=8, n_hashes=2, dropout=0.25)
    weights, state = _init(layer, x)
    y = layer.pure_fn(x, weights, state, jax.random.key(3))[0]
    np.testing.assert_array_equal(layer.pure_fn(x, weights, state, jax.random.key(3))[0], y)
    evaluated = tl.LSHCausalAttention(D, n_heads=HEADS, chunk_len=8, n_hashes=2,
                                      dropout=0.25, mode="eval")
    undropped = evaluated.pure_fn(x, weights, state, jax.random.key(3))[0]
    assert not np.allclose(y, undropped)  # the same hash (same key), dropout only in train
    f = lambda x: jnp.sum(jnp.sin(layer.pure_fn(x, weights, state, jax.random.key(3))[0]))
    check_grads(f, (x,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


def test_sort_order_sorts_by_bucket_then_position_on_both_key_paths():
    rs = np.random.RandomState(0)
    for n_buckets, length in ((8, 100), (2 ** 16, 2 ** 17)):  # uint32 key; the pair
        buckets = jnp.asarray(rs.randint(0, n_buckets, (2, length)), jnp.int32)
        order, inverse = la.sort_order(buckets, n_buckets)
        want = np.stack([np.lexsort((np.arange(length), b)) for b in np.asarray(buckets)])
        np.testing.assert_array_equal(order, want)
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(order), inverse, 1),
                                      np.broadcast_to(np.arange(length), (2, length)))


def test_permute_gradient_is_the_inverse_gather():
    x = jax.random.normal(jax.random.key(0), (2, 10, 3))
    order = jnp.stack([jax.random.permutation(jax.random.key(s), 10) for s in (1, 2)])
    inverse = jnp.argsort(order, axis=1)
    f = lambda x: jnp.sum(jnp.sin(la.permute(x, order, inverse)) * jnp.arange(3.0))
    g = lambda x: jnp.sum(jnp.sin(jnp.take_along_axis(x, order[..., None], 1)) * jnp.arange(3.0))
    np.testing.assert_allclose(jax.grad(f)(x), jax.grad(g)(x), atol=1e-6)


def test_default_buckets_follow_reformer_and_factorise_as_trax():
    assert la.default_n_buckets(1024, 128) == (16,)
    assert la.default_n_buckets(100, 128) == (2,)
    assert la.default_n_buckets(65536, 128) == (32, 32)
    assert la.default_n_buckets(524288, 128) == (128, 64)
    layer = tl.LSHCausalAttention(D, n_buckets=(4, 6))
    assert layer.n_buckets_for(10_000) == (4, 6)


@pytest.mark.parametrize("widths", [{}, {"d_attention_key": 4, "d_attention_value": 12}])
def test_predict_mode_decodes_as_the_one_chunk_layer_evaluates(widths):
    """Decoding attends to every cached position: the chunk_len >= length limit; the LM
    passes Trax's per-head widths to the layer."""
    def lm(mode):
        attention = lambda *a, **k: tl.LSHCausalAttention(*a, chunk_len=64, n_hashes=2, **k)
        return TransformerLM(vocab_size=11, d_model=D, d_ff=32, n_layers=2, n_heads=HEADS,
                             max_len=20, dropout=0.0, mode=mode, attention_type=attention,
                             pos_type="rotary", **widths)

    tokens = np.random.RandomState(0).randint(0, 11, (2, 12)).astype(np.int32)
    evaluate = lm("eval")
    weights, state = evaluate.init(jax.ShapeDtypeStruct(tokens.shape, tokens.dtype),
                                   jax.random.key(0))
    full = evaluate.pure_fn(tokens, weights, state, jax.random.key(1))[0]
    decode = lm("predict")
    _, cache = decode.init(jax.ShapeDtypeStruct((2, 1), np.int32), jax.random.key(0))
    step = jax.jit(decode.pure_fn)
    prompt, cache = step(tokens[:, :5], weights, cache, jax.random.key(1))
    steps = [prompt]
    for t in range(5, 12):
        out, cache = step(tokens[:, t:t + 1], weights, cache, jax.random.key(1))
        steps.append(out)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=2e-5)


@pytest.mark.parametrize("kwargs,match", [
    ({"chunk_len": 0}, "chunk_len=0 must be an int >= 1"),
    ({"n_hashes": 0}, "n_hashes=0 must be an int >= 1"),
    ({"n_chunks_before": -1}, "n_chunks_before=-1 must be an int >= 0"),
    ({"n_buckets": 7}, "n_buckets=7 must be an even int"),
    ({"n_buckets": (4, 5)}, r"n_buckets=\(4, 5\) must be an even int"),
    ({"n_buckets": 2.0}, "n_buckets=2.0 must be an even int"),
    ({"hash_seed": "a"}, "hash_seed='a' must be an int"),
    ({"n_heads": 3}, "not divisible by n_heads=3"),
    ({"dropout": 1.0}, "dropout rate=1.0"),
    ({"rotary": True, "n_heads": 16}, "rotary"),
    ({"rotary": True, "d_attention_key": 5}, "d_head=5 is odd"),
    ({"d_attention_value": 0}, "d_attention_value=0 must be a positive int"),
])
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tl.LSHCausalAttention(D, **kwargs)


def test_bad_calls_fail_with_one_line():
    layer = tl.LSHCausalAttention(D)
    x = jnp.zeros((1, 8, D))
    weights, state = _init(layer, x)
    with pytest.raises(tl.LayerError, match="got rng=None; pass a jax.random.key or set "
                       "hash_seed"):
        layer.pure_fn(x, weights, state, None)
    with pytest.raises(tl.LayerError, match=r"expects inputs \[batch, length, 16\]"):
        layer.pure_fn(jnp.zeros((1, 8, 4)), weights, state, jax.random.key(0))


def test_float16_gradients_are_finite_and_float64_keeps_its_precision():
    """The key normalisation runs in at least float32 (float64 for float64 inputs)."""
    qk = (300 * jax.random.normal(jax.random.key(1), (1, 24, 8))).astype(jnp.float16)
    v = (300 * jax.random.normal(jax.random.key(2), (1, 24, 8))).astype(jnp.float16)
    rotations = [jax.random.normal(jax.random.key(4), (8, 2))]
    f = lambda qk, v: jnp.sum(la.lsh_round(qk, v, rotations, chunk_len=8,
                                           n_chunks_before=1)[0].astype(jnp.float32))
    for g in jax.grad(f, argnums=(0, 1))(qk, v):
        assert bool(jnp.all(jnp.isfinite(g)))
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(1), (1, 20, D), jnp.float64)
        layer = tl.LSHCausalAttention(D, n_heads=HEADS, chunk_len=32)
        weights, state = _init(layer, x)
        y = layer.pure_fn(x, weights, state, jax.random.key(3))[0]
        np.testing.assert_allclose(y, _dense_reference(x, weights, 20), atol=1e-12)


def test_loop_grouping_pads_a_prime_number_of_chunks_to_whole_groups(monkeypatch):
    monkeypatch.setattr(lsh_chunks, "_GROUP_ROWS", 32)  # 4 chunks of 8 per group; 7 chunks
    qk = jax.random.normal(jax.random.key(1), (1, 53, 8))
    v = jax.random.normal(jax.random.key(2), (1, 53, 8))
    rotations = [jax.random.normal(jax.random.key(4), (8, 2))]
    out, lse = la.lsh_round(qk, v, rotations, chunk_len=8, n_chunks_before=1)
    ref_out, ref_lse = _round_reference(qk, v, rotations, 8, 1)
    np.testing.assert_allclose(out, ref_out, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)


@pytest.mark.parametrize("kwargs,match", [
    ({"n_buckets": (2 ** 16, 2 ** 16)}, "more than the 2,147,483,647 an int32 bucket id"),
    ({"n_buckets": {4: 1}}, "must be an even int"),
    ({"hash_seed": 2 ** 63}, "must be below 2"),
])
def test_out_of_range_buckets_and_seeds_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tl.LSHCausalAttention(D, **kwargs)


def test_empty_inputs_and_a_prompt_longer_than_the_cache_fail_with_one_line():
    layer = tl.LSHCausalAttention(D, hash_seed=0)
    weights, state = _init(layer, jnp.zeros((1, 8, D)))
    with pytest.raises(tl.LayerError, match=r"empty input of shape \(1, 0, 16\)"):
        layer.pure_fn(jnp.zeros((1, 0, D)), weights, state, None)
    decode = tl.LSHCausalAttention(D, mode="predict", max_len=4)
    _, cache = decode.init(jax.ShapeDtypeStruct((1, 1, D), jnp.float32), jax.random.key(0))
    with pytest.raises(tl.LayerError, match="cache of batch 1 and 4 positions"):
        decode.pure_fn(jnp.zeros((1, 6, D)), weights, cache, None)


@pytest.mark.parametrize("length", [64, 70])
def test_hashing_in_chunks_of_positions_gives_the_whole_lengths_buckets(monkeypatch, length):
    from revtrain.layers.attention import lsh_hashing
    qk = jax.random.normal(jax.random.key(3), (2, length, 8))
    rotations = [jax.random.normal(jax.random.key(4), (8, 4)),
                 jax.random.normal(jax.random.key(5), (8, 2))]
    whole = lsh_hashing.hash_buckets(qk, rotations)
    monkeypatch.setattr(lsh_hashing, "HASH_CHUNK", 16)
    np.testing.assert_array_equal(jax.jit(lsh_hashing.hash_buckets)(qk, rotations), whole)
    mesh = jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2])
    spec = jax.sharding.PartitionSpec("batch")
    sharded = jax.jit(jax.shard_map(lambda x: lsh_hashing.hash_buckets(x, rotations),
                                    mesh=mesh, in_specs=spec, out_specs=spec))
    placed = jax.device_put(qk, jax.sharding.NamedSharding(mesh, spec))
    np.testing.assert_array_equal(sharded(placed), whole)


def test_hashing_in_chunks_takes_the_rotations_varying_axes(monkeypatch):
    from revtrain.layers.attention import lsh_hashing
    monkeypatch.setattr(lsh_hashing, "HASH_CHUNK", 4)
    P = jax.sharding.PartitionSpec
    mesh = jax.make_mesh((2,), ("m",), devices=jax.devices()[:2])
    x = jax.random.normal(jax.random.key(6), (2, 16, 8))
    rotations = jax.random.normal(jax.random.key(7), (2, 8, 4))
    hashed = jax.jit(jax.shard_map(lambda x, r: lsh_hashing.hash_buckets(x, [r[0]])[None],
                                   mesh=mesh, in_specs=(P(), P("m")), out_specs=P("m")))
    got = hashed(jax.device_put(x, jax.sharding.NamedSharding(mesh, P())),
                 jax.device_put(rotations, jax.sharding.NamedSharding(mesh, P("m"))))
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(got)[i], lsh_hashing._hash_rows(x, [rotations[i]]))
