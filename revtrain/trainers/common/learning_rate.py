"""The learning rate a trainer injects: where optax keeps it, how an override is checked,
and how it reaches the devices.

``one_step(..., learning_rate=x)`` sets the rate of an optimizer built with
``optax.inject_hyperparams`` (as `revtrain.training.optimizer_fn` builds them) for that
step and the ones after, in every trainer alike: `check_learning_rate` validates the
override on the host, `PlacedRate` puts it on the mesh once per change, and
`inject_learning_rate` writes it into the optimizer state inside the compiled update
(`revtrain.trainers.common.updates.apply_optimizer`). A rate that ``inject_hyperparams`` was given
as a schedule is not injectable: the schedule sets it at every update.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from revtrain.parallel.placement import Placement

_INJECTED_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _is_injected(node: Any) -> bool:
    """An ``optax.inject_hyperparams`` state (optax has a stateless and a stateful one)."""
    return isinstance(node, _INJECTED_STATES)


def _settable(state: Any) -> bool:
    """A numeric ``learning_rate`` hyperparameter (not a schedule, which keeps a state)."""
    return "learning_rate" in state.hyperparams and (
        "learning_rate" not in getattr(state, "hyperparams_states", {}))


def _injected_states(slots: Any) -> list[Any]:
    return [node for node in jax.tree.leaves(slots, is_leaf=_is_injected)
            if _is_injected(node)]


def has_injectable_learning_rate(slots: Any) -> bool:
    """True when ``slots`` hold an ``optax.inject_hyperparams`` numeric ``learning_rate``."""
    return any(_settable(state) for state in _injected_states(slots))


def learning_rate_of(slots: Any) -> float | None:
    """The current ``learning_rate`` held in optimizer slots, or None when there is none
    (or when the slots are abstract, `jax.ShapeDtypeStruct` s with no value to read)."""
    for state in _injected_states(slots):
        if "learning_rate" in state.hyperparams:
            rate = state.hyperparams["learning_rate"]
            if isinstance(rate, jax.ShapeDtypeStruct):
                return None
            if isinstance(rate, jax.Array):  # Replicated; maybe over several processes.
                rate = rate.addressable_shards[0].data
            return float(np.asarray(rate))
    return None


def inject_learning_rate(slots: Any, learning_rate: jax.Array | None) -> Any:
    """``slots`` with every settable ``learning_rate`` replaced by ``learning_rate`` (in
    its own dtype); ``slots`` unchanged for None. Traceable."""
    if learning_rate is None:
        return slots

    def with_rate(node):
        if not (_is_injected(node) and _settable(node)):
            return node
        old = node.hyperparams["learning_rate"]
        rate = jnp.asarray(learning_rate, dtype=jnp.asarray(old).dtype)
        return node._replace(hyperparams={**node.hyperparams, "learning_rate": rate})
    return jax.tree.map(with_rate, slots, is_leaf=_is_injected)


def check_learning_rate(learning_rate: Any, current: float | None,
                        injectable: bool) -> np.float32 | None:
    """The float32 rate to pass a step: the override ``learning_rate``, else ``current``
    (None when the optimizer has no injectable rate).

    Raises:
      TypeError: for an override that is not a real number (a 0-d numeric array counts).
      ValueError: for an override of an optimizer without an injectable rate, or one that
        is not finite.
    """
    if learning_rate is None:
        return np.float32(current) if injectable else None
    if isinstance(learning_rate, (np.ndarray, np.generic, jax.Array)) and (
            np.ndim(learning_rate) == 0 and np.issubdtype(np.asarray(learning_rate).dtype,
                                                          np.number)):
        learning_rate = float(learning_rate)  # e.g. a schedule's value, jnp.float32(...)
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, numbers.Real):
        raise TypeError(f"learning_rate={learning_rate!r} must be a real number (or None "
                        f"to keep the current rate)")
    if not injectable:
        raise ValueError(
            f"learning_rate={learning_rate} was given but the optimizer has no injectable "
            f"learning rate (none, or a schedule that sets it itself); build it with "
            f"optax.inject_hyperparams(optax.adam)(learning_rate=<a number>)")
    if not np.isfinite(learning_rate):
        raise ValueError(f"learning_rate={learning_rate} is not finite")
    return np.float32(learning_rate)


class PlacedRate:
    """A checked rate replicated on a placement's mesh; the same rate as the last one is
    not sent again (one explicit transfer per change of rate)."""

    def __init__(self, placement: Placement):
        self._replicated = placement.replicated
        self._cached: tuple[float, jax.Array] | None = None

    def __call__(self, lr: np.float32 | None) -> jax.Array | None:
        if lr is None:
            return None
        if self._cached is None or self._cached[0] != float(lr):
            self._cached = (float(lr), jax.device_put(lr, self._replicated))
        return self._cached[1]

    def abstract(self, lr: np.float32 | None) -> jax.ShapeDtypeStruct | None:
        """The abstract argument (float32 scalar, replicated) `__call__` would give."""
        if lr is None:
            return None
        return jax.ShapeDtypeStruct((), np.float32, sharding=self._replicated)


__all__ = ["PlacedRate", "check_learning_rate", "has_injectable_learning_rate",
           "inject_learning_rate", "learning_rate_of"]
