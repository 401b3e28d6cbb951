"""Registers revtrain's public constructors with gin (the only module that does).

Library code is never decorated; importing this module makes the names below usable in
``.gin`` files, by short name (``@ReversibleTransformerLM``) or module-qualified name
(``@revtrain.models.ReversibleTransformerLM``):

* models: ``ReversibleTransformerLM``, ``TransformerLM``, ``RevNet``;
* data: ``TextFiles``, ``TFDS``, ``CopyTask``, ``SyntheticSequences``;
* trainers: ``Trainer``, ``ReversibleSerialTrainer``, ``MemoryEfficientTrainer``;
* training: ``train`` (the entry point), ``optimizer_fn``, ``warmup_rsqrt_decay``,
  ``warmup_cosine_decay``, ``constant``;
* layers: the losses/metrics ``CrossEntropyLoss``, ``WeightedCategoryCrossEntropy``,
  ``Accuracy`` and the activations ``Relu``, ``Gelu``, ``Tanh``, ``Sigmoid``;
* constants ``%jnp.float32`` and ``%jnp.bfloat16`` (for ``compute_dtype``).

`train` is the registered (gin-wrapped) version of `revtrain.training.train_lib.train`;
call it, not the original, to get the bound parameters.
"""

from __future__ import annotations

import gin
import jax.numpy as jnp

from revtrain import data, layers, models, trainers
from revtrain.training import schedules, train_lib
from revtrain.training.optimizers import optimizer_fn

# (gin module, public constructors) registered below; docs/make_gin_reference.py documents
# exactly these (and `train`).
REGISTRY = (
    ("revtrain.models", (models.ReversibleTransformerLM, models.TransformerLM, models.RevNet)),
    ("revtrain.data", (data.TextFiles, data.TFDS, data.CopyTask, data.SyntheticSequences)),
    ("revtrain.trainers", (trainers.Trainer, trainers.ReversibleSerialTrainer,
                           trainers.MemoryEfficientTrainer)),
    ("revtrain.training", (optimizer_fn, schedules.warmup_rsqrt_decay,
                           schedules.warmup_cosine_decay, schedules.constant)),
    ("revtrain.layers", (layers.CrossEntropyLoss, layers.WeightedCategoryCrossEntropy,
                         layers.Accuracy, layers.Relu, layers.Gelu, layers.Tanh,
                         layers.Sigmoid)),
)
CONSTANTS = {"jnp.float32": jnp.float32, "jnp.bfloat16": jnp.bfloat16}


def _register() -> None:
    for module, constructors in REGISTRY:
        for constructor in constructors:
            gin.external_configurable(constructor, module=module)
    for name, value in CONSTANTS.items():
        gin.constant(name, value)


_register()
train = gin.external_configurable(train_lib.train, name="train", module="revtrain.training")

__all__ = ["CONSTANTS", "REGISTRY", "train"]
