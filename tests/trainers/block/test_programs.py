"""Tests for revtrain.trainers.block.programs: one builder and one cache over runs.

The gate of issue 44: a lone layer is a run of one repetition, and the program the one
builder makes for it lowers to the same text, up to names, as the per-layer program the
block trainers ran before there was one builder (`_per_layer`, written out here as it
was), for one layer of each kind: the embedding, a half-residual and the loss, with
either finisher. Also: which layers share a program, and revtrain.trainers.common.global_loss
(the loss share)."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain.layers import Layer
from revtrain.parallel import collectives as fsdp
from revtrain.parallel.collectives import DEV, REP
from revtrain.trainers import ReversibleSerialTrainer, Trainer
from revtrain.trainers.block import bodies
from revtrain.trainers.block.contract import (
    FboArgs,
    FboOut,
    ForwardOut,
    LossOut,
    ReverseOut,
    stack_of,
)
from revtrain.trainers.block.donation import Program
from revtrain.trainers.block.finishers import NORM, UPDATE
from revtrain.trainers.block.plan import OpKind, Run
from revtrain.trainers.block.programs import ProgramCache, make_program
from tests.trainers.conftest import VOCAB, adam, initialised_blocks, signature
from tests.tree_utils import assert_trees_close


def _per_layer(kind, layer, optimizer, placement, finisher):
    """The per-layer program of ``kind`` (``'forward'``, ``'fbo'``, ``'reverse'`` or
    ``'loss'``) as the block trainers built it before issue 44's step 3."""
    if kind == "forward":
        run, _ = fsdp.gathering_shard_map(
            lambda a, w, i: bodies.forward(layer, a, w, i), placement,
            ForwardOut(DEV, DEV, None), with_grads=False, stack=stack_of)
        return Program(lambda args, weights, shared: run(args, weights, shared.index),
                       donate_values=False)
    body, out_specs = {
        "fbo": (bodies.std_grads, FboOut(DEV, None, None)),
        "reverse": (bodies.reverse_grads, ReverseOut(DEV, DEV, None, None)),
        "loss": (functools.partial(bodies.loss_grads, axes=placement.device_axes),
                      LossOut(REP, DEV, None, DEV, None)),
    }[kind]
    run, _ = fsdp.gathering_shard_map(lambda a, w, i: body(layer, a, w, i), placement,
                                      out_specs, with_grads=True, stack=stack_of)

    def program(args, values, shared):
        out, grads = run(args, finisher.weights(values), shared.index)
        return finisher.finish(out, grads, values, shared, optimizer, placement)
    return Program(program, donate_values=finisher.donates_values)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def _calls(trainer, batch):
    """``{label: abstract args}`` of every program one step dispatches."""
    calls = {}

    class Watch:
        def on_dispatch(self, label, fn, args):
            calls.setdefault(label, _abstract(tuple(args)))

    trainer.observers.append(Watch())
    trainer.one_step(batch, jax.random.key(0))
    return calls


def _normalized(lowered):
    """Lowered text up to names: symbols and locations dropped."""
    text = re.sub(r"@[\w$.-]+", "@f", lowered.as_text())
    return re.sub(r"loc\([^)]*\)", "", text)


def _kinds(label, args, i):
    """The per-layer program's kind of the op ``label`` called with ``args``, and the op
    kind and run of one repetition of layer ``i`` that replace it."""
    kind = OpKind(label.removeprefix(NORM.label).split("/")[0])
    if kind != OpKind.BACKWARD:
        return str(kind), kind, Run(i, 1, 1, 0)
    if isinstance(args[0], FboArgs):  # Recomputed from its stashed input.
        return "fbo", kind, Run(i, 1, 1, 0, kept=(0,))
    return "reverse", kind, Run(i, 1, 1, 0)


def test_a_lone_layer_is_a_run_of_one_whose_program_lowers_as_its_per_layer_one(batch):
    blocks, loss = initialised_blocks("one", batch)
    trainer = ReversibleSerialTrainer(blocks, loss, adam, n_devices=1, scan_layers=False,
                                      clip_global_norm=1.0)
    optimizer, placement = adam(), trainer.placement
    loss_at = len(trainer.layers) - 1
    checked = set()
    for label, args in _calls(trainer, batch).items():
        i = int(label.rsplit("layer", 1)[1]) if "layer" in label else None
        if i not in (0, 1, loss_at):  # The embedding, a half-residual, the loss.
            continue
        finisher = NORM if label.startswith(NORM.label) else UPDATE
        (old_kind, kind, run), layer = _kinds(label, args, i), trainer.layers[i]
        new, _ = make_program(kind, [layer], run, optimizer, placement, finisher)
        old = _per_layer(old_kind, layer, optimizer, placement, finisher)
        assert _normalized(new.lower(*args)) == _normalized(old.lower(*args)), label
        checked.add((old_kind, i, finisher.label))
    assert {("forward", 0), ("fbo", 0), ("forward", 1), ("reverse", 1),
            ("loss", loss_at)} == {(k, i) for k, i, _ in checked}
    assert {f for _, _, f in checked} == {"", "norm/"}


def test_a_run_of_one_repetition_of_several_layers_is_refused(batch):
    blocks, loss = initialised_blocks("one", batch)
    layers = [blocks[0][1][0], blocks[0][1][1]]
    with pytest.raises(ValueError, match="neither one layer nor two or more repetitions"):
        make_program(OpKind.BACKWARD, layers, Run(1, 2, 1, 2), adam(), None)


def test_one_cache_keys_lone_layers_and_runs_alike(batch):
    blocks, loss = initialised_blocks("one", batch)
    trainer = ReversibleSerialTrainer(blocks, loss, adam, n_devices=1, scan_layers=True)
    trainer.one_step(batch, jax.random.key(0))
    names = [name for name in trainer.trace_counts() if "/" in name]
    assert any(re.search(r"x\d+x\d+#", name) for name in names), names  # A scan...
    assert any(name.startswith("forward/") for name in names)  # ...and lone layers.
    cache = ProgramCache(trainer.placement, adam())
    assert cache.n_built == 0 and cache.trace_counts() == {}


D = 8


def Scale(s):  # noqa: N802 -- a layer factory, named like the layer it builds.
    """A layer class defined in a function, capturing ``s``: its identity is unprovable."""

    class _Scale(Layer):
        def forward_with_state(self, x, weights, state, rng):
            return x * s, state

    return _Scale()


def _model(middle):
    """Embedding, two reversible layers built by ``middle(i)``, a loss."""
    blocks = [(tl.Serial(tl.Embedding(VOCAB, D), tl.Dup()),
               [tl.ReversibleHalfResidual(tl.Dense(D), middle(0)), tl.ReversibleSwap(),
                tl.ReversibleHalfResidual(tl.Dense(D), middle(1)), tl.ReversibleSwap()])]
    loss = tl.Serial(tl.Concatenate(), tl.Dense(VOCAB), tl.LogSoftmax(),
                     tl.CrossEntropyLoss())
    return blocks, loss


def _sgd():
    return optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)


@pytest.mark.parametrize("middle", [
    lambda i: Scale([2.0, 3.0][i]),
    lambda i: tl.Fn("scale", [lambda x: x * 2.0, lambda x: x * 3.0][i]),
], ids=["class_in_a_function", "fn_of_lambdas"])
def test_layers_whose_identity_is_unprovable_do_not_share_a_program(middle, batch):
    blocks, loss = _model(middle)
    tl.init_reversible_blocks(blocks, loss, signature(batch), jax.random.key(0))
    flat = tl.blocks_to_layers(blocks, loss)
    w0 = jax.tree.map(np.array, tl.Serial(flat).weights)
    assert flat[1].structure_key is None and flat[3].structure_key is None
    rev = ReversibleSerialTrainer(blocks, loss, _sgd, n_devices=1)
    plain_blocks, plain_loss = _model(middle)
    plain_flat = tl.blocks_to_layers(plain_blocks, plain_loss)
    plain_model = tl.Serial(plain_flat)
    plain_model.init(signature(batch))
    plain_model.weights = w0
    plain = Trainer(plain_model, _sgd, n_devices=1)
    for step in range(2):
        rev_loss, _ = rev.one_step(batch, jax.random.key(step))
        plain_loss_value, _ = plain.one_step(batch, jax.random.key(step))
        assert float(rev_loss) == pytest.approx(float(plain_loss_value), rel=1e-5)
    assert_trees_close(rev.weights, plain.weights, rtol=1e-5, atol=1e-5)


def test_identical_layers_share_one_program_per_kind(batch):
    blocks, loss = _model(lambda i: tl.Relu())
    tl.init_reversible_blocks(blocks, loss, signature(batch), jax.random.key(0))
    rev = ReversibleSerialTrainer(blocks, loss, _sgd, n_devices=1, scan_layers=False)
    rev.one_step(batch, jax.random.key(0))
    counts = rev.trace_counts()
    # embedding: forward + fbo; the two half-residuals share forward + reverse; the swaps
    # share reverse (their forward only reorders the stack, on the host); the loss: loss_fbo;
    # and the whole model's gradient norm.
    assert len(counts) == 7 and set(counts.values()) == {1}, counts
    assert "step_summary" in counts
    assert not any(name.startswith("forward/ReversibleSwap") for name in counts), counts


def test_loss_share_is_each_devices_fraction_of_the_total_weight():
    from revtrain.parallel import transfers
    from revtrain.parallel.collectives import DEV
    from revtrain.parallel.placement import Placement, make_mesh
    from revtrain.trainers.common.global_loss import loss_share
    mesh = make_mesh(4)
    shares = jax.jit(jax.shard_map(lambda w: loss_share(w[0])[None], mesh=mesh,
                                   in_specs=DEV, out_specs=DEV))
    totals = transfers.shard_per_device(np.array([3.0, 1.0, 0.0, 4.0], np.float32),
                                        Placement(mesh))
    np.testing.assert_allclose(shares(totals), [3 / 8, 1 / 8, 0, 4 / 8])
    zeros = transfers.shard_per_device(np.zeros(4, np.float32), Placement(mesh))
    np.testing.assert_array_equal(shares(zeros), np.zeros(4))
    assert jnp.asarray(shares(totals)).dtype == jnp.float32
