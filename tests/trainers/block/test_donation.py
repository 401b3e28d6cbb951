"""Tests for revtrain.trainers.block.donation: every block-trainer program donates what it
consumes (XLA's ``memory_analysis`` counts the aliased bytes), no pass-through item leaves
in a copy, and nothing that is still in use is donated."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain import memory
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
from revtrain.trainers.block import contract, donation
from revtrain.trainers.common.protocols import Params
from tests.trainers.conftest import (
    adam,
    flat_weights,
    initialised_blocks,
    make_batch,
    run_steps,
)
from tests.tree_utils import assert_trees_close


def _nbytes(tree):
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def _programs(trainer, batch):
    """``{label: (program, abstract args)}`` of every program one step dispatches."""
    calls = {}

    class Watch:
        def on_dispatch(self, label, fn, args):
            calls.setdefault(label, (fn, jax.tree.map(memory._abstract_leaf, tuple(args))))

    trainer.observers.append(Watch())
    trainer.one_step(batch, jax.random.key(0))
    trainer.block_until_ready()
    return calls


def _aliasable_items(program, args):
    """The float stack items and cotangents a program consumes (`contract.CONSUMED`) that an
    output of the same shape and dtype could take (the pairing is by multiset)."""
    outs = collections.Counter((x.shape, x.dtype) for x in jax.tree.leaves(
        jax.eval_shape(program, *args)))
    items = []
    for x in jax.tree.leaves([getattr(args[0], name) for name in contract.CONSUMED[type(args[0])]]):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim > 1 and outs[x.shape, x.dtype]:
            outs[x.shape, x.dtype] -= 1
            items.append(x)
    return items


@pytest.mark.parametrize("trainer_cls,kwargs", [
    (ReversibleSerialTrainer, {"scan_layers": False}),
    (ReversibleSerialTrainer, {"scan_layers": True}),
    (MemoryEfficientTrainer, {}),
    (ReversibleSerialTrainer, {"scan_layers": False, "clip_global_norm": 1.0}),
], ids=["per_layer", "scanned", "memory_efficient", "norm_pass"])
def test_every_program_aliases_what_it_consumes_and_copies_no_pass_through(
        trainer_cls, kwargs, batch):
    """Per program (forward, reverse, fbo, scans, norm-only), XLA aliases the stack items
    and cotangents it consumes and the params it updates to its outputs: its outputs add
    no buffers beside its inputs but the new state and the stats scalars. Without donation
    a half-residual's pass-through item (and every reconstructed input) would leave in a
    new output buffer."""
    trainer = trainer_cls(*initialised_blocks("one", batch), adam, n_devices=1, **kwargs)
    calls = _programs(trainer, batch)
    checked = set()
    for label, (program, args) in calls.items():
        if not isinstance(args[0], tuple(contract.CONSUMED)):
            continue  # A copy (`donation.copy`).
        consumed = _nbytes(_aliasable_items(program, args))
        if not consumed:
            continue  # E.g. the embedding: token ids in, float items out.
        stats = program.lower(*args).compile().memory_analysis()
        # The params' arrays (their scalars, e.g. Adam's count, may pair with any output).
        updated = (_nbytes([x for x in jax.tree.leaves(args[1]) if x.ndim])
                   if isinstance(args[1], Params) else 0)
        assert stats.alias_size_in_bytes >= consumed + updated, label
        # Not aliased: the new state, the stats and the output tuple's table (8 B a leaf).
        n_outputs = len(jax.tree.leaves(jax.eval_shape(program, *args)))
        new = _nbytes(getattr(args[0], "state", ())) + 8 * n_outputs + 4 * 2 * 8
        assert stats.output_size_in_bytes - stats.alias_size_in_bytes <= new, label
        checked.add(label.split("/")[-2] if label.startswith("norm/") else label.split("/")[0])
    assert {"forward", "backward"} <= checked


def test_a_program_donates_only_what_an_output_can_take():
    """Integer items (token ids) and items no output matches are not donated, so nothing
    is copied for them and JAX warns of no unusable donation; params always are."""
    x = jnp.ones((1, 4, 8))
    tokens = jnp.ones((1, 4), jnp.int32)

    def body(args, params, shared):
        del shared
        return contract.ForwardOut((args.x[0] * 2, params.sum() * jnp.ones((1, 4, 8))), ()), params

    program = donation.Program(body, donate_values=True)
    args = contract.ForwardArgs((x, tokens), (), jnp.zeros((1, 1, 2), jnp.uint32))
    assert program.donated(args, jnp.ones(3), None) == (True, False, False)
    assert donation.consumed_leaves(args) == (True, True, False)
    params = jnp.ones(3)
    out, _ = program(args, params, None)
    assert x.is_deleted() and params.is_deleted() and not tokens.is_deleted()
    np.testing.assert_array_equal(out.y[0], 2.0)


def test_owned_copies_a_donated_leaf_that_anything_else_holds():
    a, b, below = (jnp.full((3,), v) for v in (1.0, 2.0, 3.0))
    made = []

    def copy(leaf):
        made.append(leaf)
        return donation.copy(leaf)

    # Donated: a, b (twice) and below; held: below. Not donated: the state, which is a.
    args = contract.ReverseArgs((a, below), (b, b), a, (), None)
    donated = (True, True, True, True, False)
    owned = donation.owned(args, donated, held=((below,),), copy=copy)
    assert owned.y[0] is not a and owned.y[1] is not below  # a: the state reads it.
    assert owned.ct_y[0] is b and owned.ct_y[1] is not b  # The second b: a copy.
    assert owned.state is a and len(made) == 3
    assert len({id(x) for x in jax.tree.leaves((owned.y, owned.ct_y, a, below))}) == 6
    for got, want in zip(jax.tree.leaves(owned), jax.tree.leaves(args), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("trainer_cls,kwargs", [
    (ReversibleSerialTrainer, {"scan_layers": False, "keep_every": 2}),  # Stashed inputs.
    (ReversibleSerialTrainer, {"scan_layers": True, "keep_every": 2}),  # Kept copies.
    (ReversibleSerialTrainer, {"clip_global_norm": 0.05}),  # The final stack read twice.
    (ReversibleSerialTrainer, {"scan_layers": False, "clip_global_norm": 0.05}),
    (MemoryEfficientTrainer, {"keep_every": 2, "clip_global_norm": 0.05}),
], ids=["stashes", "scan_copies", "norm_pass", "norm_pass_per_layer", "memory_efficient"])
def test_nothing_still_in_use_is_donated(trainer_cls, kwargs):
    """Stashed block inputs, ``keep_every`` copies, the final stack (which the norm-only
    pass and then the update pass reverse from), the stack below an op and the caller's
    batch are never donated: the steps run (a deleted buffer would raise), the caller's
    arrays stay alive, and the results are `Trainer`'s."""
    batch = make_batch()
    device_batch = tuple(jnp.asarray(b) for b in batch)  # The caller's own device arrays.
    blocks, loss = initialised_blocks("two", batch)
    weights = flat_weights(blocks, loss)
    block_trainer = trainer_cls(blocks, loss, adam, n_devices=1, **kwargs)
    got = run_steps(block_trainer, device_batch, steps=2)
    assert not any(x.is_deleted() for x in device_batch)
    clip = kwargs.get("clip_global_norm")
    optimizer = adam if clip is None else (
        lambda: optax.chain(optax.clip_by_global_norm(clip), adam()))
    blocks, loss = initialised_blocks("two", batch, weights=weights, seed=1)
    reference = Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), optimizer, n_devices=1)
    np.testing.assert_allclose(got, run_steps(reference, batch, steps=2), rtol=1e-5)
    assert_trees_close(block_trainer.weights, reference.weights, rtol=1e-5, atol=1e-5)
