"""`optimizer_fn`: builds an optax optimizer whose learning rate the loop can set each step.

Trainers take an ``optimizer_fn: () -> optax.GradientTransformation``. In gin the function
itself is that factory: ``RunConfig.optimizer = @optimizer_fn`` with ``optimizer_fn.name =
'adam'`` and ``optimizer_fn.b2 = 0.98``; the trainer calls it once (or once per layer).
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any

import optax

from revtrain.training.schedules import check_rate

_NOT_OPTIMIZERS = frozenset({"chain", "identity", "inject_hyperparams", "named_chain"})


def _factory(name: str) -> Any:
    factory = getattr(optax, name, None)
    if name.startswith("_") or name in _NOT_OPTIMIZERS or not callable(factory) or (
            "learning_rate" not in inspect.signature(factory).parameters):
        raise ValueError(f"optimizer name {name!r} is not an optax optimizer with a "
                         f"learning_rate argument; use e.g. 'adam', 'adamw', 'sgd', "
                         f"'adafactor', 'lion'")
    return factory


def _with_clipping(factory: Any, max_norm: float) -> Any:
    """``factory`` preceded by global-norm clipping, keeping its signature for optax."""

    def clipped(*args, **kwargs):
        return optax.chain(optax.clip_by_global_norm(max_norm), factory(*args, **kwargs))

    clipped.__signature__ = inspect.signature(factory)
    clipped.__name__ = f"clipped_{factory.__name__}"
    return clipped


# The ranges of optax's common hyperparameters, by name, whichever optimizer takes them:
# (low, high, high included, what the number is). Adam's bias correction divides by
# 1 - b**t, so b1 = 1 or b2 = 1 is nan from the first step; a rate above 1 or below 0,
# or a negative epsilon or decay, makes the moving averages or updates diverge.
_RANGES = {
    "b1": (0.0, 1.0, False, "the decay rate of a moving average"),
    "b2": (0.0, 1.0, False, "the decay rate of a moving average"),
    "decay": (0.0, 1.0, True, "the decay rate of a moving average"),
    "momentum": (0.0, 1.0, True, "the momentum coefficient"),
    "eps": (0.0, math.inf, False, "a term added to a denominator"),
    "eps_root": (0.0, math.inf, False, "a term added under a square root"),
    "weight_decay": (0.0, math.inf, False, "a decay per step"),
}


def _check_numbers(learning_rate: Any, clip_gradient_norm: float | None,
                   hyperparams: dict[str, Any]) -> None:
    """The numbers a step would turn into nan or divergence: each named as its gin
    binding, with its range where `_RANGES` knows it."""
    if isinstance(learning_rate, numbers.Real):
        check_rate("optimizer_fn.learning_rate", learning_rate)
    if clip_gradient_norm is not None:
        check_rate("optimizer_fn.clip_gradient_norm", clip_gradient_norm)
    for key, value in hyperparams.items():
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            continue
        if not math.isfinite(value):
            raise ValueError(f"optimizer_fn.{key}={value!r} must be a finite number; "
                             f"change the gin binding optimizer_fn.{key}")
        if key in _RANGES:
            low, high, closed, meaning = _RANGES[key]
            if not (low <= value < high or (closed and value == high)):
                interval = f"[{low:g}, {high:g}{']' if closed else ')'}"
                raise ValueError(f"optimizer_fn.{key}={value!r} must be in {interval} "
                                 f"({meaning}); change the gin binding optimizer_fn.{key}")


def optimizer_fn(name: str = "adam", learning_rate: float = 1e-3,
                 clip_gradient_norm: float | None = None,
                 **hyperparams: Any) -> optax.GradientTransformation:
    """Returns ``optax.inject_hyperparams(optax.<name>)(learning_rate, **hyperparams)``.

    The learning rate (and every other numeric hyperparameter) lives in the optimizer
    state, so ``trainer.one_step(..., learning_rate=x)`` can set it each step; the training
    loop does so from its schedule, making ``learning_rate`` here only the initial value.

    Args:
      name: an optax optimizer function name, e.g. ``'adam'``, ``'adamw'``, ``'sgd'``,
        ``'adafactor'``.
      learning_rate: the initial learning rate.
      clip_gradient_norm: if set, gradients are clipped to this global L2 norm first
        (``optax.clip_by_global_norm``). Block trainers keep one optimizer per layer, so
        there the norm is per layer, not over the whole model (the cheaper option); for
        the exact global norm give them ``clip_global_norm`` instead.
      **hyperparams: other arguments of the optax function (``b1``, ``b2``, ``eps``,
        ``weight_decay``, ``momentum``...).

    Returns:
      An ``optax.GradientTransformation`` whose state is ``InjectHyperparamsState``.

    Raises:
      ValueError: for an unknown optimizer name, a ``learning_rate`` or
        ``clip_gradient_norm`` that is not finite and > 0, a hyperparameter that is nan
        or inf, or one of optax's common ones out of its range (``b1`` and ``b2`` in
        [0, 1), ``decay`` and ``momentum`` in [0, 1], ``eps``, ``eps_root`` and
        ``weight_decay`` >= 0); naming the binding (``optimizer_fn.b2``).
      TypeError: for a hyperparameter the optax function does not take.
    """
    factory = _factory(name)
    _check_numbers(learning_rate, clip_gradient_norm, hyperparams)
    if clip_gradient_norm is not None:
        factory = _with_clipping(factory, clip_gradient_norm)
    try:
        inspect.signature(factory).bind(learning_rate=learning_rate, **hyperparams)
    except TypeError as e:
        raise TypeError(f"optax.{name} does not accept {sorted(hyperparams)}: {e}; see "
                        f"help(optax.{name}) for its arguments") from e
    return optax.inject_hyperparams(factory)(learning_rate=learning_rate, **hyperparams)
