"""Rematerialisation: activations recomputed in the backward pass (``jax.checkpoint``).

`Remat` wraps one layer; `RematSchedule` says which groups of a `revtrain.layers.Serial`'s
sublayers run under one checkpoint each (``Serial.forward_with_state(..., remat=...)``,
`revtrain.layers.scan.run_in_series`; `revtrain.trainers.Trainer`'s ``remat`` option).

Under ``jax.grad`` a `Remat` layer keeps only its inputs for the backward pass and runs its
sublayer's forward computation again there, so the activations inside the sublayer are not
stored between the two passes. Wrapping each block of a deep model in `Remat` is the
rematerialisation baseline a JAX user reaches for before reversible layers: stored
activations drop to one block input per block (still growing with depth) for the cost of a
second forward pass.

References: ``jax.checkpoint`` (also ``jax.remat``) and its ``policy`` argument
(``jax.checkpoint_policies``); Chen et al., "Training Deep Nets with Sublinear Memory Cost",
2016 (gradient checkpointing).
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Callable
from typing import Any

import jax

from revtrain.layers.layer import Layer
from revtrain.layers.stack import check_per_sublayer


class Remat(Layer):
    """Computes ``layer`` under ``jax.checkpoint``: same values and gradients, less memory.

    ``Remat(layer)`` has ``layer``'s ``n_in``/``n_out``; its weights and state are the
    1-tuples ``(layer.weights,)`` and ``(layer.state,)`` (it is a combinator with one
    sublayer). The rng is passed to ``layer`` unchanged (not split), so ``Remat(layer)``
    computes exactly what ``layer`` computes with the same rng, dropout included.

    `Remat` is not a `ReversibleLayer`, even around one: it is meant for trainers that
    differentiate the whole model (`revtrain.trainers.Trainer`).

    The saving is measured by ``benchmarks/memory_vs_depth.py`` (its "Trainer + remat"
    rows, docs/benchmarks.md): the peak stays well below `Trainer`'s, but it still grows
    with depth, since one input per wrapped layer is stored. ``Trainer(remat='layer')``
    checkpoints a model's layers without wrapping them (weights keep their tree;
    `RematSchedule`).

    Args:
      layer: the layer whose forward pass is recomputed in the backward pass.
      policy: optional ``jax.checkpoint`` policy deciding which intermediate values may be
        saved after all, e.g. ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``;
        None (the default) saves nothing but the inputs.
      name: the layer's name; default ``'Remat'``.

    Raises:
      TypeError: when ``layer`` is not a `Layer`.
    """

    def __init__(self, layer: Layer, policy: Callable[..., bool] | None = None,
                 name: str | None = None):
        if not isinstance(layer, Layer):
            raise TypeError(f"Remat wraps a Layer; got {type(layer).__name__}: {layer!r}")
        super().__init__(n_in=layer.n_in, n_out=layer.n_out, name=name or "Remat",
                         sublayers=(layer,))
        self._policy = policy

    def forward_with_state(self, x: Any, weights: Any, state: Any,
                           rng: jax.Array | None) -> tuple[Any, Any]:
        (layer,) = self.sublayers
        check_per_sublayer(self, weights=weights, state=state)
        (layer_weights,), (layer_state,) = weights, state
        remat_fn = jax.checkpoint(layer.pure_fn, policy=self._policy)
        y, new_state = remat_fn(x, layer_weights, layer_state, rng)
        return y, (new_state,)

    def init_weights_and_state(self, input_signature: Any,
                               rng: jax.Array) -> tuple[Any, Any]:
        (layer,) = self.sublayers
        weights, state = layer.init(input_signature, rng=rng)
        return (weights,), (state,)


@dataclasses.dataclass(frozen=True)
class RematSchedule:
    """Which consecutive layers of a series run under one ``jax.checkpoint``.

    A series (`revtrain.layers.scan.run_in_series`) is cut into *units*: one repetition of
    a run's repeated group (a scanned run's scan body, e.g. a Transformer block's four
    reversible layers) or one layer outside runs. Groups of ``every`` consecutive units
    each run under one checkpoint, so the backward pass keeps one input per group and
    recomputes a group's activations just before its own backward pass (Chen et al.,
    2016). A run is grouped on its own (a scan over groups of ``every`` repetitions, each
    group an inner scan under one checkpoint; when ``every`` does not divide the run's
    repeats the last group is the shorter remainder); the layers between runs are grouped
    ``every`` at a time in order, the last group shorter. A run whose group changes its
    carry's types on the first repetition runs that repetition as a group of its own.

    Args:
      every: units per checkpoint, an int >= 1 (1: every layer).
      policy: a ``jax.checkpoint`` policy (a ``jax.checkpoint_policies`` member such as
        ``dots_with_no_batch_dims_saveable``): which values inside a group may be saved
        after all; None saves nothing but each group's inputs (``nothing_saveable``).
      include_last: False runs the series' last layer (a trainer's loss) without a
        checkpoint when it is not part of a run: its backward pass follows its forward
        pass at once, so checkpointing it would add a recomputation and save nothing.

    Raises:
      ValueError: for ``every`` that is not an int >= 1.
      TypeError: for a ``policy`` that is not callable, or a non-bool ``include_last``.
    """

    every: int = 1
    policy: Callable[..., Any] | None = None
    include_last: bool = True

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"RematSchedule every={self.every!r} must be an int >= 1 "
                             f"(layers per checkpoint); use e.g. every=1")
        if self.policy is not None and not callable(self.policy):
            raise TypeError(f"RematSchedule policy={self.policy!r} is not callable; use a "
                            f"jax.checkpoint_policies member or None")
        if not isinstance(self.include_last, bool):
            raise TypeError(f"RematSchedule include_last={self.include_last!r} must be True "
                            f"or False")

    def checkpointed(self, fn: Callable[..., Any], in_scan: bool = False) -> Callable[..., Any]:
        """``jax.checkpoint(fn)`` with this policy; ``in_scan``: ``fn`` is a scan's body,
        which needs no barrier against common-subexpression elimination
        (``prevent_cse=False``, as the ``jax.checkpoint`` documentation advises)."""
        return jax.checkpoint(fn, policy=self.policy, prevent_cse=not in_scan)


def checkpoint_policy(policy: str | Callable[..., Any] | None,
                      name: str = "remat_policy") -> Callable[..., Any] | None:
    """A ``jax.checkpoint`` policy: ``policy`` itself, or the ``jax.checkpoint_policies``
    member of that name (so a gin file can name one, e.g.
    ``'dots_with_no_batch_dims_saveable'``); None stays None.

    Raises:
      ValueError: for a name that is not a policy of ``jax.checkpoint_policies`` (a factory
        such as ``save_only_these_names`` is one only once called).
      TypeError: for anything else that is not callable.
    """
    if policy is None or (callable(policy) and not isinstance(policy, str)):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"{name}={policy!r} is not callable; use a jax.checkpoint_policies "
                        f"member (or its name), e.g. {name}='dots_with_no_batch_dims_saveable'"
                        f", or None")
    member = getattr(jax.checkpoint_policies, policy, None)
    if policy.startswith("_") or not _is_policy(member):
        raise ValueError(f"{name}={policy!r} is not a policy of jax.checkpoint_policies; use "
                         f"one of {_policy_names()}")
    return member


def remat_schedule(remat: Any, remat_policy: Any) -> RematSchedule | None:
    """The `RematSchedule` of a trainer's ``remat`` and ``remat_policy`` arguments, checked
    (`revtrain.trainers.Trainer`): None without remat; ``'layer'`` (every layer) or an int
    ``k >= 1`` (groups of ``k``) over the sublayers of a `Serial`, its last (the loss) not
    checkpointed.

    Raises:
      ValueError: for another ``remat``, or a ``remat_policy`` without ``remat`` or that
        is not a policy (`checkpoint_policy`).
      TypeError: as `checkpoint_policy`.
    """
    policy = checkpoint_policy(remat_policy, "remat_policy")
    if remat is None:
        if policy is not None:
            raise ValueError(f"remat_policy={remat_policy!r} has no effect without remat; "
                             f"also set remat='layer' (or remat=k), or drop remat_policy")
        return None
    if isinstance(remat, str) and remat == "layer":
        every = 1
    elif isinstance(remat, numbers.Integral) and not isinstance(remat, bool) and remat >= 1:
        every = int(remat)
    else:
        raise ValueError(f"remat={remat!r} must be None, 'layer' (checkpoint every layer) "
                         f"or an int k >= 1 (every k layers); use e.g. remat='layer' or "
                         f"remat=2")
    return RematSchedule(every, policy, include_last=False)


def _is_policy(member: Any) -> bool:
    """A policy takes a primitive and its parameters (``**params``); a factory does not."""
    if not callable(member):
        return False
    try:
        parameters = inspect.signature(member).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _policy_names() -> list[str]:
    return sorted(n for n in dir(jax.checkpoint_policies)
                  if not n.startswith("_") and _is_policy(getattr(jax.checkpoint_policies, n)))


__all__ = ["Remat", "RematSchedule", "checkpoint_policy", "remat_schedule"]
