"""Learning-rate schedules: optax schedules ``step -> learning rate`` the loop evaluates.

The training loop calls ``schedule(step)`` before every step (``step`` = number of steps
already taken, 0 for the first, as optax counts updates) and passes the value to
``trainer.one_step(..., learning_rate=...)``; the optimizer must therefore be built with
``optax.inject_hyperparams`` (see `revtrain.training.optimizers`).

References: the Transformer schedule (Vaswani et al., 2017, Sec. 5.3), linear warmup then
decay with the inverse square root of the step, which is Trax's default
``multifactor('constant * linear_warmup * rsqrt_decay')``; cosine decay (Loshchilov &
Hutter, 2017, SGDR).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

# The steps `check_schedule` evaluates a schedule at: the first ones a run takes.
FIRST_STEPS = (0, 1, 2, 3)
_FLOAT32_MAX = float(np.finfo(np.float32).max)  # Rates are float32: a larger one is inf.


def check_rate(binding: str, value: Any, positive: bool = True) -> None:
    """Raises a one-line ValueError naming ``binding`` unless ``value`` is a real number,
    finite in float32, and > 0 (>= 0 when not ``positive``)."""
    bound = "> 0" if positive else ">= 0"
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or abs(value) > _FLOAT32_MAX or value < 0
            or (positive and value == 0)):
        raise ValueError(f"{binding}={value!r} must be a finite (float32) number {bound}; "
                         f"change the gin binding {binding}")


def _check(function: str, peak_value: float, warmup_steps: int) -> None:
    check_rate(f"{function}.peak_value", peak_value)
    if warmup_steps < 0:
        raise ValueError(f"{function}.warmup_steps={warmup_steps} must be >= 0; change the "
                         f"gin binding {function}.warmup_steps")


def check_schedule(schedule: optax.Schedule, binding: str = "RunConfig.schedule") -> None:
    """Evaluates ``schedule`` at its `FIRST_STEPS` on the host CPU, as the training loop
    will: each rate must be finite and >= 0, and one of them > 0 (a warmup may start at 0).
    So a schedule that gives nan or inf fails before anything is written, not at step 0.

    Raises:
      ValueError: naming ``binding``, the step and the rate.
    """
    with jax.default_device(jax.devices("cpu")[0]), np.errstate(over="ignore"):
        rates = [float(np.float32(schedule(step))) for step in FIRST_STEPS]  # inf if > f32
    for step, rate in zip(FIRST_STEPS, rates, strict=True):
        if not (math.isfinite(rate) and rate >= 0):
            raise ValueError(f"{binding} gives the learning rate {rate:.6g} at step {step}; a "
                             f"rate must be finite and >= 0: change the gin binding "
                             f"{binding} or its schedule's arguments")
    if not any(rates):
        raise ValueError(f"{binding} gives the learning rate 0 at steps {list(FIRST_STEPS)}:"
                         f" the run would not train; change the gin binding {binding} or "
                         f"its schedule's arguments")


def warmup_rsqrt_decay(peak_value: float = 1e-3, warmup_steps: int = 1000) -> optax.Schedule:
    """Linear warmup from 0 to ``peak_value`` over ``warmup_steps``, then rsqrt decay.

    ``lr(s) = peak_value * s / w`` for ``s < w``, then ``peak_value * sqrt(w / s)``, with
    ``w = max(warmup_steps, 1)``; so the rate peaks at step ``w`` and halves by step ``4w``.
    Trax's ``constant * linear_warmup * rsqrt_decay`` is this with
    ``peak_value = constant / sqrt(w)``.

    Args:
      peak_value: the highest learning rate, reached at the end of the warmup.
      warmup_steps: steps of linear warmup (0: start at ``peak_value`` and decay at once).

    Returns:
      An optax schedule (``step -> float32 scalar``).

    Raises:
      ValueError: for a ``peak_value`` that is not finite (in float32) and > 0, or a
        negative ``warmup_steps``; naming the binding (``warmup_rsqrt_decay.peak_value``).
    """
    _check("warmup_rsqrt_decay", peak_value, warmup_steps)
    w = max(int(warmup_steps), 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        decay = peak_value * jnp.sqrt(w / jnp.maximum(step, w))
        if warmup_steps == 0:
            return decay
        return jnp.where(step < w, peak_value * step / w, decay)

    return schedule


def warmup_cosine_decay(peak_value: float = 1e-3, warmup_steps: int = 1000,
                        decay_steps: int = 100_000, end_value: float = 0.0) -> optax.Schedule:
    """Linear warmup from 0 to ``peak_value``, then cosine decay to ``end_value``.

    A thin wrapper of ``optax.warmup_cosine_decay_schedule`` (``decay_steps`` counts the
    warmup too, as there), with names matching `warmup_rsqrt_decay`.

    Args:
      peak_value: the learning rate at the end of the warmup.
      warmup_steps: steps of linear warmup.
      decay_steps: total steps of warmup plus decay; afterwards the rate stays at
        ``end_value``. Usually the run's ``steps``.
      end_value: the final learning rate.

    Raises:
      ValueError: for a ``peak_value`` that is not finite (in float32) and > 0, an
        ``end_value`` that is not finite and >= 0, a negative ``warmup_steps``, or
        ``decay_steps <= warmup_steps``; naming the binding.
    """
    _check("warmup_cosine_decay", peak_value, warmup_steps)
    check_rate("warmup_cosine_decay.end_value", end_value, positive=False)
    if decay_steps <= warmup_steps:
        raise ValueError(f"decay_steps={decay_steps} must be > warmup_steps={warmup_steps}; "
                         f"decay_steps counts the warmup too")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak_value, warmup_steps=warmup_steps,
        decay_steps=decay_steps, end_value=end_value)


def constant(value: float = 1e-3) -> optax.Schedule:
    """A constant learning rate ``value`` (``optax.constant_schedule``).

    Raises:
      ValueError: for a ``value`` that is not finite (in float32) and > 0, naming
        ``constant.value``.
    """
    check_rate("constant.value", value)
    return optax.constant_schedule(value)
