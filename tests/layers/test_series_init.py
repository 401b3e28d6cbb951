"""Tests for revtrain.layers.series_init: runs of equal layers initialised by one vmapped
init give, bitwise on CPU, what initialising them one by one gives."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import EMPTY, Dense, Layer, LayerError, Relu, Serial, series_init
from revtrain.models import ReversibleTransformerLM, TransformerLM

SDS = jax.ShapeDtypeStruct
TOKENS = SDS((2, 8), jnp.int32)
LM_ARGS = dict(vocab_size=32, d_model=16, d_ff=32, n_layers=3, n_heads=2, max_len=8)


def _all_layers(layer):
    out, pending = [], [layer]
    while pending:
        current = pending.pop()
        out.append(current)
        pending.extend(current.sublayers)
    return out


def _values(layer):
    """Weights, state and every layer's init key (as key data), as NumPy."""
    keys = [None if sub._rng is None else jax.random.key_data(sub._rng)
            for sub in _all_layers(layer)]
    return jax.tree.map(np.asarray, (layer.weights, layer.state, keys))


def _assert_bitwise_equal(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def runs(monkeypatch):
    """Records how many layers each vmapped run initialised (0: initialised one by one)."""
    sizes = []
    init_run = series_init._init_run

    def recording(layers, *args):
        result = init_run(layers, *args)
        sizes.append(0 if result is None else len(layers))
        return result

    monkeypatch.setattr(series_init, "_init_run", recording)
    monkeypatch.setattr(series_init, "MIN_VMAPPED_REPEATS", 2)  # The tests' runs are short.
    return sizes


def _one_by_one(monkeypatch, make, signature, rng):
    """``make()`` initialised with every run one layer at a time (the init before runs)."""
    with monkeypatch.context() as patch:
        patch.setattr(series_init, "_init_run", lambda *args: None)
        model = make()
        model.init(signature, rng=rng)
    return _values(model)


def _own_buffers(layer):
    """Whether no two weight or state arrays of the model share a buffer (a trainer may
    donate each)."""
    leaves = jax.tree.leaves((layer.weights, layer.state))
    return len({leaf.unsafe_buffer_pointer() for leaf in leaves}) == len(leaves)


def _no_tracers(layer):
    return not any(isinstance(leaf, jax.core.Tracer) for sub in _all_layers(layer)
                   for value in vars(sub).values() for leaf in jax.tree.leaves(value))


MODELS = {
    "reversible_lm": (lambda: ReversibleTransformerLM(**LM_ARGS), TOKENS, 4 * 3),
    "plain_lm": (lambda: TransformerLM(**LM_ARGS), TOKENS, 2 * 3),
    "dense_serial": (lambda: Serial(*[Dense(3) for _ in range(12)]), SDS((2, 3), jnp.float32),
                     12),
    "dense_relu_serial": (lambda: Serial([(Dense(4), Relu()) for _ in range(5)]),
                          SDS((2, 4), jnp.float32), 10),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_run_inits_bitwise_as_its_layers_one_by_one(name, runs, monkeypatch):
    # Bitwise on CPU: key i of the series' split reaches layer i, and threefry draws per key
    # do not depend on vmap.
    make, signature, run_size = MODELS[name]
    rng = jax.random.key(7)
    model = make()
    model.init(signature, rng=rng)
    assert run_size in runs  # The repeated blocks were one vmapped init.
    _assert_bitwise_equal(_values(model), _one_by_one(monkeypatch, make, signature, rng))
    assert _no_tracers(model)
    assert _own_buffers(model)  # LayerNorm's ones are not one buffer shared by the run.


def test_layers_of_different_widths_init_one_by_one(runs, monkeypatch):
    def make():
        return Serial(Dense(3), Dense(4), Dense(5), Dense(6))

    signature, rng = SDS((2, 2), jnp.float32), jax.random.key(1)
    model = make()
    model.init(signature, rng=rng)
    assert runs == []  # No two neighbours are equal: nothing to vmap.
    _assert_bitwise_equal(_values(model), _one_by_one(monkeypatch, make, signature, rng))
    keys = jax.random.split(rng, 4)
    for layer, key, width in zip(model.sublayers, keys, (2, 3, 4, 5), strict=True):
        expected, _ = Dense(layer.weights[0].shape[1]).init(SDS((2, width), jnp.float32),
                                                            rng=key)
        _assert_bitwise_equal(jax.tree.map(np.asarray, layer.weights),
                              jax.tree.map(np.asarray, expected))


def test_a_run_whose_first_layer_changes_the_width_vmaps_the_rest(runs, monkeypatch):
    def make():
        return Serial(*[Dense(2) for _ in range(6)])

    signature, rng = SDS((3, 5), jnp.float32), jax.random.key(2)
    model = make()
    model.init(signature, rng=rng)
    assert runs == [5]  # [5 -> 2] alone, then [2 -> 2] x 5 as one run.
    assert model.weights[0][0].shape == (5, 2) and model.weights[1][0].shape == (2, 2)
    _assert_bitwise_equal(_values(model), _one_by_one(monkeypatch, make, signature, rng))


class _ValueDependentInit(Layer):
    """Reads its random draw in Python at init (works eagerly, not under a trace)."""

    def init_weights_and_state(self, input_signature, rng):
        draw = float(jax.random.uniform(rng))
        scale = 2.0 if draw > 0.5 else -1.0
        return jnp.full(input_signature.shape[-1:], scale * draw), EMPTY

    def forward_with_state(self, x, weights, state, rng):
        return x * weights, state


def test_an_init_that_cannot_be_traced_inits_one_by_one(runs, monkeypatch):
    def make():
        return Serial(*[_ValueDependentInit() for _ in range(5)])

    signature, rng = SDS((2, 3), jnp.float32), jax.random.key(3)
    model = make()
    model.init(signature, rng=rng)
    assert runs == [0]  # Tried as a run, then one by one.
    assert _no_tracers(model)
    _assert_bitwise_equal(_values(model), _one_by_one(monkeypatch, make, signature, rng))


class _Failing(Layer):
    def init_weights_and_state(self, input_signature, rng):
        raise ValueError("init went wrong")


def test_an_error_in_a_run_names_the_failing_layer():
    model = Serial(*[_Failing(name="Broken") for _ in range(4)])
    with pytest.raises(LayerError, match=r"Broken\.init.*init went wrong") as info:
        model.init(SDS((2, 3), jnp.float32), rng=jax.random.key(0))
    assert info.value.layer_name == "Broken"


def test_an_abstract_init_gives_the_concrete_shapes(runs):
    shapes = jax.eval_shape(
        lambda rng: ReversibleTransformerLM(**LM_ARGS).init(TOKENS, rng=rng),
        jax.random.key(0))
    concrete = ReversibleTransformerLM(**LM_ARGS)
    concrete.init(TOKENS, rng=jax.random.key(0))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), shapes) == jax.tree.map(
        lambda a: (a.shape, a.dtype), (concrete.weights, concrete.state))
    assert 12 in runs


def test_without_an_rng_each_layer_inits_with_its_own_and_gives_tuples():
    model = Serial(*[Dense(3) for _ in range(3)])
    weights, state = model.init_weights_and_state(SDS((2, 3), jnp.float32), None)
    assert isinstance(weights, tuple) and isinstance(state, tuple) and len(weights) == 3
    assert Serial().init(()) == ((), ())


def test_a_run_shorter_than_the_threshold_inits_one_by_one(runs, monkeypatch):
    monkeypatch.setattr(series_init, "MIN_VMAPPED_REPEATS", 8)
    model = Serial(*[Dense(3) for _ in range(7)])
    model.init(SDS((2, 3), jnp.float32), rng=jax.random.key(1))
    assert runs == []  # Seven repetitions: no vmapped init was tried.
    model = Serial(*[Dense(3) for _ in range(8)])
    model.init(SDS((2, 3), jnp.float32), rng=jax.random.key(1))
    assert runs == [8]
