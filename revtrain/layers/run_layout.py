"""The stacked layout of a model's weights: each scanned run's layers as one stacked tree.

`revtrain.layers.scan.run_in_series` scans a run of equal layers over their weights stacked
along a new leading axis. Given per-layer weights it stacks them inside every traced call
(and a gradient comes back per layer, so an optimizer sees one leaf per layer: its update
is unrolled over the depth). A trainer can instead *keep* the weights stacked
(`RunLayout.stack`): in the tuple of a series layer's sublayer weights, a run of
``period`` layers repeated ``repeats`` times becomes one `StackedRun` at the run's first
index followed by ``None`` placeholders (so the tuple keeps one entry per sublayer), and
`run_in_series` scans the stacked trees as they are. Gradients and optimizer slots then
have the same stacked leaves, and the compiled step holds one copy of everything per run.

A series layer is one that runs its sublayers by `run_in_series` and says so with a
``scan`` attribute that is True (`revtrain.layers.Serial`,
`revtrain.layers.ReversibleSerial`); its runs are `revtrain.layers.scan.plan_runs`' runs, found
from the sublayers' `revtrain.layers.scan.layer_signature` s. Other combinators are walked
into. The public layout (one entry per layer) is `RunLayout.unstack` of the stacked one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from revtrain.layers.layer import Layer, State, Weights
from revtrain.layers.scan import MIN_REPEATS, StackedRun, layer_signature, plan_runs


def is_series(layer: Layer) -> bool:
    """Whether ``layer`` runs its sublayers by `run_in_series`, scanning runs."""
    return bool(layer.sublayers) and getattr(layer, "scan", False) is True


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """Where a model's stacked runs are: ``(start, period, repeats)`` among this layer's
    sublayers, and the layouts of the sublayers outside them (None: nothing stacked)."""

    runs: tuple[tuple[int, int, int], ...]
    children: tuple[RunLayout | None, ...]

    @staticmethod
    def of(layer: Layer, weights: Weights, state: State,
           pinned: tuple[tuple[int, ...], ...] = ()) -> RunLayout | None:
        """The layout of ``layer`` with these (per-layer) weights and state; None when no
        run is stacked anywhere in it. Only signatures are read (arrays or
        ``ShapeDtypeStruct`` s). ``pinned``: paths (sublayer indices from ``layer``) of
        layers never stacked; a fused loss head's layers (`revtrain.layers.FusedSerial.heads`)
        are added, as they are rewritten, their weights re-nested, before they run."""
        subs = layer.sublayers
        if not subs:
            return None
        pinned = pinned + tuple(path for head in getattr(layer, "heads", ()) for path in head)
        on_path = {path[0] for path in pinned}
        runs: tuple = ()
        if is_series(layer) and len(subs) >= MIN_REPEATS:
            signatures = [None if i in on_path else layer_signature(sub, w, s)
                          for i, (sub, w, s) in enumerate(zip(subs, weights, state,
                                                              strict=True))]
            runs = tuple(seg for seg in plan_runs(signatures) if seg[2] >= MIN_REPEATS)
        inside = {i for start, p, k in runs for i in range(start, start + p * k)}
        inside |= {path[0] for path in pinned if len(path) == 1}
        children = tuple(
            None if i in inside else RunLayout.of(
                sub, w, s, tuple(path[1:] for path in pinned if path[0] == i))
            for i, (sub, w, s) in enumerate(zip(subs, weights, state, strict=True)))
        if not runs and all(c is None for c in children):
            return None
        return RunLayout(runs, children)

    def stack(self, tree: Any, combine: Callable[..., Any] = lambda *a: jnp.stack(a)) -> tuple:
        """Per-layer ``tree`` (weights or a tree of their shape) -> the stacked layout;
        ``combine(*leaves)`` stacks one leaf of every repetition."""
        out = [tree_i if c is None else c.stack(tree_i, combine)
               for tree_i, c in zip(tree, self.children, strict=True)]
        for start, p, k in self.runs:
            out[start:start + p * k] = [StackedRun(
                tuple(jax.tree.map(combine, *tree[start + j:start + p * k:p]) for j in range(p)),
                p, k)] + [None] * (p * k - 1)
        return tuple(out)

    def unstack(self, tree: Any, split: Callable[[Any, int], Any] = lambda a, t: a[t]) -> tuple:
        """The stacked layout -> one entry per layer (``split(leaf, t)`` takes entry ``t``)."""
        out = [tree_i if c is None else c.unstack(tree_i, split)
               for tree_i, c in zip(tree, self.children, strict=True)]
        for start, p, k in self.runs:
            out[start:start + p * k] = tree[start].layer_values(split)
        return tuple(out)


    def truncated(self, tree: Any, repeats: int = MIN_REPEATS) -> tuple[tuple, RunLayout]:
        """Per-layer ``tree`` with every run cut to its first ``repeats`` repetitions, and
        the layout of the cut tree (a model of the same kinds of runs, of any depth)."""
        run_at = {start: (p, k) for start, p, k in self.runs}
        out, children, runs, i = [], [], [], 0
        while i < len(tree):
            if i in run_at:
                p, k = run_at[i]
                keep = p * min(k, repeats)
                runs.append((len(out), p, min(k, repeats)))
                out += tree[i:i + keep]
                children += [None] * keep
                i += p * k
                continue
            child = self.children[i]
            sub, sub_layout = (tree[i], None) if child is None else child.truncated(tree[i],
                                                                                   repeats)
            out.append(sub)
            children.append(sub_layout)
            i += 1
        return tuple(out), RunLayout(tuple(runs), tuple(children))


def map_params(tree: Any, params_like: Any, fn: Callable[[Any], Any]) -> Any:
    """``tree`` (e.g. an optax state) with every subtree of ``params_like`` 's structure
    replaced by ``fn(subtree)``; other nodes (a step count, hyperparameters) are kept."""
    treedef = jax.tree.structure(params_like)
    return jax.tree.map(lambda x: fn(x) if jax.tree.structure(x) == treedef else x, tree,
                        is_leaf=lambda x: jax.tree.structure(x) == treedef)


__all__ = ["RunLayout", "is_series", "map_params"]
