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

import collections.abc
import inspect
import numbers
import types
import typing
from collections.abc import Callable
from typing import Any

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


def check_integer_bindings() -> None:
    """Checks every value bound to an integer parameter of a registered constructor.

    The integer parameters are read from the constructors' type hints (``int``, ``int |
    None``, ``Sequence[int]``, ``tuple[int, int]``, ``Mapping[str, int]`` and unions of
    them), so each new configurable is covered without a list to keep. Gin passes a bound
    value on unchanged: ``CopyTask.batch_size=4.5`` was truncated to 4 while ``config.gin``
    recorded 4.5, and ``'8'`` failed deep inside the model. A bool is not an integer here.
    Literal values and macros are checked; references (``@X``, ``@X()``) are not
    evaluated; scoped bindings (``scope/X.y``) are not checked. The entries of
    ``RunConfig.trainer_kwargs`` are checked against ``RunConfig.trainer_class``'s
    parameters of the same names.

    Raises:
      ValueError: in one line naming the first binding, its value, what it must be and
        the binding to change, e.g. ``CopyTask.batch_size=4.5 must be an integer; change
        the gin binding CopyTask.batch_size``.
    """
    for (module, name), constructor in _CONFIGURABLES.items():
        bound = gin.get_bindings(f"{module}.{name}", resolve_references=False)
        if not bound:
            continue
        hints = {p.name: p.annotation for p in _parameters(constructor)}
        for parameter, value in bound.items():
            _check_value(f"{name}.{parameter}", hints.get(parameter), _literal(value))
    _check_trainer_kwargs()


def _check_value(binding: str, hint: Any, value: Any, where: str = "") -> None:
    """Raises the one-line ValueError of `check_integer_bindings` when ``value`` does not
    fit an integer ``hint`` (``where``: what else the message names)."""
    if value is _REFERENCE or hint is None or _fits(hint, value) in (True, None):
        return
    gin_binding = binding.split("[")[0]
    raise ValueError(f"{binding}={value!r} must be {_describe(hint)}{where}; change the gin "
                     f"binding {gin_binding}")


def _check_trainer_kwargs() -> None:
    """``RunConfig.trainer_kwargs`` entries against the bound trainer class's hints."""
    run = gin.get_bindings("revtrain.training.RunConfig", resolve_references=False)
    kwargs, trainer = _literal(run.get("trainer_kwargs")), run.get("trainer_class")
    if not isinstance(kwargs, dict):
        return
    name = (trainer.configurable.name if isinstance(trainer, gin.config.ConfigurableReference)
            else "Trainer")
    constructor = next((c for (_, n), c in _CONFIGURABLES.items() if n == name), None)
    hints = {p.name: p.annotation for p in _parameters(constructor)} if constructor else {}
    for key, value in kwargs.items():
        _check_value(f"RunConfig.trainer_kwargs[{key!r}]", hints.get(key), value,
                     f" ({name}.{key})")


# Every gin-configurable constructor by (gin module, name): `check_integer_bindings` reads
# these.
_CONFIGURABLES: dict[tuple[str, str], Callable] = {
    **{(module, c.__name__): c for module, constructors in REGISTRY for c in constructors},
    ("revtrain.training", "train"): train_lib.train}
_REFERENCE = object()  # A binding to ``@X`` or ``@X()``: not a literal value.


def _parameters(constructor: Callable) -> list[inspect.Parameter]:
    return list(inspect.signature(constructor, eval_str=True).parameters.values())


def _literal(value: Any) -> Any:
    """A bound value with macros (``%NAME``) replaced by theirs; `_REFERENCE` for ``@X``."""
    while isinstance(value, gin.config.ConfigurableReference):
        if value.configurable.name != "macro":
            return _REFERENCE
        value = gin.query_parameter("%" + value.scoped_selector.rsplit("/", 1)[0])
    return value


def _fits(hint: Any, value: Any) -> bool | None:
    """Whether ``value`` fits an integer type hint; None for a hint not built of
    integers (``float``, ``str``, a callable...): not checked here."""
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        fits = [_fits(arg, value) for arg in args]
        return None if None in fits else any(fits)
    if origin in (collections.abc.Sequence, tuple, list):
        items = {arg for arg in args if arg is not Ellipsis}
        if len(items) != 1 or _fits(next(iter(items)), 0) is None:
            return None
        return isinstance(value, (tuple, list)) and all(_fits(*items, v) for v in value)
    if origin in (collections.abc.Mapping, dict) and len(args) == 2:
        if _fits(args[1], 0) is None:
            return None
        return isinstance(value, dict) and all(_fits(args[1], v) for v in value.values())
    return None


def _describe(hint: Any) -> str:
    """``int | None`` -> ``an integer or None``; ``Sequence[int]`` -> ``a sequence of
    integers``."""
    if hint is int:
        return "an integer"
    if hint is type(None):
        return "None"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in args)
    if origin in (collections.abc.Mapping, dict):
        return "a mapping to integers"
    return f"a {'tuple' if origin is tuple else 'sequence'} of integers"


def run_configs() -> dict[str, object]:
    """``{'run', 'eval_config', 'checkpoint', 'log'}`` built through gin (bindings applied).

    Keyword arguments of `train` and of `revtrain.training.builder.build_loop`. Every
    integer binding is checked first (`check_integer_bindings`).

    Raises:
      ValueError: for a binding that is not an integer where one is expected, or a field
        out of range (one line naming the binding).
    """
    check_integer_bindings()
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
           "check_integer_bindings", "compilation_cache_config", "run_configs",
           "train"]
