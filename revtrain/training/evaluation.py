"""Evaluation: an eval-mode copy of the model scored by metric layers, jitted once.

The eval model is built from the same model function as the training model with
``mode='eval'`` (dropout off) and given the training model's weights and state
(``eval_model.weights = model.weights``), as Trax's loop does with its eval model. Each
metric layer maps ``(model_output, targets, weights)`` to a weighted mean; batches are
combined weighted by their total weight, so the result is the mean over all scored
positions, whatever the batch boundaries. With several processes the per-process sums are
added across processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from revtrain.layers.base import Layer

BYTE_VOCAB_SIZE = 256


def bits_per_byte(loss_nats: float) -> float:
    """Bits per byte of a byte-level LM: the cross-entropy in nats per byte over ``ln 2``."""
    return loss_nats / math.log(2.0)


class Evaluator:
    """Computes eval metrics of ``eval_model`` over batches.

    Args:
      eval_model: the eval-mode model (``model(mode='eval')``); its weights are set by
        `evaluate`, so it need not be initialised.
      metrics: metric name -> metric layer ``(output, targets, weights) -> scalar``.
      byte_lm: also report ``bits_per_byte`` = ``loss / ln 2`` (needs a ``'loss'`` metric);
        true for byte-level language models (vocabulary 256).
    """

    def __init__(self, eval_model: Layer, metrics: Mapping[str, Layer], byte_lm: bool = False):
        if byte_lm and "loss" not in metrics:
            raise ValueError(f"byte_lm=True needs a 'loss' metric; got {sorted(metrics)}")
        self.eval_model = eval_model
        self._names = tuple(metrics)
        self._byte_lm = byte_lm
        layers = tuple(metrics.values())
        model = eval_model

        def batch_sums(weights, state, batch, rng):
            inputs, targets, mask = batch
            output, _ = model.pure_fn(inputs, weights, state, rng)
            total = jnp.sum(jnp.broadcast_to(mask, targets.shape).astype(jnp.float32))
            values = [layer.pure_fn((output, targets, mask), (), (), None)[0]
                      for layer in layers]
            return jnp.stack([v * total for v in values] + [total])

        self._batch_sums = jax.jit(batch_sums)

    def evaluate(self, weights: Any, state: Any, batches: Iterable[Any],
                 rng: jax.Array | None = None) -> dict[str, float]:
        """Returns ``{name: weighted mean}`` over ``batches`` (plus ``bits_per_byte``).

        Args:
          weights: the model's weights (e.g. ``train_model.weights``).
          state: the model's state.
          batches: ``(inputs, targets, weights)`` batches (this process's rows).
          rng: rng for the eval model (eval mode is deterministic; default key 0).

        Raises:
          ValueError: when ``batches`` is empty or every position has weight 0.
        """
        self.eval_model.weights = weights
        self.eval_model.state = state
        rng = jax.random.key(0) if rng is None else rng
        sums = np.zeros(len(self._names) + 1, np.float64)
        n_batches = 0
        for batch in batches:
            sums += np.asarray(self._batch_sums(weights, state, tuple(batch), rng))
            n_batches += 1
        if jax.process_count() > 1:
            sums = np.sum(multihost_utils.process_allgather(sums), axis=0)
        if n_batches == 0 or sums[-1] <= 0:
            raise ValueError(f"evaluation saw {n_batches} batches with total weight "
                             f"{sums[-1]}; use eval_steps >= 1 and eval data with nonzero "
                             f"weights")
        means = sums[:-1] / sums[-1]
        results = {name: float(m) for name, m in zip(self._names, means, strict=True)}
        if self._byte_lm:
            results["bits_per_byte"] = bits_per_byte(results["loss"])
        return results
