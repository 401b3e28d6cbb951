"""Evaluation: an eval-mode model scored by metric layers, sharded over the devices.

The eval model is built from the same model function as the training model with
``mode='eval'`` (dropout off) and evaluated with the trainer's values (`Loop.model_values`,
never the layer objects), as Trax's loop does with its eval model. Each metric layer maps
``(model_output, targets, weights)`` to a weighted mean.

Like the trainers, evaluation splits each batch over the devices (``jax.shard_map`` over
a ``batch`` mesh axis of this process's devices): every device computes
``sum(weight * value)`` and ``sum(weight)`` of its rows, the sums are added with ``psum``,
then over batches, then over processes. The result is the weighted mean over every scored
position of every batch -- the trainers' global-batch loss -- whatever the number of
devices, processes or batch boundaries. A padding row (weight 0) counts nothing, which is
how `Inputs.eval_pass` evaluates a finite split exactly once (Paxml pads the last batch of
a finite eval split the same way).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from revtrain.batch_checks import check_divisible
from revtrain.data.inputs import Batch, Inputs
from revtrain.layers.base import Layer
from revtrain.parallel.placement import BATCH_AXIS, Placement


def bits_per_byte(loss_nats: float, tokens_per_byte: float = 1.0) -> float:
    """Bits per byte of text from a cross-entropy in nats per token.

    Args:
      loss_nats: the mean loss per scored token, in nats.
      tokens_per_byte: scored tokens over the UTF-8 bytes of the text they stand for; 1
        for a byte-level LM, where this is ``loss_nats / ln 2``.

    Returns:
      ``loss_nats * tokens_per_byte / ln 2``: the bits to code each byte of the text, a
      figure that compares models with different tokenizers.
    """
    return loss_nats * tokens_per_byte / math.log(2.0)


def eval_batches(inputs: Inputs, steps: int | None) -> Iterator[Batch]:
    """The batches of one evaluation of ``inputs``.

    Args:
      inputs: the split's data.
      steps: how many batches of ``inputs.eval_stream()``; None for one exact pass
        (``inputs.eval_pass()``: each example once, the last batch padded with weight 0).

    Raises:
      ValueError: for ``steps=None`` on data whose eval stream has no end.
    """
    if steps is None:
        return inputs.eval_pass()
    return itertools.islice(inputs.eval_stream(), steps)


class Evaluator:
    """Computes eval metrics of ``eval_model`` over batches, on ``n_devices`` devices.

    Args:
      eval_model: the eval-mode model (``model(mode='eval')``); its layer objects are not
        read or written: values are passed to `evaluate`.
      metrics: metric name -> metric layer ``(output, targets, weights) -> scalar`` (a
        weighted mean, as `revtrain.layers.metrics`).
      byte_level: also report ``bits_per_byte`` = ``loss / ln 2`` (needs a ``'loss'``
        metric); true when the data's tokens are bytes (`Inputs.byte_level`).
      placement: the run's `revtrain.parallel.Placement` (the trainer's): each process
        splits its eval rows over its devices that hold distinct rows
        (`Placement.rows_mesh`: evaluation does not split the length over ``seq``), and the
        processes' sums are added on the host.
      n_devices: a convenience instead of ``placement``: ``Placement.resolve(n_devices)``
        (default: all local devices). A batch's rows must divide by the devices used.
      token_bytes: int ``[vocab]``, the UTF-8 bytes each token id stands for
        (`revtrain.data.Tokenizer.token_bytes`): also report ``bits_per_byte`` = summed
        loss over the bytes of the scored targets, over ``ln 2`` (needs a ``'loss'``
        metric). For subword tokens; ignored with ``byte_level``, whose bytes are tokens.

    Raises:
      ValueError: for ``byte_level`` or ``token_bytes`` without a ``'loss'`` metric, a bad
        ``n_devices``, or both ``placement`` and ``n_devices``.
    """

    def __init__(self, eval_model: Layer, metrics: Mapping[str, Layer],
                 byte_level: bool = False, n_devices: int | None = None,
                 token_bytes: np.ndarray | None = None, placement: Placement | None = None):
        if (byte_level or token_bytes is not None) and "loss" not in metrics:
            raise ValueError(f"bits per byte needs a 'loss' metric; got {sorted(metrics)}")
        if placement is not None and n_devices is not None:
            raise ValueError(f"Evaluator got placement= and n_devices={n_devices}; pass "
                             f"one of them")
        self.eval_model = eval_model
        self._names = tuple(metrics)
        self._byte_level = byte_level
        self._count_bytes = token_bytes is not None and not byte_level
        table = jnp.asarray(np.zeros(1, np.int32) if token_bytes is None else token_bytes,
                            jnp.float32)
        placement = placement or Placement.resolve(n_devices)
        # This process's devices only: processes' sums are added after each evaluation.
        self.mesh = placement.rows_mesh
        self.n_devices = self.mesh.devices.size
        self._replicated = NamedSharding(self.mesh, P())
        self._rows = NamedSharding(self.mesh, P(BATCH_AXIS))
        self._default_rng = jax.device_put(jax.random.key(0), self._replicated)
        layers = tuple(metrics.values())
        model = eval_model

        def device_sums(weights, state, batch, rng):
            inputs, targets, mask = batch
            output, _ = model.pure_fn(inputs, weights, state, rng)
            total = jnp.sum(jnp.broadcast_to(mask, targets.shape).astype(jnp.float32))
            values = [layer.pure_fn((output, targets, mask), (), (), None)[0]
                      for layer in layers]
            # UTF-8 bytes of the scored targets (ids past the table, padding, count 0).
            n_bytes = jnp.sum(mask * jnp.take(table, targets, mode="fill", fill_value=0))
            sums = jnp.stack([jnp.where(total > 0, v * total, 0.0) for v in values]
                             + [n_bytes, total])
            return jax.lax.psum(sums, BATCH_AXIS)

        self._batch_sums = jax.jit(jax.shard_map(
            device_sums, mesh=self.mesh, in_specs=(P(), P(), P(BATCH_AXIS), P()),
            out_specs=P()))

    def evaluate(self, weights: Any, state: Any, batches: Iterable[Any],
                 rng: jax.Array | None = None) -> dict[str, float]:
        """Returns ``{name: weighted mean}`` over ``batches`` (plus ``bits_per_byte``).

        With ``token_bytes``, ``bits_per_byte`` is ``sum(weight * loss) / sum(weight *
        token_bytes[target]) / ln 2`` over every batch: the loss of the eval text
        normalised by its UTF-8 bytes, comparable across tokenizers.

        Args:
          weights: the eval model's weights (e.g. the first of `Loop.model_values`).
          state: the eval model's state.
          batches: ``(inputs, targets, weights)`` batches of this process's rows
            ``[batch, ...]``, ``batch`` divisible by ``n_devices``.
          rng: rng for the eval model (eval mode is deterministic; default key 0).

        ``weights``, ``state`` and ``rng`` (host or device values) are put on the devices
        once, replicated, before the first batch; each batch is put there split by rows.
        Only the sums come back, one small array per batch.

        Raises:
          ValueError: when ``batches`` is empty, every position has weight 0, or a batch
            does not divide over the devices.
        """
        rng = self._default_rng if rng is None else rng
        weights, state, rng = jax.device_put((weights, state, rng), self._replicated)
        sums = np.zeros(len(self._names) + 2, np.float64)
        n_batches = 0
        for batch in batches:
            check_divisible(np.shape(batch[0])[0], self.n_devices, "eval batch size",
                            fix=f"use an eval batch size that is a multiple of "
                                f"{self.n_devices}")
            batch = jax.device_put(tuple(batch), self._rows)
            sums += np.asarray(self._batch_sums(weights, state, batch, rng), np.float64)
            n_batches += 1
        if jax.process_count() > 1:
            sums = np.sum(multihost_utils.process_allgather(sums), axis=0)
        if n_batches == 0 or sums[-1] <= 0:
            raise ValueError(f"evaluation saw {n_batches} batches with total weight "
                             f"{sums[-1]}; use EvalConfig.steps >= 1 and eval data with "
                             f"nonzero weights")
        n_bytes, total = sums[-2], sums[-1]
        means = sums[:-2] / total
        results = {name: float(m) for name, m in zip(self._names, means, strict=True)}
        if self._byte_level:
            results["bits_per_byte"] = bits_per_byte(results["loss"])
        elif self._count_bytes and n_bytes > 0:
            results["bits_per_byte"] = bits_per_byte(results["loss"], total / n_bytes)
        return results
