"""Tests for revtrain.layers.scan: repeated runs of sublayers scanned, results unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    BatchNorm,
    Dense,
    Dropout,
    Fn,
    LayerNorm,
    Relu,
    Residual,
    ReversibleHalfResidual,
    ReversibleSerial,
    ReversibleSwap,
    Serial,
)
from revtrain.layers.remat import RematSchedule
from revtrain.layers.scan import plan_runs
from tests.tree_utils import assert_trees_close

SDS = jax.ShapeDtypeStruct
X = SDS((4, 8), jnp.float32)


def _block():
    return [Residual(LayerNorm(), Dense(16), Relu(), Dropout(0.3), Dense(8)),
            Residual(Dense(8), Dropout(0.2))]


def _rev_block():
    return [ReversibleHalfResidual(LayerNorm(), Dense(8), Dropout(0.3)), ReversibleSwap(),
            ReversibleHalfResidual(Dense(8), Relu()), ReversibleSwap()]


def _pair(make, **kwargs):
    """The same initialised model twice: scanned (default) and unrolled."""
    scanned, unrolled = make(scan=True, **kwargs), make(scan=False, **kwargs)
    return scanned, unrolled


def _serial(scan, depth=3):
    layers = [Dense(8)] + [b for _ in range(depth) for b in _block()] + [Dense(3)]
    return Serial(layers, scan=scan)


def _run_and_grad(model, x):
    rng = jax.random.key(7)

    def loss(w):
        y, new_state = model.pure_fn(x, w, model.state, rng)
        return sum(jnp.sum(jnp.sin(a)) for a in jax.tree.leaves(y)), (y, new_state)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(model.weights)


def test_plan_finds_the_longest_repeated_group():
    assert plan_runs(list("xabababy")) == [(0, 1, 1), (1, 2, 3), (7, 1, 1)]
    assert plan_runs(list("aaaa")) == [(0, 4 // 4, 4)]  # Period 1 wins the tie.
    assert plan_runs(["a", None, "a", None]) == [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1)]
    assert plan_runs(list("abcd")) == [(i, 1, 1) for i in range(4)]


@pytest.mark.parametrize("depth", [2, 5])
def test_scanned_serial_equals_unrolled_with_dropout(depth):
    scanned, unrolled = _pair(_serial, depth=depth)
    scanned.init(X, rng=jax.random.key(1))
    unrolled.init(X, rng=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), X.shape)
    (l1, (y1, s1)), g1 = _run_and_grad(scanned, x)
    (l2, (y2, s2)), g2 = _run_and_grad(unrolled, x)
    assert_trees_close((l1, y1, s1, g1), (l2, y2, s2, g2), rtol=1e-5, atol=1e-6)


def test_state_is_scanned_and_returned_per_layer():
    def make(scan):
        return Serial([Serial(Dense(8), BatchNorm(axis=(0,))) for _ in range(3)], scan=scan)
    scanned, unrolled = make(True), make(False)
    scanned.init(X, rng=jax.random.key(1))
    unrolled.init(X, rng=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), X.shape)
    y1, s1 = jax.jit(scanned.pure_fn)(x, scanned.weights, scanned.state, jax.random.key(3))
    y2, s2 = jax.jit(unrolled.pure_fn)(x, unrolled.weights, unrolled.state, jax.random.key(3))
    assert_trees_close((y1, s1), (y2, s2))
    assert jax.tree.structure(s1) == jax.tree.structure(scanned.state)
    first, second = jax.tree.leaves(s1[1]), jax.tree.leaves(s1[2])  # Each layer's own.
    assert not all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))


def test_reversible_serial_scanned_equals_unrolled():
    def make(scan):
        return ReversibleSerial([b for _ in range(4) for b in _rev_block()], scan=scan)
    scanned, unrolled = make(True), make(False)
    sig = (X, X)
    scanned.init(sig, rng=jax.random.key(1))
    unrolled.init(sig, rng=jax.random.key(1))
    x = tuple(jax.random.normal(k, X.shape) for k in jax.random.split(jax.random.key(2)))
    (l1, (y1, _)), g1 = _run_and_grad(scanned, x)
    (l2, (y2, _)), g2 = _run_and_grad(unrolled, x)
    assert_trees_close((l1, y1, g1), (l2, y2, g2), rtol=1e-5, atol=1e-5)
    # The reverse pass still inverts the (scanned) forward pass.
    rng = jax.random.key(7)
    _, new_state = scanned.pure_fn(x, scanned.weights, scanned.state, rng)
    back = scanned.reverse(y1, scanned.weights, scanned.state, new_state, rng)
    assert_trees_close(back, x, rtol=1e-4, atol=1e-5)


def _count_dots(model, x):
    text = jax.jit(model.pure_fn).lower(x, model.weights, model.state,
                                        jax.random.key(0)).as_text()
    return text.count("dot_general")


def test_compiled_program_holds_one_copy_of_the_repeated_group():
    counts = {}
    for depth in (2, 8):
        model = _serial(True, depth=depth)
        model.init(X, rng=jax.random.key(1))
        counts[depth] = _count_dots(model, jnp.zeros(X.shape))
    unrolled = _serial(False, depth=8)
    unrolled.init(X, rng=jax.random.key(1))
    assert counts[2] == counts[8]
    assert _count_dots(unrolled, jnp.zeros(X.shape)) > counts[8]


def test_unprovable_or_mismatched_layers_run_unrolled():
    # Fn of a lambda has no structure key: nothing to prove, so nothing is scanned.
    model = Serial([Fn("Twice", lambda x: 2 * x) for _ in range(4)])
    model.init(X)
    text = jax.jit(model.pure_fn).lower(jnp.zeros(X.shape), model.weights, model.state,
                                        None).as_text()
    assert "while" not in text
    # Equal keys but the first Dense's weights differ in shape (8 -> 4 inputs): the
    # remaining two form the run.
    model = Serial(Dense(4), Dense(4), Dense(4), scan=True)
    reference = Serial(Dense(4), Dense(4), Dense(4), scan=False)
    model.init(X, rng=jax.random.key(0))
    reference.init(X, rng=jax.random.key(0))
    x = jnp.ones(X.shape)
    assert_trees_close(model(x), reference(x))


def test_a_long_serial_of_tiny_layers_compiles_quickly():
    """Unrolled, 200 Dense layers are 200 matmuls in the program (and 2,000 took over 35
    minutes to compile); scanned, one -- also after XLA's optimisation, which could unroll
    the loop again. Counted in the program rather than timed, so a loaded machine cannot
    fail it and a slow compile of an unrolled program cannot pass it."""
    model = Serial([Dense(4) for _ in range(200)])
    model.init(SDS((2, 4), jnp.float32), rng=jax.random.key(0))
    lowered = jax.jit(model.pure_fn).lower(jnp.ones((2, 4)), model.weights, model.state, None)
    assert lowered.as_text().count("dot_general") == 1
    compiled = lowered.compile().as_text()
    assert compiled.count(" dot(") == 1 and "while(" in compiled


def test_a_run_of_weightless_layers_without_rng_is_scanned():
    model = Serial([Relu() for _ in range(3)])
    model.init(X)
    x = jax.random.normal(jax.random.key(0), X.shape)
    lowered = jax.jit(model.pure_fn).lower(x, model.weights, model.state, None)
    assert "while" in lowered.as_text()
    np.testing.assert_array_equal(model.pure_fn(x, model.weights, model.state, None)[0],
                                  jax.nn.relu(x))


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else [value]:
            if hasattr(item, "eqns"):
                yield item
            elif hasattr(getattr(item, "jaxpr", None), "eqns"):  # A ClosedJaxpr.
                yield item.jaxpr


def _times(eqn):
    return eqn.params["length"] if eqn.primitive.name == "scan" else 1


def _dots(jaxpr):
    """Matmuls a jaxpr runs (a scan's body counted once per iteration)."""
    return sum((eqn.primitive.name == "dot_general")
               + _times(eqn) * sum(_dots(sub) for sub in _subjaxprs(eqn))
               for eqn in jaxpr.eqns)


def _checkpointed_dots(jaxpr):
    """The matmuls inside each ``jax.checkpoint`` a jaxpr runs, in order, once per run
    (a checkpoint in a scan's body once per iteration)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("checkpoint", "remat2"):  # The name varies by version.
            out.append(_dots(eqn.params["jaxpr"]))
            continue
        for sub in _subjaxprs(eqn):
            out += _times(eqn) * _checkpointed_dots(sub)
    return out


@pytest.mark.parametrize("every, include_last, groups", [
    # Dense(8); 5 repetitions of a group of two Residuals (3 matmuls); Dense(3): the
    # matmuls of each checkpoint.
    (1, True, [1, 3, 3, 3, 3, 3, 1]),
    (1, False, [1, 3, 3, 3, 3, 3]),  # The last layer without a checkpoint.
    (2, True, [1, 6, 6, 3, 1]),  # The run on its own, 2 + 2 + the remainder 1.
    (3, False, [1, 9, 6]),
    (9, True, [1, 15, 1]),  # A run shorter than `every` is one group.
])
def test_remat_checkpoints_groups_of_layers_the_same_scanned_or_unrolled(every, include_last,
                                                                          groups):
    remat = RematSchedule(every, include_last=include_last)
    x = jax.random.normal(jax.random.key(2), X.shape)
    for scan in (True, False):
        model = _serial(scan, depth=5)
        model.init(X, rng=jax.random.key(1))
        jaxpr = jax.make_jaxpr(lambda w, m=model: m.forward_with_state(
            x, w, m.state, jax.random.key(3), remat=remat))(model.weights)
        assert _checkpointed_dots(jaxpr.jaxpr) == groups, scan


@pytest.mark.parametrize("every", [1, 2, 3])
def test_remat_gives_the_values_and_gradients_of_the_plain_series_with_dropout(every):
    x = jax.random.normal(jax.random.key(2), X.shape)
    for scan in (True, False):
        model = _serial(scan, depth=5)
        model.init(X, rng=jax.random.key(1))

        def loss(w, remat, m=model):
            y, new_state = m.forward_with_state(x, w, m.state, jax.random.key(7), remat=remat)
            return jnp.sum(jnp.sin(y)), (y, new_state)
        run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
        assert_trees_close(run(model.weights, RematSchedule(every)),
                           run(model.weights, None), rtol=1e-6, atol=1e-7)
