"""Tests for revtrain.layers.attention.causal: CausalAttention vs a numpy reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from revtrain.layers import (
    CausalAttention,
    LayerError,
    dot_product_attention,
    einsum_attention,
)

SDS = jax.ShapeDtypeStruct
B, L, D = 2, 6, 8


def _x(shape=(B, L, D), seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _reference(x, weights, n_heads):
    """Per-head loop over positions, float64 numpy."""
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = [tuple(np.asarray(a, np.float64) for a in p)
                                               for p in weights]
    x = np.asarray(x, np.float64)
    q, k, v = x @ wq + bq, x @ wk + bk, x @ wv + bv
    d_head = x.shape[-1] // n_heads
    out = np.zeros_like(x)
    for b in range(x.shape[0]):
        for h in range(n_heads):
            cols = slice(h * d_head, (h + 1) * d_head)
            for t in range(x.shape[1]):
                logits = k[b, :t + 1, cols] @ q[b, t, cols] / np.sqrt(d_head)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[b, t, cols] = p @ v[b, :t + 1, cols]
    return out @ wo + bo


def _layer(n_heads=2, **kwargs):
    layer = CausalAttention(D, n_heads=n_heads, **kwargs)
    layer.init(SDS((B, L, D), jnp.float32), rng=jax.random.key(1))
    return layer


@pytest.mark.parametrize("n_heads", [1, 2, 4])
def test_causal_attention_matches_reference(n_heads):
    layer = _layer(n_heads)
    assert jax.tree.map(jnp.shape, layer.weights) == (((D, D), (D,)),) * 4
    x = _x()
    y = layer(x)
    assert y.shape == (B, L, D) and y.dtype == jnp.float32
    np.testing.assert_allclose(y, _reference(x, layer.weights, n_heads), rtol=1e-4, atol=1e-5)
    assert layer.output_signature(SDS((B, L, D), jnp.float32)).shape == (B, L, D)


def test_output_at_t_ignores_inputs_after_t():
    layer = _layer(2)
    x = _x()
    y = np.asarray(layer(x))
    for t in range(L - 1):
        x2 = x.copy()
        x2[:, t + 1:] = _x((B, L - t - 1, D), seed=t + 10)
        y2 = np.asarray(layer(x2))
        np.testing.assert_allclose(y2[:, :t + 1], y[:, :t + 1], rtol=1e-5, atol=1e-6)
        assert not np.allclose(y2[:, t + 1:], y[:, t + 1:])


def test_d_feature_not_divisible_by_n_heads_names_both():
    with pytest.raises(ValueError, match=r"d_feature=10 is not divisible by n_heads=4; use"):
        CausalAttention(10, n_heads=4)


def test_wrong_input_width_raises_layer_error():
    layer = _layer(2)
    with pytest.raises(LayerError, match=r"expects inputs \[batch, length, 8\]"):
        layer(np.ones((B, L, 6), np.float32))


def test_attention_dropout_uses_rng_and_mode():
    x = _x()
    train = _layer(2, dropout=0.5)
    w = train.weights
    y1, _ = train.pure_fn(x, w, (), jax.random.key(0))
    y2, _ = train.pure_fn(x, w, (), jax.random.key(0))
    y3, _ = train.pure_fn(x, w, (), jax.random.key(1))
    np.testing.assert_array_equal(y1, y2)
    assert not np.allclose(y1, y3)
    plain = _reference(x, w, 2)
    assert not np.allclose(y1, plain, atol=1e-3)
    y_eval, _ = CausalAttention(D, n_heads=2, dropout=0.5, mode="eval").pure_fn(x, w, (), None)
    np.testing.assert_allclose(y_eval, plain, rtol=1e-4, atol=1e-5)


def test_bfloat16_inputs_give_bfloat16_outputs_close_to_float32():
    layer = _layer(2)
    x = _x()
    y16 = layer(jnp.asarray(x, jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), layer(x), atol=0.1, rtol=0.05)


def test_dot_product_attention_respects_mask():
    q = k = jnp.asarray(_x((1, 3, 1, 2)))
    v = jnp.asarray(np.arange(3, dtype=np.float32).reshape(1, 3, 1, 1))
    only_first = jnp.array([[True, False, False]] * 3)
    out = dot_product_attention(q, k, v, only_first)
    np.testing.assert_allclose(np.asarray(out).ravel(), [0.0, 0.0, 0.0], atol=1e-7)


def test_causal_attention_gradients_match_finite_differences():
    layer = CausalAttention(4, n_heads=2)
    layer.init(SDS((1, 3, 4), jnp.float32), rng=jax.random.key(2))
    x = _x((1, 3, 4))
    with jax.enable_x64(True):
        w = jax.tree.map(lambda a: np.asarray(a, np.float64), layer.weights)
        x64 = np.asarray(x, np.float64)
        check_grads(lambda w_: layer.pure_fn(x64, w_, (), None)[0], (w,), 1, modes=["rev"])
        check_grads(lambda x_: layer.pure_fn(x_, w, (), None)[0], (x64,), 1, modes=["rev"])


# --------------------------------------------------------------------------------------
# Edge cases.


def test_integer_inputs_compute_in_float32_like_float_inputs():
    layer = CausalAttention(4, n_heads=2)
    x = jnp.arange(24, dtype=jnp.int32).reshape(2, 3, 4) % 5
    layer.init(x, rng=jax.random.key(0))
    y = layer(x)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, layer(x.astype(jnp.float32)), rtol=1e-6)
    assert float(jnp.abs(y).max()) > 0.1  # not truncated to integer weights


@pytest.mark.parametrize("d_feature,n_heads,message", [
    (0, 1, r"d_feature=0 must be a positive int"),
    (4, 2.0, r"n_heads=2.0 must be a positive int"),
    (4, 0, r"n_heads=0 must be a positive int"),
    (8, 3, r"d_feature=8 is not divisible by n_heads=3"),
])
def test_bad_head_arguments_are_rejected_at_construction(d_feature, n_heads, message):
    with pytest.raises(ValueError, match=message):
        CausalAttention(d_feature, n_heads=n_heads)


def test_length_one_and_batch_one():
    layer = CausalAttention(4, n_heads=4)
    x = jnp.ones((1, 1, 4))
    layer.init(x, rng=jax.random.key(0))
    w_v, b_v = layer.weights[2]
    w_o, b_o = layer.weights[3]
    # One position attends only to itself: output = (x W_v + b_v) W_o + b_o.
    np.testing.assert_allclose(layer(x), (x @ w_v + b_v) @ w_o + b_o, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------
# jax.nn.dot_product_attention (no dropout) against the einsum path (dropout).


def _qkv(lq, lk, seed=0, n_heads=2, d_head=4):
    q = jnp.asarray(_x((B, lq, n_heads, d_head), seed))
    k = jnp.asarray(_x((B, lk, n_heads, d_head), seed + 1))
    v = jnp.asarray(_x((B, lk, n_heads, d_head), seed + 2))
    return q, k, v


@pytest.mark.parametrize("mask_kind", ["causal", "is_causal", "cache", "padding", "none"])
def test_fused_attention_equals_einsum_attention(mask_kind):
    lq, lk = (3, 7) if mask_kind == "cache" else (L, L)
    q, k, v = _qkv(lq, lk)
    mask, is_causal = None, False
    if mask_kind == "causal":
        mask = np.tril(np.ones((L, L), bool))
    elif mask_kind == "is_causal":
        is_causal = True
    elif mask_kind == "cache":  # queries at positions 2..4 of a 7-long key/value cache
        mask = np.arange(lk)[None, :] <= (2 + np.arange(lq))[:, None]
    elif mask_kind == "padding":  # [batch, 1, 1, length_k]: the last two keys are padding
        mask = np.broadcast_to(np.arange(lk) < lk - 2, (B, 1, 1, lk))
    fused = dot_product_attention(q, k, v, mask, is_causal=is_causal)
    plain = einsum_attention(q, k, v, mask, is_causal=is_causal)
    np.testing.assert_allclose(fused, plain, rtol=1e-5, atol=1e-5)
    grads = [jax.grad(lambda q_, f=f: jnp.sum(jnp.sin(f(q_, k, v, mask, is_causal=is_causal))))(q)
             for f in (dot_product_attention, einsum_attention)]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-5)


def test_dropout_rate_zero_runs_jax_nn_attention_and_dropout_the_einsum_path(monkeypatch):
    calls = []
    fused_fn = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, **kw: calls.append(kw) or fused_fn(*a, **kw))
    q, k, v = _qkv(L, L)
    x = _x()
    _layer(2)(x)
    CausalAttention(D, n_heads=2, dropout=0.5, mode="eval").pure_fn(x, _layer(2).weights, (),
                                                                     None)
    assert [kw["is_causal"] for kw in calls] == [True, True]
    _layer(2, dropout=0.5).pure_fn(x, _layer(2).weights, (), jax.random.key(0))
    assert len(calls) == 2
    dropped = dot_product_attention(q, k, v, None, 0.5, jax.random.key(0), is_causal=True)
    again = einsum_attention(q, k, v, None, 0.5, jax.random.key(0), is_causal=True)
    np.testing.assert_array_equal(dropped, again)
    assert not np.allclose(dropped, einsum_attention(q, k, v, is_causal=True), atol=1e-3)


def test_predict_mode_cache_matches_train_mode_without_dropout():
    train = _layer(2)
    predict = CausalAttention(D, n_heads=2, mode="predict", max_len=L)
    predict.init(SDS((B, 1, D), jnp.float32), rng=jax.random.key(1))
    x = _x()
    state, steps = predict.state, []
    for t in range(L):
        y, state = predict.pure_fn(x[:, t:t + 1], train.weights, state, None)
        steps.append(y)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), train(x), rtol=1e-5, atol=1e-5)


def test_implementation_is_passed_to_jax_nn_and_checked(monkeypatch):
    seen = []
    fused_fn = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, **kw: seen.append(kw["implementation"]) or fused_fn(*a, **kw))
    x = _x()
    weights = _layer(2).weights
    y = CausalAttention(D, n_heads=2, implementation="xla").pure_fn(x, weights, (), None)[0]
    np.testing.assert_allclose(y, _reference(x, weights, 2), rtol=1e-4, atol=1e-5)
    assert seen == ["xla"]
    with pytest.raises(ValueError, match="implementation='flash'"):
        CausalAttention(D, implementation="flash")


# ------------------------------------------------------------------------------------------
# Implementations: blockwise equals full (dropout included), the default chooses by size,
# rotary positions, bad arguments.

def _long(length=40, seed=0):
    return np.random.default_rng(seed).normal(size=(B, length, D)).astype(np.float32)


@pytest.mark.parametrize("dropout, mode, rotary", [(0.0, "train", False), (0.4, "train", True),
                                                   (0.4, "eval", False)])
def test_blockwise_layer_equals_the_full_layer(dropout, mode, rotary):
    kwargs = dict(n_heads=2, dropout=dropout, mode=mode, rotary=rotary)
    full = CausalAttention(D, implementation="xla", **kwargs)
    blockwise = CausalAttention(D, implementation="blockwise", block_size=7, **kwargs)
    x = _long()
    weights, _ = full.init(SDS(x.shape, jnp.float32), rng=jax.random.key(1))
    rng = jax.random.key(9)

    def run(layer):
        return jax.value_and_grad(lambda w, x: jnp.sum(jnp.sin(
            layer.pure_fn(x, w, (), rng)[0])), argnums=(0, 1))(weights, x)

    (value, grads), (value_b, grads_b) = run(full), run(blockwise)
    assert float(value_b) == pytest.approx(float(value), rel=1e-5)
    for a, b in zip(jax.tree.leaves(grads_b), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_default_implementation_chooses_by_size_and_backend():
    from revtrain.layers.attention.causal import FULL_ATTENTION_MAX_BYTES, choose_implementation
    assert FULL_ATTENTION_MAX_BYTES == 64 * 2 ** 20
    assert choose_implementation(32, 4, 128, 32, jnp.float32, 0.1, "cpu") == "xla"
    assert choose_implementation(1, 4, 2048, 32, jnp.float32, 0.0, "cpu") == "xla"
    assert choose_implementation(1, 4, 2049, 32, jnp.float32, 0.0, "cpu") == "blockwise"
    assert choose_implementation(1, 4, 8192, 32, jnp.float32, 0.0, "tpu") == "blockwise"
    assert choose_implementation(1, 4, 8192, 32, jnp.bfloat16, 0.0, "gpu") == "cudnn"
    assert choose_implementation(1, 4, 8192, 32, jnp.bfloat16, 0.1, "gpu") == "blockwise"
    assert choose_implementation(1, 4, 8192, 32, jnp.float32, 0.0, "gpu") == "blockwise"
    assert choose_implementation(1, 4, 8192, 256, jnp.bfloat16, 0.0, "gpu") == "blockwise"


def test_default_implementation_runs_blockwise_above_the_threshold(monkeypatch):
    import revtrain.layers.attention.causal as attention
    calls = []
    real = attention.blockwise_attention
    monkeypatch.setattr(attention, "blockwise_attention",
                        lambda *a, **kw: calls.append(kw["block_size"]) or real(*a, **kw))
    monkeypatch.setattr(attention, "FULL_ATTENTION_MAX_BYTES", 4 * B * 2 * 30 * 30)
    layer = CausalAttention(D, n_heads=2, block_size=16)
    weights, _ = layer.init(SDS((B, 31, D), jnp.float32), rng=jax.random.key(1))
    short = layer.pure_fn(_long(30), weights, (), None)[0]
    assert calls == []
    long = layer.pure_fn(_long(31), weights, (), None)[0]
    assert calls == [16]
    np.testing.assert_allclose(long[:, :30], CausalAttention(D, n_heads=2).pure_fn(
        _long(31), weights, (), None)[0][:, :30], rtol=1e-5, atol=1e-5)
    assert short.shape == (B, 30, D)


@pytest.mark.parametrize("implementation", [None, "blockwise"])
def test_predict_mode_with_rotary_matches_train_mode(implementation):
    kwargs = dict(n_heads=2, rotary=True, implementation=implementation)
    train = CausalAttention(D, block_size=4, **kwargs)
    x = _long(12)
    weights, _ = train.init(SDS(x.shape, jnp.float32), rng=jax.random.key(1))
    predict = CausalAttention(D, mode="predict", max_len=12, **kwargs)
    predict.init(SDS((B, 1, D), jnp.float32), rng=jax.random.key(1))
    y, state = predict.pure_fn(x[:, :5], weights, predict.state, None)  # a prompt of 5
    steps = [y]
    for t in range(5, 12):
        y, state = predict.pure_fn(x[:, t:t + 1], weights, state, None)
        steps.append(y)
    np.testing.assert_allclose(np.concatenate(steps, axis=1),
                               train.pure_fn(x, weights, (), None)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(implementation="flash"), "implementation='flash' is not one of"),
    (dict(block_size=0), "block_size=0 must be a positive int"),
    (dict(block_size=-4), "block_size=-4 must be a positive int"),
    (dict(n_heads=8, rotary=True), "d_head=1 is odd"),
    (dict(implementation="cudnn"), "implementation='cudnn' needs an NVIDIA GPU"),
])
def test_bad_implementation_arguments_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        CausalAttention(D, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dropout", [0.0, 0.4])
def test_the_full_path_runs_one_head_at_a_time_above_the_threshold(monkeypatch, dropout):
    """Same values and gradients (and dropout masks) as all heads at once."""
    import revtrain.layers.attention.causal as attention
    layer = CausalAttention(D, n_heads=2, dropout=dropout, implementation="xla")
    x = _long(16)
    weights, _ = layer.init(SDS(x.shape, jnp.float32), rng=jax.random.key(1))
    rng = jax.random.key(4)

    def run():
        return jax.value_and_grad(lambda w: jnp.sum(jnp.sin(
            layer.pure_fn(x, w, (), rng)[0])))(weights)

    whole = run()
    scans = []
    real_scan = jax.lax.scan
    monkeypatch.setattr(attention, "FULL_ATTENTION_MAX_BYTES", 0)
    monkeypatch.setattr(jax.lax, "scan", lambda *a, **kw: scans.append(1) or real_scan(*a, **kw))
    by_head = run()
    assert scans  # the per-head scan ran
    assert float(by_head[0]) == pytest.approx(float(whole[0]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(by_head[1]), jax.tree.leaves(whole[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _reference_widths(x, weights, n_heads, d_key, d_value):
    """`_reference` with per-head query/key width ``d_key`` and value width ``d_value``."""
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = [tuple(np.asarray(a, np.float64) for a in p)
                                               for p in weights]
    x = np.asarray(x, np.float64)
    q, k, v = x @ wq + bq, x @ wk + bk, x @ wv + bv
    heads = np.zeros(x.shape[:2] + (n_heads * d_value,))
    for h in range(n_heads):
        qh, kh = q[..., h * d_key:(h + 1) * d_key], k[..., h * d_key:(h + 1) * d_key]
        vh = v[..., h * d_value:(h + 1) * d_value]
        logits = np.einsum("bqd,bkd->bqk", qh, kh) / np.sqrt(d_key)
        logits = np.where(np.tril(np.ones(logits.shape[1:], bool)), logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        heads[..., h * d_value:(h + 1) * d_value] = (p / p.sum(-1, keepdims=True)) @ vh
    return heads @ wo + bo


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
@pytest.mark.parametrize("d_key, d_value", [(3, 5), (6, 2), (4, 4)])
def test_attention_widths_match_the_reference(implementation, d_key, d_value):
    """Trax's ``d_attention_key`` / ``d_attention_value``: weight shapes, outputs and the
    one-head-at-a-time path (blockwise) against a float64 numpy reference."""
    layer = _layer(2, implementation=implementation, block_size=4, d_attention_key=d_key,
                   d_attention_value=d_value)
    assert jax.tree.map(jnp.shape, layer.weights) == (
        ((D, 2 * d_key), (2 * d_key,)), ((D, 2 * d_key), (2 * d_key,)),
        ((D, 2 * d_value), (2 * d_value,)), ((2 * d_value, D), (D,)))
    x = _x()
    np.testing.assert_allclose(layer(x), _reference_widths(x, layer.weights, 2, d_key, d_value),
                               rtol=1e-4, atol=1e-5)


def test_default_widths_keep_the_weights_and_non_default_ones_need_no_divisor():
    default, explicit = _layer(2), _layer(2, d_attention_key=D // 2, d_attention_value=D // 2)
    for a, b in zip(jax.tree.leaves(default.weights), jax.tree.leaves(explicit.weights),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    layer = CausalAttention(10, n_heads=4, d_attention_key=3, d_attention_value=5)
    layer.init(SDS((1, 5, 10), jnp.float32), rng=jax.random.key(0))
    assert layer(_x((1, 5, 10))).shape == (1, 5, 10)


def test_predict_mode_with_widths_matches_train_mode():
    widths = dict(d_attention_key=6, d_attention_value=2)
    predict = CausalAttention(D, n_heads=2, mode="predict", max_len=L, rotary=True, **widths)
    train = _layer(2, rotary=True, **widths)
    predict.init(SDS((B, 1, D), jnp.float32), rng=jax.random.key(1))
    assert [a.shape for a in predict.state[:2]] == [(B, L, 2, 6), (B, L, 2, 2)]
    x = _x()
    state, steps = predict.state, []
    for t in range(L):
        y, state = predict.pure_fn(x[:, t:t + 1], train.weights, state, None)
        steps.append(y)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), train(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(d_attention_key=0), r"d_attention_key=0 must be a positive int"),
    (dict(d_attention_value=2.5), r"d_attention_value=2.5 must be a positive int"),
    (dict(d_attention_key=3, rotary=True), r"d_head=3 is odd"),
    (dict(d_attention_key=4, d_attention_value=8, implementation="cudnn"),
     r"needs keys and values of one width, but d_attention_key=4 and d_attention_value=8"),
])
def test_bad_widths_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CausalAttention(D, n_heads=2, **kwargs)
