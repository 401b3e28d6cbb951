"""Tests for revtrain.trainers.block.programs: one builder and one cache over runs.

The gate of issue 44: a lone layer is a run of one repetition, and the program the one
builder makes for it lowers to the same text, up to names, as the per-layer program the
block trainers ran before there was one builder (`_per_layer`, written out here as it
was), for one layer of each kind: the embedding, a half-residual and the loss, with
either finisher."""
import functools
import re

import jax
import pytest

from revtrain.parallel import collectives as fsdp
from revtrain.parallel.collectives import DEV, REP
from revtrain.trainers import ReversibleSerialTrainer
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
from tests.trainers.conftest import adam, initialised_blocks


def _per_layer(kind, layer, optimizer, placement, finisher):
    """The per-layer program as the block trainers built it before issue 44's step 3."""
    if kind == OpKind.FORWARD:
        run, _ = fsdp.gathering_shard_map(
            lambda a, w, i: bodies.forward(layer, a, w, i), placement,
            ForwardOut(DEV, DEV, None), with_grads=False, stack=stack_of)
        return Program(lambda args, weights, shared: run(args, weights, shared.index),
                       donate_values=False)
    body, out_specs = {
        OpKind.FBO: (bodies.std_grads, FboOut(DEV, None, None)),
        OpKind.REVERSE: (bodies.reverse_grads, ReverseOut(DEV, DEV, None, None)),
        OpKind.LOSS: (functools.partial(bodies.loss_grads, axes=placement.device_axes),
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


def _kind(label, args):
    root = label.removeprefix(NORM.label).split("/")[0]
    if root == "backward":
        return OpKind.FBO if isinstance(args[0], FboArgs) else OpKind.REVERSE
    return OpKind(root)


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
        kind, layer = _kind(label, args), trainer.layers[i]
        new, _ = make_program(kind, [layer], Run(i, 1, 1, 0), optimizer, placement, finisher)
        old = _per_layer(kind, layer, optimizer, placement, finisher)
        assert _normalized(new.lower(*args)) == _normalized(old.lower(*args)), label
        checked.add((kind, i, finisher.label))
    assert {(OpKind.FORWARD, 0), (OpKind.FBO, 0), (OpKind.FORWARD, 1), (OpKind.REVERSE, 1),
            (OpKind.LOSS, loss_at)} == {(k, i) for k, i, _ in checked}
    assert {f for _, _, f in checked} == {"", "norm/"}


def test_a_run_of_one_repetition_of_several_layers_is_refused(batch):
    blocks, loss = initialised_blocks("one", batch)
    layers = [blocks[0][1][0], blocks[0][1][1]]
    with pytest.raises(ValueError, match="neither one layer nor two or more repetitions"):
        make_program(OpKind.REVERSE, layers, Run(1, 2, 1, 2), adam(), None)


def test_one_cache_keys_lone_layers_and_runs_alike(batch):
    blocks, loss = initialised_blocks("one", batch)
    trainer = ReversibleSerialTrainer(blocks, loss, adam, n_devices=1, scan_layers=True)
    trainer.one_step(batch, jax.random.key(0))
    names = [name for name in trainer.trace_counts() if "/" in name]
    assert any(re.search(r"x\d+x\d+#", name) for name in names), names  # A scan...
    assert any(name.startswith("forward/") for name in names)  # ...and lone layers.
    cache = ProgramCache(trainer.placement, adam())
    assert cache.n_built == 0 and cache.trace_counts() == {}
