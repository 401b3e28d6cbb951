"""Tests of revtrain/training/optimizers.py."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from revtrain.training import optimizer_fn


def test_learning_rate_is_injectable_and_sets_the_update():
    opt = optimizer_fn("sgd", learning_rate=0.5)
    params = {"w": jnp.array([1.0, -2.0])}
    state = opt.init(params)
    assert float(state.hyperparams["learning_rate"]) == 0.5
    state.hyperparams["learning_rate"] = jnp.asarray(0.25)
    updates, _ = opt.update({"w": jnp.array([4.0, 8.0])}, state, params)
    np.testing.assert_allclose(updates["w"], [-1.0, -2.0])


def test_hyperparameters_pass_through():
    state = optimizer_fn("adam", learning_rate=1e-3, b2=0.98).init({"w": jnp.zeros(2)})
    assert float(state.hyperparams["b2"]) == pytest.approx(0.98)


def test_clip_gradient_norm_clips_before_the_update():
    opt = optimizer_fn("sgd", learning_rate=1.0, clip_gradient_norm=1.0)
    params = {"w": jnp.zeros(2)}
    state = opt.init(params)
    assert "learning_rate" in state.hyperparams
    updates, _ = opt.update({"w": jnp.array([3.0, 4.0])}, state, params)
    np.testing.assert_allclose(updates["w"], [-0.6, -0.8], rtol=1e-6)
    assert optax.tree.get(state, "learning_rate") == 1.0


@pytest.mark.parametrize("name", ["nonexistent", "chain", "_src", "global_norm"])
def test_unknown_name(name):
    with pytest.raises(ValueError, match=repr(name)):
        optimizer_fn(name)


def test_unknown_hyperparameter_names_the_optimizer():
    with pytest.raises(TypeError, match="optax.adam does not accept"):
        optimizer_fn("adam", bogus=1.0)


def test_bad_clip_norm():
    with pytest.raises(ValueError, match="clip_gradient_norm=0"):
        optimizer_fn("adam", clip_gradient_norm=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(clip_gradient_norm=float("nan")), "optimizer_fn.clip_gradient_norm=nan must be"),
    (dict(learning_rate=float("inf")), "optimizer_fn.learning_rate=inf must be a finite"),
    (dict(learning_rate=-1e-3), "optimizer_fn.learning_rate=-0.001 must be a finite"),
    (dict(b2=float("inf")), "optimizer_fn.b2=inf must be a finite number; change the gin "
                            "binding optimizer_fn.b2"),
    (dict(eps=float("nan")), "optimizer_fn.eps=nan must be a finite number"),
    (dict(b2=1.5), r"optimizer_fn.b2=1.5 must be in \[0, 1\) \(the decay rate of a moving "
                   r"average\); change the gin binding optimizer_fn.b2"),
    (dict(b1=1.0), r"optimizer_fn.b1=1.0 must be in \[0, 1\)"),
    (dict(b1=-0.1), r"optimizer_fn.b1=-0.1 must be in \[0, 1\)"),
    (dict(eps=-1e-8), r"optimizer_fn.eps=-1e-08 must be in \[0, inf\)"),
    (dict(weight_decay=-1e-4), r"optimizer_fn.weight_decay=-0.0001 must be in \[0, inf\)"),
])
def test_numbers_that_a_step_would_turn_into_nan_are_refused_naming_the_binding(kwargs,
                                                                                match):
    with pytest.raises(ValueError, match=match):
        optimizer_fn("adam", **kwargs)


@pytest.mark.parametrize("name, kwargs", [
    ("adam", dict(b1=0.0, b2=0.0, eps=0.0)), ("adamw", dict(weight_decay=0.0)),
    ("sgd", dict(momentum=1.0)), ("rmsprop", dict(decay=1.0)),
])
def test_the_ends_of_each_range_that_are_valid_are_accepted(name, kwargs):
    optimizer_fn(name, **kwargs)  # No error.

