"""Models and helpers shared by the trainer tests."""
import jax
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from tests.tree_utils import float_stats

VOCAB, LENGTH, D = 16, 6, 8


def _half_residual_pair(d_model: int = D):
    return [tl.ReversibleHalfResidual(tl.LayerNorm(), tl.Dense(d_model), tl.Dropout(0.2)),
            tl.ReversibleSwap(),
            tl.ReversibleHalfResidual(tl.Dense(d_model), tl.Relu(), tl.Dropout(0.1)),
            tl.ReversibleSwap()]


def make_blocks(kind: str = "one", d_model: int = D):
    """``(blocks, loss_layer)`` of a small LM with dropout everywhere (not initialised),
    of width ``d_model``.

    kind: ``'one'`` -- embedding, dropout, two half-residual pairs, loss with dropout;
    ``'two'`` -- two blocks; ``'empty'`` -- a second block with no reversible layers.
    """
    first = (tl.Serial(tl.Embedding(VOCAB, d_model), tl.Dropout(0.1), tl.Dup()),
             _half_residual_pair(d_model) + _half_residual_pair(d_model))
    head = [tl.Dense(VOCAB), tl.LogSoftmax(), tl.Dropout(0.1), tl.CrossEntropyLoss()]
    if kind == "one":
        return [first], tl.Serial(tl.Concatenate(), *head)
    if kind == "two":
        second = (tl.Serial(tl.Parallel(tl.Dense(d_model), None)),
                  _half_residual_pair(d_model))
        return [first, second], tl.Serial(tl.Concatenate(), *head)
    if kind == "empty":
        second = (tl.Serial(tl.Concatenate(), tl.Dense(d_model), tl.Relu()), [])
        return [first, second], tl.Serial(*head)
    raise ValueError(kind)


def make_batch(batch_size: int = 8, seed: int = 0):
    rs = np.random.RandomState(seed)
    tokens = rs.randint(0, VOCAB, (batch_size, LENGTH + 1)).astype(np.int32)
    weights = (rs.rand(batch_size, LENGTH) > 0.2).astype(np.float32)
    return tokens[:, :-1], tokens[:, 1:], weights


def signature(batch):
    return tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in batch)


def initialised_blocks(kind: str, batch, weights=None, seed: int = 0, d_model: int = D):
    """Builds and initialises blocks; optionally sets the flat weights to ``weights``."""
    blocks, loss = make_blocks(kind, d_model)
    tl.init_reversible_blocks(blocks, loss, signature(batch), jax.random.key(seed))
    if weights is not None:
        tl.Serial(tl.blocks_to_layers(blocks, loss)).weights = weights
    return blocks, loss


def flat_weights(blocks, loss):
    """Host copies of ``Serial(*blocks_to_layers(blocks, loss)).weights``."""
    return jax.tree.map(np.asarray, tl.Serial(tl.blocks_to_layers(blocks, loss)).weights)


def deep_blocks(n_layers: int, d: int, batch):
    """Initialised ``(blocks, loss)``: ``n_layers`` reversible half-residual ``Dense(d)``
    and swap layers after an embedding; the layers hold numpy weights."""
    revs = []
    for _ in range(n_layers // 2):
        revs += [tl.ReversibleHalfResidual(tl.Dense(d)), tl.ReversibleSwap()]
    blocks = [(tl.Serial(tl.Embedding(VOCAB, d), tl.Dup()), revs)]
    loss = tl.Serial(tl.Concatenate(), tl.Dense(VOCAB), tl.LogSoftmax(),
                     tl.CrossEntropyLoss())
    tl.init_reversible_blocks(blocks, loss, signature(batch), jax.random.key(0))
    tl.Serial(tl.blocks_to_layers(blocks, loss)).weights = flat_weights(blocks, loss)
    return blocks, loss


def adam():
    return optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)


@pytest.fixture
def batch():
    return make_batch()


STEPS = 3
LR_OVERRIDE = {1: 3e-3}  # step -> learning_rate passed to one_step


def run_steps(trainer, batch, steps=STEPS):
    """Runs ``steps`` steps (a learning-rate override on step 1); returns the losses."""
    losses = []
    for step in range(steps):
        loss, stats = trainer.one_step(batch, jax.random.key(100 + step), step=step,
                                       learning_rate=LR_OVERRIDE.get(step))
        assert float(stats["loss"]) == pytest.approx(float(loss))
        losses.append(float(loss))
    return losses


def stepped_stats(trainer, batch, steps=STEPS, first_key=100):
    """Runs ``steps`` steps (keys ``first_key + step``, a learning-rate override on step
    1); returns each step's stats and loss as host floats (`tests.tree_utils.float_stats`),
    for comparing two trainers entry by entry."""
    out = []
    for step in range(steps):
        loss, stats = trainer.one_step(batch, jax.random.key(first_key + step), step=step,
                                       learning_rate=LR_OVERRIDE.get(step))
        out.append(float_stats({**stats, "loss": loss}))
    return out


def gradient_recorder():
    """An optax transformation that keeps the last gradient as its state and updates
    nothing: after one step a trainer's ``slots`` are exactly its gradients."""
    def init(params):
        return jax.tree.map(jax.numpy.zeros_like, params)

    def update(grads, state, params=None):
        del state, params
        return jax.tree.map(jax.numpy.zeros_like, grads), grads
    return optax.GradientTransformation(init, update)


def relative_errors(trees, reference):
    """``||a - b|| / ||b||`` per pair of trees, for the pairs whose reference is non-zero."""
    errors = []
    for tree, ref in zip(trees, reference, strict=True):
        a, b = (np.concatenate([np.ravel(np.asarray(x, np.float64))
                                for x in jax.tree.leaves(t)] or [np.zeros(0)])
                for t in (tree, ref))
        if np.linalg.norm(b) > 0:
            errors.append(float(np.linalg.norm(a - b) / np.linalg.norm(b)))
    return errors
