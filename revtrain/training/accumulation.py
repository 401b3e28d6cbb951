"""Gradient accumulation: one optimizer update from ``k`` micro-batches of a global batch.

When the largest batch that fits on the devices is smaller than the run's global batch,
the loop trains each global batch ``[batch, ...]`` as ``k`` micro-batches ``[batch / k,
...]`` of consecutive rows (`micro_batches`), one ``trainer.one_step`` each
(`accumulated_step`). The optimizer side is optax's own ``optax.MultiSteps(inner,
every_k_schedule=k)`` (`accumulating_optimizer`): its state keeps a running mean of the
gradients and a micro-step counter; the first ``k - 1`` micro-steps return zero updates,
and the ``k``-th applies ``inner`` to the mean and resets the accumulator. Every trainer
therefore accumulates without a change: `Trainer` in its one optimizer state, the block
trainers in each layer's own.

The ``optax.inject_hyperparams`` state sits inside MultiSteps' state
(``MultiStepsState.inner_opt_state``), where
`revtrain.trainers.common.learning_rate` finds it (it walks the slots with ``is_leaf``),
so ``one_step(..., learning_rate=x)`` sets the rate of the update as before. Peak
activation memory is one micro-batch's; the slots hold one more gradient-sized tree (the
accumulator, in the weights' dtype) and two int32 counters.

Exactness: the update is the mean of the micro-batches' gradients, each of the loss the
trainer computes on its micro-batch (the weighted mean over that micro-batch). It equals
the gradient of the whole batch's weighted-mean loss when every micro-batch carries the
same total loss weight, e.g. an unpadded batch of equal example weights; otherwise each
micro-batch counts equally, whatever its weight (optax's ``MultiSteps`` semantics).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

OptimizerFn = Callable[[], optax.GradientTransformation]


def accumulating_optimizer(optimizer_fn: OptimizerFn, accumulate_steps: int) -> OptimizerFn:
    """``optimizer_fn`` that updates once every ``accumulate_steps`` calls of ``update``.

    Args:
      optimizer_fn: ``() -> optax.GradientTransformation`` (e.g. `optimizer_fn`).
      accumulate_steps: micro-steps per update, an int >= 1.

    Returns:
      ``optimizer_fn`` itself for 1; else a function returning
      ``optax.MultiSteps(optimizer_fn(), every_k_schedule=accumulate_steps)`` as a
      ``GradientTransformation`` (called once per trainer, or once per layer).

    Raises:
      ValueError: for an ``accumulate_steps`` that is not an int >= 1.
    """
    accumulate_steps = check_accumulate_steps(accumulate_steps)
    if accumulate_steps == 1:
        return optimizer_fn

    def accumulating() -> optax.GradientTransformation:
        inner = optimizer_fn()
        return optax.MultiSteps(inner, every_k_schedule=accumulate_steps
                                ).gradient_transformation()

    accumulating.__name__ = f"accumulating_{getattr(optimizer_fn, '__name__', 'optimizer')}"
    return accumulating


def micro_batches(batch: Sequence[Any], accumulate_steps: int) -> list[tuple[Any, ...]]:
    """Splits a batch into ``accumulate_steps`` equal micro-batches of consecutive rows.

    Args:
      batch: ``(inputs, targets, weights)``, each ``[batch, ...]`` (numpy or jax arrays).
      accumulate_steps: how many micro-batches.

    Returns:
      ``accumulate_steps`` tuples; item ``i`` holds rows ``[i * m, (i + 1) * m)`` of every
      leaf, ``m = batch // accumulate_steps`` (slices: numpy views, nothing copied).

    Raises:
      ValueError: naming both numbers when ``accumulate_steps`` does not divide the rows.
    """
    check_accumulate_steps(accumulate_steps)
    rows = {len(x) for x in batch}
    if len(rows) != 1 or next(iter(rows)) % accumulate_steps:
        raise ValueError(f"a batch of {sorted(rows)} rows does not split into "
                         f"accumulate_steps={accumulate_steps} equal micro-batches; use a "
                         f"batch size that is a multiple of {accumulate_steps}")
    m = next(iter(rows)) // accumulate_steps
    return [tuple(x[i * m:(i + 1) * m] for x in batch) for i in range(accumulate_steps)]


@functools.partial(jax.jit, static_argnums=1)
def micro_keys(rng: jax.Array, accumulate_steps: int) -> tuple[jax.Array, ...]:
    """``(fold_in(rng, 0), ..., fold_in(rng, accumulate_steps - 1))``: one key per
    micro-batch of a step from the step's key, made on the device (nothing is sent)."""
    return tuple(jax.random.fold_in(rng, i) for i in range(accumulate_steps))


@jax.jit
def _mean(losses: tuple[jax.Array, ...]) -> jax.Array:
    return jnp.mean(jnp.stack(losses))


def accumulated_step(trainer: Any, batch: Sequence[Any], rng: jax.Array, step: int,
                     learning_rate: float | None,
                     accumulate_steps: int) -> tuple[jax.Array, dict[str, Any]]:
    """One optimizer update from ``accumulate_steps`` calls of ``trainer.one_step``.

    ``trainer`` must have been built with `accumulating_optimizer` of the same
    ``accumulate_steps`` (its last micro-step applies the update). For 1 this is
    ``trainer.one_step(batch, rng, step=step, learning_rate=learning_rate)`` and nothing
    else: no split, no key derived, the result returned as it is.

    Args:
      trainer: any trainer (``one_step(batch, rng, step=, learning_rate=)``).
      batch: the global batch ``(inputs, targets, weights)``, each ``[batch, ...]``.
      rng: the step's key; micro-batch ``i`` gets ``fold_in(rng, i)`` (`micro_keys`).
      step: the loop step (the optimizer update's index), passed to every micro-step.
      learning_rate: the step's rate, passed to every micro-step (the update uses it).
      accumulate_steps: micro-batches per step.

    Returns:
      ``(loss, stats)``: the float32 mean of the micro-batches' losses (each the weighted
      mean over its micro-batch); ``stats`` are the last micro-step's with ``loss``
      replaced by that mean: ``gradients_l2`` is the last micro-batch's gradient norm and
      ``weights_l2`` the norm after the update. Device values: nothing is read back.

    Raises:
      ValueError: as `micro_batches`, and as ``trainer.one_step``.
    """
    if accumulate_steps == 1:
        return trainer.one_step(batch, rng, step=step, learning_rate=learning_rate)
    losses, stats = [], {}
    for micro, key in zip(micro_batches(batch, accumulate_steps),
                          micro_keys(rng, accumulate_steps), strict=True):
        loss, stats = trainer.one_step(micro, key, step=step, learning_rate=learning_rate)
        losses.append(loss)
    loss = _mean(tuple(losses))
    return loss, {**stats, "loss": loss}


def check_no_global_clipping(accumulate_steps: int, clip_global_norm: float | None,
                             where: str) -> None:
    """Refuses accumulation with a block trainer's ``clip_global_norm``.

    That option clips each ``one_step``'s gradient by its own global norm before the
    optimizer sees it, so with micro-batches it would clip every micro-batch's gradient
    and the update would depend on ``accumulate_steps`` -- not the accumulated gradient,
    as ``optax.clip_by_global_norm`` inside the optimizer does (``optimizer_fn(...,
    clip_gradient_norm=c)``, which MultiSteps applies to the mean gradient).

    Args:
      accumulate_steps: micro-batches per step.
      clip_global_norm: the trainer's option (None: no clipping).
      where: where the option was set, for the message (e.g.
        ``'RunConfig.trainer_kwargs'``).

    Raises:
      ValueError: one line naming both values and the fix, for ``accumulate_steps > 1``
        with a ``clip_global_norm``.
    """
    if accumulate_steps > 1 and clip_global_norm is not None:
        raise ValueError(f"RunConfig.accumulate_steps={accumulate_steps} with "
                         f"clip_global_norm={clip_global_norm} in {where} would clip each "
                         f"micro-batch's gradient, not the accumulated one; bind "
                         f"optimizer_fn.clip_gradient_norm instead or set "
                         f"RunConfig.accumulate_steps = 1")


def check_accumulate_steps(accumulate_steps: Any) -> int:
    """``accumulate_steps`` as an int; a one-line ValueError naming it unless it is an
    int >= 1 (a numpy integer counts; a bool does not)."""
    if isinstance(accumulate_steps, bool) or not isinstance(
            accumulate_steps, int | np.integer) or accumulate_steps < 1:
        raise ValueError(f"accumulate_steps={accumulate_steps!r} must be an int >= 1; set "
                         f"RunConfig.accumulate_steps to a whole number of micro-batches")
    return int(accumulate_steps)


__all__ = ["accumulated_step", "accumulating_optimizer", "check_accumulate_steps",
           "check_no_global_clipping", "micro_batches", "micro_keys"]
