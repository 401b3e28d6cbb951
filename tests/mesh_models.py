"""A model, a batch and a two-step run shared by the mesh tests (one process and two)."""
import functools

import jax
import numpy as np
import optax

from revtrain import layers as tl
from revtrain.models import ReversibleTransformerLM
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer

VOCAB, D, BATCH, LENGTH = 16, 32, 8, 8
TRAINERS = {"Trainer": Trainer, "ReversibleSerialTrainer": ReversibleSerialTrainer,
            "MemoryEfficientTrainer": MemoryEfficientTrainer}


def global_batch():
    """``(inputs, targets, weights)`` ``[8, 8]``: row 0 partly padded, rows 6-7 all
    padding, so the devices' weight totals differ on every mesh."""
    rs = np.random.RandomState(0)
    tokens = rs.randint(0, VOCAB, (BATCH, LENGTH + 1)).astype(np.int32)
    weights = np.ones((BATCH, LENGTH), np.float32)
    weights[0, 3:] = 0
    weights[6:] = 0
    return tokens[:, :-1], tokens[:, 1:], weights


def position_wise():
    """Embedding, one reversible half-residual, a dense head: no layer mixes positions.
    Its 32 x 32 and 64 x 16 kernels are sharded by fsdp=2 and 4, the 16 x 32 embedding
    is not (few leaves: each leaf shape compiles a copy program per mesh)."""
    blocks = [(tl.Serial(tl.Embedding(VOCAB, D), tl.Dup()),
               [tl.ReversibleHalfResidual(tl.Dense(D, use_bias=False), tl.Relu())])]
    return blocks, tl.Serial(tl.Concatenate(), tl.Dense(VOCAB, use_bias=False),
                             tl.LogSoftmax(), tl.CrossEntropyLoss())


def transformer(ff_chunk_size=None):
    """A two-layer `ReversibleTransformerLM` with blockwise attention (blocks of 2): the
    block trainers scan its two equal layers with ``scan_layers=True``; ``ff_chunk_size``
    also runs the half-residuals' reverse passes over chunks of positions."""
    model = ReversibleTransformerLM(
        vocab_size=VOCAB, d_model=D, d_ff=2 * D, n_layers=2, n_heads=2, max_len=LENGTH,
        dropout=0.0, attention_type=functools.partial(tl.CausalAttention,
                                                      implementation="blockwise",
                                                      block_size=2),
        ff_chunk_size=ff_chunk_size)
    return tl.extract_reversible_blocks([model, tl.CrossEntropyLoss()])


def sgd():
    return optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)


def build(trainer_name, make_model=position_wise, **options):
    """``trainer_name`` on an initialised ``make_model()``; ``options`` are its placement
    (``n_devices=`` or ``mesh=``) and, for the block trainers, e.g. ``scan_layers=``."""
    blocks, loss = make_model()
    signature = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in global_batch())
    tl.init_reversible_blocks(blocks, loss, signature, jax.random.key(0))
    if trainer_name == "Trainer":
        return Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), sgd, **options)
    return TRAINERS[trainer_name](blocks, loss, sgd, **options)


def two_steps(trainer, batch):
    """``(losses, global gradient norms, weights)`` of two steps on ``batch``; the second
    step runs under ``jax.transfer_guard('disallow')`` (explicit transfers only)."""
    first, rng = trainer.one_step(batch, jax.random.key(0)), jax.random.key(1)
    trainer.block_until_ready()
    with jax.transfer_guard("disallow"):
        second = trainer.one_step(batch, rng)
    return ([float(loss) for loss, _ in (first, second)],
            [float(stats["gradients_l2"]) for _, stats in (first, second)], trainer.weights)
