"""`revtrain.layers.run_layout`: runs held stacked; `run_in_series` scans them as they are."""
import jax
import numpy as np

from revtrain import layers as tl
from revtrain.layers.run_layout import RunLayout
from revtrain.layers.scan import StackedRun


def _model():
    inner = tl.Serial(*[tl.Dense(4) for _ in range(3)])
    model = tl.Serial(tl.Dense(4), inner, *[tl.Serial(tl.Dense(4), tl.Relu()) for _ in range(5)],
                      tl.Dense(3))
    model.init(jax.ShapeDtypeStruct((2, 4), np.float32), jax.random.key(0))
    return model


def test_stack_and_unstack_round_trip_with_nested_runs():
    model = _model()
    layout = RunLayout.of(model, model.weights, model.state)
    held = layout.stack(model.weights)
    assert len(held) == len(model.weights)  # One entry per sublayer: a run, then None.
    assert isinstance(held[2], StackedRun) and (held[2].period, held[2].repeats) == (1, 5)
    assert held[3:7] == (None,) * 4
    assert isinstance(held[1][0], StackedRun)  # The nested Serial's run too.
    back = layout.unstack(held)
    assert jax.tree.structure(back) == jax.tree.structure(model.weights)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(model.weights), strict=True):
        np.testing.assert_array_equal(a, b)
    cut, cut_layout = layout.truncated(model.weights)
    assert len(cut) == len(model.weights) - 3 and len(cut[1]) == 2
    assert cut_layout.runs == ((2, 1, 2),)


def test_a_model_runs_its_stacked_weights_as_it_runs_its_own():
    model = _model()
    held = RunLayout.of(model, model.weights, model.state).stack(model.weights)
    x, rng = np.random.RandomState(0).randn(2, 4).astype(np.float32), jax.random.key(1)
    expected, _ = model.pure_fn(x, model.weights, model.state, rng)
    actual, _ = jax.jit(model.pure_fn)(x, held, model.state, rng)
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)
    loss = lambda w: model.pure_fn(x, w, model.state, rng)[0].sum()  # noqa: E731
    grads = jax.grad(loss)(held)
    assert jax.tree.structure(grads) == jax.tree.structure(held)  # Gradients stay stacked.


def test_a_stacked_run_after_a_layer_that_changes_the_width_gives_the_unstacked_result():
    model = tl.Serial(*[tl.Dense(4) for _ in range(3)])  # The first Dense maps 2 -> 4.
    model.init(jax.ShapeDtypeStruct((2, 2), np.float32), jax.random.key(0))
    held = (StackedRun((jax.tree.map(lambda *a: np.stack(a), *model.weights[1:]),), 1, 2),
            None)
    weights = (model.weights[0], *held)  # Layers 1-2 stacked; layer 0 changes the width.
    x = np.ones((2, 2), np.float32)
    expected, _ = model.pure_fn(x, model.weights, model.state, jax.random.key(1))
    actual, _ = model.pure_fn(x, weights, model.state, jax.random.key(1))
    np.testing.assert_array_equal(actual, expected)
