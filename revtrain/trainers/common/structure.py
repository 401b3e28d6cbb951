"""Checking that a tree of training values has the structure, shapes and dtypes a trainer
holds (`restore`, `sync_to`), with errors that name the first path that differs."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def check_same_structure(new: Any, old: Any, what: str) -> None:
    """Raises ValueError naming the first path where ``new`` differs from ``old``.

    Compares the tree structures (empty subtrees included; a list stands for a tuple),
    then each leaf's shape and dtype.
    """
    new, old = _lists_as_tuples(new), _lists_as_tuples(old)
    new_leaves, new_def = jax.tree_util.tree_flatten_with_path(new)
    old_leaves, old_def = jax.tree_util.tree_flatten_with_path(old)
    new_paths = [jax.tree_util.keystr(p) for p, _ in new_leaves]
    old_paths = [jax.tree_util.keystr(p) for p, _ in old_leaves]
    for i, old_path in enumerate(old_paths):
        if i >= len(new_paths) or new_paths[i] != old_path:
            got = f"{what}{new_paths[i]}" if i < len(new_paths) else "nothing"
            raise ValueError(f"{what} structure mismatch at {what}{old_path}: expected that "
                             f"path, got {got}{_kind_hint(what)}")
    if len(new_paths) > len(old_paths):
        raise ValueError(f"{what} structure mismatch at {what}{new_paths[len(old_paths)]}: "
                         f"unexpected extra leaf")
    if new_def != old_def:
        raise ValueError(f"{what} structure mismatch: expected {old_def}, got {new_def}")
    for (path, a), (_, b) in zip(new_leaves, old_leaves, strict=True):
        if np.shape(a) != np.shape(b) or np.dtype(_dtype(a)) != np.dtype(_dtype(b)):
            raise ValueError(
                f"{what}{jax.tree_util.keystr(path)} has shape {np.shape(a)} dtype "
                f"{np.dtype(_dtype(a))}; expected {np.shape(b)} {np.dtype(_dtype(b))}")


def _kind_hint(what: str) -> str:
    """Why optimizer slots most often mismatch: values of the other kind of trainer."""
    if what != "slots":
        return ""
    return ("; values from another kind of trainer? `Trainer` keeps one optimizer state "
            "for the whole model, the block trainers one per flat layer")


def lists_as_tuples(tree: Any) -> Any:
    """``tree`` with every list (and plain tuple) turned into a tuple, recursively; other
    nodes (dicts, NamedTuples such as optax states) are kept as they are."""
    return _lists_as_tuples(tree)


def _lists_as_tuples(tree: Any) -> Any:
    if isinstance(tree, list):
        tree = tuple(tree)
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_lists_as_tuples(t) for t in tree)
    return tree


def _dtype(a: Any) -> Any:
    return a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype



__all__ = ["check_same_structure", "lists_as_tuples"]
