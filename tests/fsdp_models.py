"""A model whose kernels FSDP shards, and trainers of it, for the FSDP and checkpoint tests."""

import jax
from jax.sharding import Mesh

from revtrain import layers as tl
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
from tests.trainers.conftest import adam, make_batch, signature

VOCAB, D = 16, 64
TRAINERS = {"Trainer": Trainer, "ReversibleSerialTrainer": ReversibleSerialTrainer,
            "MemoryEfficientTrainer": MemoryEfficientTrainer}


def blocks_and_loss(dropout: float = 0.1, seed: int = 0):
    """An initialised one-block reversible LM whose kernels FSDP shards (d_model 64)."""
    pair = [tl.ReversibleHalfResidual(tl.LayerNorm(), tl.Dense(D), tl.Dropout(dropout)),
            tl.ReversibleSwap(),
            tl.ReversibleHalfResidual(tl.Dense(D), tl.Relu(), tl.Dropout(dropout)),
            tl.ReversibleSwap()]
    blocks = [(tl.Serial(tl.Embedding(VOCAB, D), tl.Dropout(dropout), tl.Dup()), pair)]
    loss = tl.Serial(tl.Concatenate(), tl.Dense(VOCAB), tl.LogSoftmax(), tl.Dropout(dropout),
                     tl.CrossEntropyLoss())
    tl.init_reversible_blocks(blocks, loss, signature(make_batch()), jax.random.key(seed))
    return blocks, loss


def build(trainer_name: str, fsdp: bool, n_devices: int | None = None, optimizer=adam,
          dropout: float = 0.1, mesh: Mesh | None = None, model=None):
    """A trainer of ``model`` (default: a new `blocks_and_loss`)."""
    blocks, loss = model or blocks_and_loss(dropout)
    if trainer_name == "Trainer":
        return Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), optimizer,
                       n_devices=n_devices, mesh=mesh, fsdp=fsdp)
    return TRAINERS[trainer_name](blocks, loss, optimizer, n_devices=n_devices, mesh=mesh,
                                  fsdp=fsdp)
