"""Tests for revtrain.layers.remat: `Remat` computes its layer exactly, under jax.checkpoint;
`RematSchedule` and `checkpoint_policy` name a bad argument and the fix."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.layers import (
    Dense,
    Dropout,
    Relu,
    Remat,
    RematSchedule,
    ReversibleHalfResidual,
    ReversibleLayer,
    Serial,
    ShapeDtype,
    checkpoint_policy,
)
from revtrain.layers.normalization import BatchNorm, LayerNorm
from tests.tree_utils import assert_trees_close

BATCH, LENGTH, D = 2, 4, 8


def _half_residual():
    return ReversibleHalfResidual(LayerNorm(), Dense(D), Relu(), Dropout(0.3))


def _inputs(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(k1, (BATCH, LENGTH, D)), jax.random.normal(k2, (BATCH, LENGTH, D)))


def _signature(x):
    return jax.tree.map(lambda a: ShapeDtype(a.shape, a.dtype), x)


def _loss(layer):
    def loss(w, x, rng):
        y, _ = layer.pure_fn(x, w, layer.state, rng)
        return sum(jnp.sum(jnp.sin(a)) for a in jax.tree.leaves(y))
    return loss


def test_same_values_and_grads_as_the_wrapped_layer_with_dropout():
    x, rng = _inputs(), jax.random.key(7)
    plain = _half_residual()
    plain.init(_signature(x), jax.random.key(1))
    remat = Remat(_half_residual())
    remat.init(_signature(x), jax.random.key(1))
    assert_trees_close(remat.weights, (plain.weights,))
    assert remat.n_in == plain.n_in == 2 and remat.n_out == plain.n_out == 2

    y_plain, _ = plain.pure_fn(x, plain.weights, plain.state, rng)
    y_remat, _ = remat.pure_fn(x, remat.weights, remat.state, rng)
    assert_trees_close(y_remat, y_plain)
    # Dropout really acted (so equal outputs mean equal masks, i.e. the rng is not split).
    y_other, _ = plain.pure_fn(x, plain.weights, plain.state, jax.random.key(8))
    assert not np.allclose(np.asarray(y_other[0]), np.asarray(y_plain[0]))

    g_plain = jax.grad(_loss(plain), argnums=(0, 1))(plain.weights, x, rng)
    g_remat = jax.grad(_loss(remat), argnums=(0, 1))(remat.weights, x, rng)
    assert_trees_close(g_remat, ((g_plain[0],), g_plain[1]))


def test_gradient_recomputes_the_forward_pass_under_checkpoint():
    x, rng = _inputs(), jax.random.key(0)
    remat = Remat(_half_residual())
    remat.init(_signature(x), jax.random.key(1))
    jaxpr = str(jax.make_jaxpr(jax.grad(_loss(remat)))(remat.weights, x, rng))
    assert "checkpoint" in jaxpr or "remat" in jaxpr
    plain = _half_residual()
    plain.init(_signature(x), jax.random.key(1))
    plain_jaxpr = str(jax.make_jaxpr(jax.grad(_loss(plain)))(plain.weights, x, rng))
    assert "checkpoint" not in plain_jaxpr and "remat" not in plain_jaxpr


def test_state_is_the_wrapped_layers_in_a_one_tuple():
    x = jax.random.normal(jax.random.key(0), (BATCH * 4, D))
    remat = Remat(Serial(Dense(D), BatchNorm(axis=(0,))))
    remat.init(_signature(x))
    y, new_state = remat.pure_fn(x, remat.weights, remat.state, None)
    inner = remat.sublayers[0]
    y_inner, inner_state = inner.pure_fn(x, inner.weights, inner.state, None)
    assert_trees_close(y, y_inner)
    assert_trees_close(new_state, (inner_state,))
    assert not np.allclose(np.asarray(jax.tree.leaves(new_state)[0]),
                           np.asarray(jax.tree.leaves(remat.state)[0]))


def test_policy_saving_dots_keeps_values_and_changes_the_structure_key():
    x, rng = _inputs(), jax.random.key(3)
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    remat = Remat(_half_residual(), policy=policy)
    remat.init(_signature(x), jax.random.key(1))
    plain = _half_residual()
    plain.init(_signature(x), jax.random.key(1))
    g_remat = jax.grad(_loss(remat))(remat.weights, x, rng)
    g_plain = jax.grad(_loss(plain))(plain.weights, x, rng)
    assert_trees_close(g_remat, (g_plain,))
    assert remat.structure_key != Remat(_half_residual()).structure_key
    assert Remat(_half_residual()).structure_key == Remat(_half_residual()).structure_key
    assert remat.structure_key is not None


def test_is_not_reversible_and_rejects_non_layers():
    assert not isinstance(Remat(_half_residual()), ReversibleLayer)
    with pytest.raises(TypeError, match="Remat wraps a Layer; got function"):
        Remat(lambda x: x)


def test_wrong_weights_structure_names_the_fix():
    x = _inputs()
    remat = Remat(_half_residual())
    remat.init(_signature(x))
    with pytest.raises(Exception, match=r"Remat expects 1 weights .* but got 2; pass the "
                                        r"tuple of its sublayers' weights"):
        remat.pure_fn(x, remat.weights[0], remat.state, None)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(every=0), ValueError, "RematSchedule every=0 must be an int >= 1"),
    (dict(every=True), ValueError, "RematSchedule every=True must be an int >= 1"),
    (dict(every="2"), ValueError, "RematSchedule every='2' must be an int >= 1"),
    (dict(policy="dots_saveable"), TypeError, "RematSchedule policy='dots_saveable' is not "
                                              "callable; use a jax.checkpoint_policies member"),
    (dict(include_last=1), TypeError, "RematSchedule include_last=1 must be True or False"),
])
def test_remat_schedule_names_a_bad_field_and_the_fix(kwargs, error, message):
    with pytest.raises(error, match=f"^{message}"):
        RematSchedule(**kwargs)


def test_checkpoint_policy_takes_a_policy_or_its_name():
    policies = jax.checkpoint_policies
    assert checkpoint_policy(None) is None
    assert checkpoint_policy(policies.nothing_saveable) is policies.nothing_saveable
    assert (checkpoint_policy("dots_with_no_batch_dims_saveable")
            is policies.dots_with_no_batch_dims_saveable)
    names = policies.save_only_these_names("x")  # A factory's result is a policy.
    assert checkpoint_policy(names) is names


@pytest.mark.parametrize("policy, error, message", [
    ("save_only_these_names", ValueError,
     r"remat_policy='save_only_these_names' is not a policy of jax.checkpoint_policies; use "
     r"one of \[.*'dots_saveable'.*'nothing_saveable'"),
    ("no_such_policy", ValueError, "remat_policy='no_such_policy' is not a policy of "),
    (3, TypeError, "remat_policy=3 is not callable; use a jax.checkpoint_policies member "
                   r"\(or its name\)"),
])
def test_checkpoint_policy_names_a_bad_policy_and_the_fix(policy, error, message):
    with pytest.raises(error, match=f"^{message}"):
        checkpoint_policy(policy)
