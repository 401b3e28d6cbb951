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


def _check_numbers(learning_rate: Any, clip_gradient_norm: float | None,
                   hyperparams: dict[str, Any]) -> None:
    """The numbers a step would turn into nan: each named as its gin binding."""
    if isinstance(learning_rate, numbers.Real):
        check_rate("optimizer_fn.learning_rate", learning_rate)
    if clip_gradient_norm is not None:
        check_rate("optimizer_fn.clip_gradient_norm", clip_gradient_norm)
    for key, value in hyperparams.items():
        if isinstance(value, numbers.Real) and not math.isfinite(value):
            raise ValueError(f"optimizer_fn.{key}={value!r} must be a finite number; "
                             f"change the gin binding optimizer_fn.{key}")


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
        ``clip_gradient_norm`` that is not finite and > 0, or a hyperparameter that is
        nan or inf; naming the binding (``optimizer_fn.b2``).
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
