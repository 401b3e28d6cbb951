"""The flat form of a checkpoint: a dict from path strings to arrays, and its checks.

A checkpoint is one pytree (the loop stores ``{'weights', 'state', 'slots', 'step',
'rng'}``), saved *flat*: a dict from a path string such as ``'weights/3/0/1'`` to a numpy
array. Flat keys make the on-disk layout independent of how orbax treats tuples, empty
nodes and optax NamedTuples, and make the structure check on restore a comparison of two
ordered key lists. Restoring needs a *template* (the current model's tree): its structure
rebuilds the tree, and any difference in paths, shapes or dtypes is a `ValueError` naming
the first mismatching path (Trax fails with an ``IndexError`` deep inside the restore).

Sharded values (weights and slots under FSDP, `revtrain.trainers.Trainer`) stay the global
``jax.Array`` s they are, so every process writes only its own shards. A template leaf that
is a ``jax.Array`` or a ``jax.ShapeDtypeStruct`` with a sharding (`restore_targets`) is
restored into that sharding, each device reading only its slices -- so a checkpoint saved
on 4 devices with ``fsdp=True`` restores onto 2 devices without it, and the reverse (the
arrays on disk do not record how they were split).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

SEPARATOR = "/"
_KEY_MARK = "__prng_key__"  # Suffix of the path of a flattened typed PRNG key.


def _is_typed_key(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype,
                                                                  jax.dtypes.prng_key)


def _leaves_with_keys(tree: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs; a top-level dict keeps its insertion order (not sorted)."""
    if isinstance(tree, dict):
        return [(f"{name}{SEPARATOR}{key}" if key else str(name), leaf)
                for name, sub in tree.items() for key, leaf in _leaves_with_keys(sub)]
    return [(jax.tree_util.keystr(path, simple=True, separator=SEPARATOR), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def flatten_tree(tree: Any) -> dict[str, Any]:
    """Returns ``{path: array}`` for every leaf of ``tree``.

    Paths join the key path with ``'/'`` (``'weights/3/0/1'``). A top-level dict keeps its
    insertion order, so ``'weights'`` paths come first when the dict lists them first.
    Typed PRNG keys are stored as their uint32 key data. A ``jax.Array`` (e.g. a weight
    sharded over the devices) or a ``jax.ShapeDtypeStruct`` (a restore target carrying its
    sharding) is kept as it is, so orbax saves each process's shards and restores each
    device's slices; every other leaf becomes a numpy array. Empty nodes (``()``, None)
    hold no leaves and vanish; the template given to `unflatten_tree` puts them back.
    """
    flat = {}
    for key, leaf in _leaves_with_keys(tree):
        if _is_typed_key(leaf):
            flat[key + SEPARATOR + _KEY_MARK] = np.asarray(jax.random.key_data(leaf))
        elif isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            flat[key] = leaf
        else:
            flat[key] = np.asarray(leaf)
    return flat


def restore_targets(values: Any, shardings: Any) -> Any:
    """``values`` with each leaf that has a sharding replaced by an abstract target.

    Args:
      values: a tree of arrays (e.g. a trainer's ``saved_values(part)``).
      shardings: the same tree with a ``jax.sharding.Sharding`` or None at each leaf (e.g.
        ``value_shardings(part)``).

    Returns:
      ``values`` where a leaf with a sharding becomes ``jax.ShapeDtypeStruct(shape, dtype,
      sharding=...)``: `Checkpointer.restore` reads it straight into that sharding (each
      device only its slices), whatever sharding or device count it was saved with.
      Leaves with None stay as they are (restored as host arrays).

    Raises:
      ValueError: when the two trees have different numbers of leaves.
    """
    leaves, treedef = jax.tree_util.tree_flatten(values)
    targets = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: x is None)
    if len(targets) != len(leaves):
        raise ValueError(f"{len(targets)} shardings for {len(leaves)} values; give one "
                         f"sharding (or None) per leaf")
    return jax.tree_util.tree_unflatten(treedef, [
        v if s is None else jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=s)
        for v, s in zip(leaves, targets, strict=True)])


def unflatten_tree(flat: Mapping[str, Any], template: Any) -> Any:
    """Inverse of `flatten_tree`: rebuilds ``template``'s structure from ``flat`` values.

    Raises:
      ValueError: when ``flat`` does not hold exactly the template's paths and shapes.
    """
    expected = flatten_tree(template)
    check_matches(signatures(expected), signatures(flat), "values")
    return _rebuild(flat, template, "")


def _rebuild(flat: Mapping[str, Any], template: Any, prefix: str) -> Any:
    if isinstance(template, dict):
        return type(template)(
            (name, _rebuild(flat, sub, f"{prefix}{name}{SEPARATOR}"))
            for name, sub in template.items())
    leaves = []
    for path, old in jax.tree_util.tree_flatten_with_path(template)[0]:
        key = prefix + jax.tree_util.keystr(path, simple=True, separator=SEPARATOR)
        key = key.rstrip(SEPARATOR)
        if _is_typed_key(old):
            leaves.append(jax.random.wrap_key_data(flat[key + SEPARATOR + _KEY_MARK]))
        else:
            leaves.append(flat[key])
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)


def signatures(flat: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{path: (shape, dtype)}`` of a flat tree (arrays or abstract arrays)."""
    return {k: (tuple(np.shape(v)), np.dtype(v.dtype)) for k, v in flat.items()}


class CheckpointMismatchError(ValueError):
    """A readable checkpoint holds another model's paths, shapes or dtypes."""


def _describe(signature: tuple[tuple[int, ...], np.dtype]) -> str:
    shape, dtype = signature
    return f"{dtype.name}[{','.join(str(d) for d in shape)}]"


def check_matches(expected: Mapping[str, tuple], found: Mapping[str, tuple],
                  what: str = "checkpoint") -> None:
    """Checks two ``{path: (shape, dtype)}`` maps agree; raises naming the first mismatch.

    Paths are compared in ``expected``'s order; a path only in ``found`` is reported after
    all of ``expected``'s paths have been checked.

    Raises:
      CheckpointMismatchError: a ValueError naming the first path that is missing, extra,
        or differs in shape/dtype.
    """
    for key, signature in expected.items():
        if key not in found:
            raise CheckpointMismatchError(
                f"{what} does not match the model: path {key!r} ({_describe(signature)}) is "
                f"in the model but not in the {what}")
        if found[key] != signature:
            raise CheckpointMismatchError(
                f"{what} does not match the model at path {key!r}: saved "
                f"{_describe(found[key])}, model {_describe(signature)}; use the "
                f"configuration it was saved with, or a new directory")
    extra = [key for key in found if key not in expected]
    if extra:
        raise CheckpointMismatchError(f"{what} does not match the model: path {extra[0]!r} "
                                      f"is in the {what} but not in the model")
