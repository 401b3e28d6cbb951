"""`Trainer(remat=...)`: layers under ``jax.checkpoint``, the same step in less memory.

A rematerialised step computes what the plain one computes: losses, stats and updated
weights and slots are bitwise equal on CPU (1 and 4 devices, with FSDP, scanned or not,
dropout included; asserted bitwise on one device, to 1e-6 relative elsewhere); the values
and checkpoints keep their layout; and the compiled step's temporaries shrink.
"""
import jax
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain.trainers import Trainer
from tests.trainers.conftest import (
    adam,
    deep_blocks,
    initialised_blocks,
    make_batch,
    stepped_stats,
)
from tests.tree_utils import assert_trees_close


def _model(kind):
    """``'deep'``: 8 reversible layers (a run of 4 repetitions of half-residual, swap);
    ``'dropout'``: `make_blocks`' model with dropout everywhere."""
    batch = make_batch()
    if kind == "deep":
        blocks, loss = deep_blocks(8, 32, batch)  # d=32: FSDP shards 32x32 kernels.
    else:
        blocks, loss = initialised_blocks("two", batch, d_model=32)
    return tl.Serial(tl.blocks_to_layers(blocks, loss))


@pytest.mark.parametrize("placement, scan_layers, remat, kind", [
    (dict(n_devices=1), True, "layer", "deep"),
    (dict(n_devices=1), False, 3, "deep"),  # Groups of 3 repetitions and a remainder of 1.
    (dict(n_devices=1), True, 2, "dropout"),
    (dict(n_devices=4), True, 3, "deep"),
    (dict(n_devices=4), False, "layer", "dropout"),
    (dict(n_devices=4, fsdp=True), True, "layer", "deep"),
    (dict(n_devices=4, fsdp=True), False, 2, "deep"),
])
def test_a_rematerialised_step_equals_the_plain_one(placement, scan_layers, remat, kind):
    batch = make_batch()
    plain, checkpointed = (Trainer(_model(kind), adam, scan_layers=scan_layers, remat=r,
                                   **placement) for r in (None, remat))
    expected, actual = (stepped_stats(t, batch) for t in (plain, checkpointed))
    if placement["n_devices"] == 1:
        assert actual == expected
        for a, b in zip(jax.tree.leaves(checkpointed.train_state),
                        jax.tree.leaves(plain.train_state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
        for a, b in zip(actual, expected, strict=True):
            assert a == pytest.approx(b, rel=1e-6)
        assert_trees_close(checkpointed.train_state, plain.train_state, rtol=1e-6, atol=1e-7)
    assert checkpointed.trace_counts() == {"train_step": 1}


def test_values_and_checkpoints_keep_their_layout():
    batch = make_batch()
    plain, checkpointed = (Trainer(_model("deep"), adam, remat=r) for r in (None, 2))
    for part in ("weights", "slots"):
        for a, b in ((checkpointed.saved_values(part), plain.saved_values(part)),
                     (checkpointed.value_shardings(part), plain.value_shardings(part))):
            assert jax.tree.structure(a) == jax.tree.structure(b)
    plain.one_step(batch, jax.random.key(1))
    checkpointed.restore(plain.train_state)  # A plain run's checkpoint, resumed with remat.
    assert stepped_stats(checkpointed, batch) == stepped_stats(plain, batch)


# A model whose activations dominate: 8 feed-forward blocks ``[2, 512, 256]`` wide inside,
# 16 wide between them.
BATCH, LENGTH, D_MODEL, D_FF, VOCAB, DEPTH = 2, 512, 16, 256, 16, 8


def _feed_forward_model():
    model = tl.Serial(tl.Embedding(VOCAB, D_MODEL),
                      [tl.Residual(tl.Dense(D_FF), tl.Relu(), tl.Dense(D_MODEL))
                       for _ in range(DEPTH)],
                      tl.Dense(VOCAB), tl.LogSoftmax(), tl.CrossEntropyLoss())
    rs = np.random.RandomState(0)
    batch = (rs.randint(0, VOCAB, (BATCH, LENGTH)).astype(np.int32),
             rs.randint(0, VOCAB, (BATCH, LENGTH)).astype(np.int32),
             np.ones((BATCH, LENGTH), np.float32))
    model.init(tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in batch), jax.random.key(0))
    return model, batch


class _StepTemp:
    """Observer: ``memory_analysis().temp_size_in_bytes`` of the step, compiled for
    abstract copies of the arguments it gets."""

    def __init__(self):
        self.bytes = None

    def on_dispatch(self, label, fn, args):
        if label == "train_step" and self.bytes is None:
            abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=a.sharding) if isinstance(a, jax.Array) else a, args)
            compiled = fn.lower(*abstract).compile()
            self.bytes = compiled.memory_analysis().temp_size_in_bytes


def _step_temp(scan_layers=True, **remat):
    model, batch = _feed_forward_model()
    trainer = Trainer(model, lambda: optax.sgd(1e-3), n_devices=1, scan_layers=scan_layers,
                      **remat)
    observer = _StepTemp()
    trainer.observers.append(observer)
    trainer.one_step(batch, jax.random.key(1))
    return observer.bytes


@pytest.mark.parametrize("scan_layers", [True, False])
def test_remat_shrinks_the_temporaries_of_the_step(scan_layers):
    """Measured on CPU (MiB): plain 13.0, every 4 layers 8.1, every 2 5.5, every layer
    5.0 (scan_layers=False: 0.25 more each). Each layer stores two ``[2, 512, 256]``
    float32 activations (1 MiB each) without remat; with it, one ``[2, 512, 16]`` input
    per group, and one group's activations while its backward pass runs."""
    temp = {remat: _step_temp(scan_layers, remat=remat) for remat in (None, 2, "layer")}
    assert temp["layer"] < 0.5 * temp[None]
    assert temp["layer"] < temp[2] < temp[None]


def test_the_policy_reaches_the_checkpoints():
    """Saving everything undoes remat; ``dots_with_no_batch_dims_saveable`` (named) keeps
    the feed-forward matmul outputs, between the two (on CPU: 5.0, 11.0 and 13.0 MiB)."""
    saving = {policy: _step_temp(remat="layer", remat_policy=policy) for policy in (
        None, "dots_with_no_batch_dims_saveable", jax.checkpoint_policies.everything_saveable)}
    nothing, dots, everything = saving.values()
    assert nothing < dots < everything
    assert everything > 0.9 * _step_temp()


@pytest.mark.parametrize("options, error, message", [
    (dict(remat=0), ValueError, r"remat=0 must be None, 'layer' \(checkpoint every layer\) "
                                r"or an int k >= 1 \(every k layers\); use e.g. remat='layer'"),
    (dict(remat="every"), ValueError, "remat='every' must be None, 'layer' "),
    (dict(remat=True), ValueError, "remat=True must be None, 'layer' "),
    (dict(remat=1.5), ValueError, "remat=1.5 must be None, 'layer' "),
    (dict(remat="layer", remat_policy=3), TypeError,
     r"remat_policy=3 is not callable; use a jax.checkpoint_policies member \(or its name\)"),
    (dict(remat="layer", remat_policy="save_only_these_names"), ValueError,
     "remat_policy='save_only_these_names' is not a policy of jax.checkpoint_policies; use "
     "one of"),
    (dict(remat_policy="dots_saveable"), ValueError,
     "remat_policy='dots_saveable' has no effect without remat; also set remat='layer'"),
])
def test_a_bad_remat_option_is_one_line_naming_it_and_the_fix(options, error, message):
    with pytest.raises(error, match=f"^{message}") as raised:
        Trainer(_model("deep"), adam, **options)
    assert "\n" not in str(raised.value)


def test_remat_needs_a_serial():
    with pytest.raises(ValueError, match="^remat='layer' checkpoints the sublayers of a Serial, "
                                         "and model_with_loss is a Remat; pass Serial"):
        Trainer(tl.Remat(_model("deep")), adam, remat="layer")
