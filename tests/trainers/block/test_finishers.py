"""Tests for revtrain.trainers.block.finishers: what a backward op does with its gradient,
on one standard layer's fbo program (`programs.make_program` of a run of one whose input
was stashed), and that the flag
the finishers replaced is gone from the package."""
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain.parallel.placement import Placement
from revtrain.trainers.block import finishers
from revtrain.trainers.block.contract import FboArgs, FboOut, NormOut, Shared
from revtrain.trainers.block.finishers import NORM, UPDATE
from revtrain.trainers.block.plan import OpKind, Run
from revtrain.trainers.block.programs import make_program
from revtrain.trainers.common.protocols import Params

D = 8


def _fbo(finisher):
    """A Dense layer's fbo program with ``finisher``, its arguments and its params."""
    placement = Placement.resolve(n_devices=1)
    layer = tl.Dense(D)
    layer.init(jax.ShapeDtypeStruct((2, 3, D), jnp.float32), rng=jax.random.key(0))
    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    program, _ = make_program(OpKind.BACKWARD, [layer], Run(0, 1, 1, 0, kept=(0,)), sgd,
                              placement, finisher=finisher)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1, 2, 3, D)), jnp.float32)
    args = FboArgs(x, jax.tree.map(lambda a: a[None], layer.state),
                   jax.random.key_data(jax.random.split(jax.random.key(1), 1))[None],
                   jnp.asarray(rng.normal(size=(1, 2, 3, D)), jnp.float32))
    params = Params(jax.tree.map(jnp.array, layer.weights), sgd.init(layer.weights))
    return program, args, params, Shared(jnp.int32(0), jnp.float32(0.1))


def test_the_norm_finisher_gives_the_squared_norm_of_the_gradient_the_update_uses():
    program, args, params, shared = _fbo(UPDATE)
    weights = params.weights
    updated = program(args, jax.tree.map(jnp.array, params), shared)
    norm, args2, _, _ = _fbo(NORM)
    normed = norm(args2, weights, shared)
    assert isinstance(updated, FboOut) and isinstance(normed, NormOut)
    np.testing.assert_allclose(normed.squared_norm, updated.stats.gradients_l2 ** 2,
                               rtol=1e-6)
    np.testing.assert_array_equal(normed.ct_x, updated.ct_x)
    assert normed.x is None  # An fbo reconstructs no input.


@pytest.mark.parametrize("finisher,donated", [(UPDATE, True), (NORM, False)])
def test_a_finisher_says_whether_its_program_donates_the_values(finisher, donated):
    program, args, params, shared = _fbo(finisher)
    values = params if donated else params.weights
    program(args, values, shared)
    weights = values.weights if donated else values  # (Scalar slots may stay.)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(weights)) == donated
    assert finisher.donates_values == donated


def test_the_norm_finisher_leaves_the_stashes_and_fetches_weights_only():
    class Store:
        def weights(self, key):
            return ("weights", key)

        def params(self, key):
            return ("params", key)
    assert NORM.values(Store(), 3) == ("weights", 3) and not NORM.consumes_kept
    assert UPDATE.values(Store(), 3) == ("params", 3) and UPDATE.consumes_kept
    assert {NORM, UPDATE} == {finishers.Norm(), finishers.Update()}  # Values, hashable.


def test_no_norm_only_flag_is_left_in_the_package():
    root = pathlib.Path(finishers.__file__).parents[2]
    assert [str(p) for p in root.rglob("*.py") if "norm_only" in p.read_text()] == []
