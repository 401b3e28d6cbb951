"""Restore templates: what a checkpoint is read into, built from shapes, never values.

Restoring a checkpoint needs a template with the structure, shapes and dtypes of what it
holds (`revtrain.training.checkpoints.checkpointer.Checkpointer.restore`). A trainer knows all
of them without touching its values (``value_signature``) and where each value should land
(``value_shardings``), so a template costs no copy of the model to the host and no
device memory: a leaf the trainer keeps on the devices becomes a
``jax.ShapeDtypeStruct`` with its sharding (restored straight into it, each device
reading its slices), a leaf it keeps in host memory a zero-stride numpy placeholder of
its shape (``np.broadcast_to``: no memory, restored as a numpy array).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def value_signature(trainer: Any, part: str) -> Any:
    """``trainer.value_signature(part)``: the ``jax.ShapeDtypeStruct`` tree of one part
    (``'weights'``, ``'state'`` or ``'slots'``) of the trainer's ``train_state``
    (`revtrain.trainers.TrainerProtocol`); no value is read."""
    return trainer.value_signature(part)


def host_placeholder(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """A read-only numpy array of ``shape`` and ``dtype`` that holds no memory."""
    return np.broadcast_to(np.zeros((), dtype), tuple(shape))


def part_template(trainer: Any, part: str) -> Any:
    """The restore template of one part: sharded abstract arrays where the trainer keeps
    the values on the devices, host placeholders where it keeps them in host memory.

    Raises:
      ValueError: when the trainer's shardings and signature have different leaf counts.
    """
    signature = value_signature(trainer, part)
    leaves, treedef = jax.tree_util.tree_flatten(signature)
    shardings = jax.tree_util.tree_leaves(trainer.value_shardings(part),
                                          is_leaf=lambda x: x is None)
    if len(shardings) != len(leaves):
        raise ValueError(f"{len(shardings)} shardings for {len(leaves)} values of "
                         f"{part!r}; give one sharding (or None) per leaf")
    return jax.tree_util.tree_unflatten(treedef, [
        host_placeholder(a.shape, a.dtype) if s is None else
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        for a, s in zip(leaves, shardings, strict=True)])


def host_template(trainer: Any, part: str) -> Any:
    """The template of one part restored into host memory (e.g. a warm start's weights)."""
    return jax.tree.map(lambda a: host_placeholder(a.shape, a.dtype),
                        value_signature(trainer, part))


def checkpoint_template(trainer: Any, parts: Sequence[str], rng: jax.Array) -> dict:
    """The template of a loop checkpoint ``{*parts, 'step', 'rng'}`` (as
    ``Loop.save`` writes it): each part as `part_template`, ``step`` an int64 scalar and
    ``rng`` the uint32 key data of a key like ``rng`` (its shape only is read)."""
    key_shape = jax.eval_shape(jax.random.key_data, rng)
    return {**{part: part_template(trainer, part) for part in parts},
            "step": host_placeholder((), np.int64),
            "rng": host_placeholder(key_shape.shape, key_shape.dtype)}
