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

import jax.numpy as jnp
import optax


def _check(peak_value: float, warmup_steps: int) -> None:
    if peak_value < 0:
        raise ValueError(f"peak_value={peak_value} must be >= 0")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")


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
      ValueError: for a negative ``peak_value`` or ``warmup_steps``.
    """
    _check(peak_value, warmup_steps)
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
      ValueError: for a negative ``peak_value`` or ``warmup_steps``, or
        ``decay_steps <= warmup_steps``.
    """
    _check(peak_value, warmup_steps)
    if decay_steps <= warmup_steps:
        raise ValueError(f"decay_steps={decay_steps} must be > warmup_steps={warmup_steps}; "
                         f"decay_steps counts the warmup too")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak_value, warmup_steps=warmup_steps,
        decay_steps=decay_steps, end_value=end_value)


def constant(value: float = 1e-3) -> optax.Schedule:
    """A constant learning rate ``value`` (``optax.constant_schedule``)."""
    return optax.constant_schedule(value)
