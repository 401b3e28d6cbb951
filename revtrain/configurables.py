"""Registers revtrain's public constructors with gin (the only module that does).

Library code is never decorated; importing this module makes the names below usable in
``.gin`` files, by short name (``@ReversibleTransformerLM``) or module-qualified name
(``@revtrain.models.ReversibleTransformerLM``):

* models: ``ReversibleTransformerLM``, ``TransformerLM``, ``RevNet``;
* data: ``TextFiles``, ``TFDS``, ``CopyTask``, ``SyntheticSequences`` and the tokenizers
  ``ByteTokenizer``, ``SentencePieceTokenizer`` and ``trained_sentencepiece`` (for
  ``TextFiles.tokenizer = @SentencePieceTokenizer()``);
* trainers: ``Trainer``, ``ReversibleSerialTrainer``, ``MemoryEfficientTrainer``;
* training: ``train`` (the entry point; only ``train.steps`` is bound on it), the run
  configuration ``RunConfig``, ``EvalConfig``, ``CheckpointConfig``, ``LogConfig``
  (`revtrain.training.config`), ``CompilationCacheConfig``
  (`revtrain.training.compile_cache`), ``optimizer_fn``, ``warmup_rsqrt_decay``,
  ``warmup_cosine_decay``, ``constant``;
* layers: the losses/metrics ``CrossEntropyLoss``, ``WeightedCategoryCrossEntropy``,
  ``ProjectedCrossEntropy``, ``Accuracy`` (each with ``n_chunks``), the activations
  ``Relu``, ``Gelu``, ``Tanh``, ``Sigmoid``, and the attention layers ``CausalAttention``
  (for ``attention_type = @CausalAttention`` with ``CausalAttention.implementation``,
  ``block_size``) and ``LSHCausalAttention`` (``chunk_len``, ``n_hashes``, ...);
* constants ``%jnp.float32`` and ``%jnp.bfloat16`` (for ``compute_dtype``).

`train` is the registered (gin-wrapped) version of `revtrain.training.train_lib.train`;
call it with `run_configs()` -- the four dataclasses built through gin, so their bindings
apply -- to get the bound run. ``train.eval_every`` and the other parameters ``train``
had before are errors naming their new binding.
"""

from __future__ import annotations

import gin
import jax.numpy as jnp

from revtrain import data, layers, models, trainers
from revtrain.training import compile_cache, config, schedules, train_lib
from revtrain.training.optimizers import optimizer_fn

# (gin module, public constructors) registered below; docs/make_gin_reference.py documents
# exactly these (and `train`).
REGISTRY = (
    ("revtrain.models", (models.ReversibleTransformerLM, models.TransformerLM, models.RevNet)),
    ("revtrain.data", (data.TextFiles, data.TFDS, data.CopyTask, data.SyntheticSequences,
                       data.ByteTokenizer, data.SentencePieceTokenizer,
                       data.trained_sentencepiece)),
    ("revtrain.trainers", (trainers.Trainer, trainers.ReversibleSerialTrainer,
                           trainers.MemoryEfficientTrainer)),
    ("revtrain.training", (config.RunConfig, config.EvalConfig, config.CheckpointConfig,
                           config.LogConfig, compile_cache.CompilationCacheConfig,
                           optimizer_fn, schedules.warmup_rsqrt_decay,
                           schedules.warmup_cosine_decay, schedules.constant)),
    ("revtrain.layers", (layers.CrossEntropyLoss, layers.WeightedCategoryCrossEntropy,
                         layers.ProjectedCrossEntropy, layers.Accuracy, layers.Relu,
                         layers.Gelu, layers.Tanh, layers.Sigmoid, layers.CausalAttention,
                         layers.LSHCausalAttention)),
)
# The registered attention layers: an LM's ``attention_type``.
ATTENTION_LAYERS = ("CausalAttention", "LSHCausalAttention")
CONSTANTS = {"jnp.float32": jnp.float32, "jnp.bfloat16": jnp.bfloat16}


_CONFIG_CLASSES = (config.RunConfig, config.EvalConfig, config.CheckpointConfig,
                   config.LogConfig)


def _register() -> dict:
    registered = {}
    for module, constructors in REGISTRY:
        for constructor in constructors:
            registered[constructor] = gin.external_configurable(constructor, module=module)
    for name, value in CONSTANTS.items():
        gin.constant(name, value)
    return registered


_REGISTERED = _register()
# Only ``steps`` (and the removed parameters, to name their new bindings) bind on train;
# the rest is the run configuration's.
train = gin.external_configurable(
    train_lib.train, name="train", module="revtrain.training",
    denylist=["output_dir", "run", "eval_config", "checkpoint", "log", "callbacks"])


# What the LMs pass to their ``attention_type`` themselves (an explicit argument beats a
# gin binding), and the LM parameter that sets it.
_SET_BY_THE_LM = {"n_heads": "n_heads", "dropout": "dropout", "mode": "mode",
                  "max_len": "max_len", "mask_bits": "dropout_mask_bits",
                  "rotary": "pos_type"}
# What the LMs pass only when their own parameter of that name is set (not None).
_SET_BY_THE_LM_WHEN_BOUND = ("d_attention_key", "d_attention_value")
_LMS = ("ReversibleTransformerLM", "TransformerLM")


def check_bindings() -> None:
    """Raises ValueError for a binding the model would silently override.

    The attention layers (`ATTENTION_LAYERS`) are registered to be an LM's
    ``attention_type``; the LM passes them ``n_heads``, ``dropout``, ``mode``,
    ``max_len``, ``mask_bits`` (and ``rotary``), so binding one of those on an attention
    layer would have no effect; ``d_attention_key`` and ``d_attention_value`` may be
    bound on either the LM or the attention layer, not both.
    """
    lm_bound = {name for lm in _LMS for name in gin.get_bindings(lm)}
    for layer in ATTENTION_LAYERS:
        bound = gin.get_bindings(layer)
        for name, lm_name in _SET_BY_THE_LM.items():
            if name in bound:
                raise ValueError(f"{layer}.{name} is set by the language model, which "
                                 f"overrides the binding; bind ReversibleTransformerLM."
                                 f"{lm_name} (or TransformerLM.{lm_name}) instead")
        for name in _SET_BY_THE_LM_WHEN_BOUND:
            if name in bound and name in lm_bound:
                raise ValueError(f"{layer}.{name} and the language model's {name} are both "
                                 f"bound, and the model's overrides the layer's; bind only "
                                 f"one of them")


def run_configs() -> dict[str, object]:
    """``{'run', 'eval_config', 'checkpoint', 'log'}`` built through gin (bindings applied).

    Keyword arguments of `train` and of `revtrain.training.builder.build_loop`.

    Raises:
      ValueError: for a field out of range (one line naming the binding).
    """
    names = ("run", "eval_config", "checkpoint", "log")
    return {name: _REGISTERED[cls]() for name, cls in zip(names, _CONFIG_CLASSES,
                                                           strict=True)}


def compilation_cache_config() -> compile_cache.CompilationCacheConfig:
    """The `CompilationCacheConfig` built through gin (``CompilationCacheConfig.*``
    bindings applied); the command-line tools pass it, after their flags, to
    `revtrain.training.compile_cache.use_compilation_cache`.

    Raises:
      ValueError: for a field of the wrong type (one line naming the binding).
    """
    return _REGISTERED[compile_cache.CompilationCacheConfig]()


__all__ = ["ATTENTION_LAYERS", "CONSTANTS", "REGISTRY", "check_bindings",
           "compilation_cache_config", "run_configs", "train"]
