"""Splitting a model into reversible blocks, initialising them, and checking drift.

This module is the home of the block vocabulary: `Block`, `extract_reversible_blocks`,
`blocks_to_layers`, `init_reversible_blocks` and `nest_flat_values`.

Reversible trainers run a model as ``[(std_layer, [rev_layers]), ..., loss_layer]``: each
block's standard layer stores its input, its reversible layers store nothing (their inputs
are recomputed backwards from the block's output), and the loss layer ends the model. The
flat order of that structure (`blocks_to_layers`) is what trainers split their rng over:
flat layer ``i`` gets ``jax.random.split(rng, len(flat))[i]``, exactly as ``Serial(*flat)``.

`reconstruction_error` measures how far the recomputed inputs drift from the stored ones,
so a user can check whether a depth and precision are safe before relying on reversal.

References: Trax's ``extract_reversible_blocks`` / ``init_reversible_blocks``
(``trax.optimizers.trainer``), whose names and block structure these keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revtrain.layers.combinators import Select, Serial, split_rng
from revtrain.layers.fused_head import fuse_loss_heads
from revtrain.layers.layer import Layer, State, Weights
from revtrain.layers.reversible import ReversibleLayer, ReversibleSerial
from revtrain.layers.stack import inputs_from_stack, outputs_onto_stack

Block = tuple[Layer, Sequence[ReversibleLayer]]
"""One reversible block, ``(std_layer, rev_layers)``: a standard layer that stores its input,
then reversible layers whose inputs are recomputed from the block's output. The one
definition; trainers take ``Sequence[Block]``."""

_TINY = 1e-30


def _flat_items(layers: Any) -> list[tuple[bool, Layer]]:
    """Returns ``[(is_reversible, layer), ...]`` with Serials and ReversibleSerials opened."""
    if isinstance(layers, (list, tuple)):
        return [item for layer in layers for item in _flat_items(layer)]
    if isinstance(layers, ReversibleSerial):
        return _flat_items(list(layers.sublayers))
    if isinstance(layers, Serial):
        return _flat_items(list(layers.sublayers))
    if isinstance(layers, ReversibleLayer):
        return [(True, layers)]
    if isinstance(layers, Layer):
        return [(False, layers)]
    raise TypeError(f"expected a Layer or a list of layers, got {type(layers).__name__}; "
                    f"pass the model (or its list of layers) including the loss layer")


def extract_reversible_blocks(layers: Layer | Sequence[Layer]
                              ) -> tuple[list[Block], Layer]:
    """Splits a model into ``[(std_layer, [rev_layers]), ...]`` and a loss layer.

    ``Serial`` layers (and non-reversible ``Serial`` subclasses such as ``Residual``) are
    flattened into their sublayers; a `ReversibleSerial` contributes its members (flattened
    the same way) as reversible layers; any other `ReversibleLayer` is a reversible layer
    and anything else a standard layer. Consecutive standard layers become one block's
    ``Serial(*std_layers)`` (an empty ``Serial()`` when a block starts with reversible
    layers); the standard layers after the last reversible layer become the loss layer
    ``fuse_loss_heads(Serial(*trailing))``: a `FusedSerial` when it holds the LM head and
    a cross-entropy loss, so the loss step never holds full logits
    (`revtrain.layers.fused_head`; the same sublayers and weights layout as the `Serial`).
    A model without reversible layers gives one block with no reversible layers,
    ``(Serial(*layers[:-1]), [])``, and ``Serial(layers[-1])`` as loss layer (Trax crashes
    with an IndexError on such models).

    The layer objects are shared with the model, so weights set on them are the model's.

    Args:
      layers: a layer or a (nested) list of layers, ending in the loss.

    Returns:
      ``(blocks, loss_layer)``.

    Raises:
      ValueError: when the model ends in a reversible layer (no loss layer), or is empty.
    """
    items = _flat_items(layers)
    if not items:
        raise ValueError("extract_reversible_blocks got no layers; pass the model with its "
                         "loss layer")
    if items[-1][0]:
        last = items[-1][1]
        raise ValueError(f"model ends in a reversible layer ({last.name}, created at "
                         f"{last.caller}); add a loss layer (e.g. CrossEntropyLoss) after it")
    if not any(is_rev for is_rev, _ in items):
        return [(Serial(*[layer for _, layer in items[:-1]]), [])], Serial(items[-1][1])
    blocks: list[Block] = []
    std: list[Layer] = []
    rev: list[ReversibleLayer] = []
    for is_rev, layer in items:
        if is_rev:
            rev.append(layer)
            continue
        if rev:
            blocks.append((Serial(*std), rev))
            std, rev = [], []
        std.append(layer)
    return blocks, fuse_loss_heads(Serial(*std))


def blocks_to_layers(blocks: Sequence[Block], loss_layer: Layer) -> list[Layer]:
    """Returns the flat order ``[std_0, *rev_0, std_1, *rev_1, ..., loss_layer]``.

    ``Serial(*blocks_to_layers(blocks, loss_layer))`` computes the model; trainers give
    flat layer ``i`` the key ``jax.random.split(rng, len(flat))[i]``, as that Serial does.
    """
    flat: list[Layer] = []
    for std_layer, rev_layers in blocks:
        flat.append(std_layer)
        flat.extend(rev_layers)
    flat.append(loss_layer)
    return flat


def nest_flat_values(layer: Layer, flat_layers: Sequence[Layer],
                     flat_values: Sequence[Any]) -> Any:
    """``layer``'s weights (or state) tree, built from per-flat-layer values.

    The inverse of flattening: trainers hold one value per flat layer (``flat_layers =
    blocks_to_layers(*extract_reversible_blocks([model, loss]))``); this returns the tree
    ``model.weights`` would have if each flat layer held its value -- without reading or
    writing any layer object, so evaluation and decoding can use a trainer's values
    directly. A layer with sublayers has the tuple of its sublayers' trees, as
    `Layer.weights` does; an empty `Serial` or `ReversibleSerial` (e.g. a model's
    ``n_layers=0`` stack), which flattens to no layer, has the empty tree ``()``.

    Args:
      layer: the model (or any layer whose leaf layers all occur in ``flat_layers``).
      flat_layers: the flat layers, in the trainer's order.
      flat_values: one tree per flat layer (e.g. ``trainer.train_state.weights``).

    Raises:
      ValueError: when the counts differ or a leaf layer of ``layer`` is in no flat layer.
    """
    if len(flat_layers) != len(flat_values):
        raise ValueError(f"got {len(flat_values)} values for {len(flat_layers)} flat layers; "
                         f"pass one value per flat layer")
    by_id: dict[int, Any] = {}

    def register(flat: Layer, value: Any) -> None:
        by_id[id(flat)] = value
        if flat.sublayers and isinstance(value, (tuple, list)) and len(value) == len(
                flat.sublayers):
            for sub, sub_value in zip(flat.sublayers, value, strict=True):
                register(sub, sub_value)

    for flat, value in zip(flat_layers, flat_values, strict=True):
        register(flat, value)

    def nest(sub: Layer) -> Any:
        if id(sub) in by_id:
            return by_id[id(sub)]
        if not sub.sublayers:
            if isinstance(sub, (Serial, ReversibleSerial)):  # Empty: flattens to nothing.
                return ()
            raise ValueError(f"layer {sub.name} (created at {sub.caller}) is in none of the "
                             f"flat layers; pass the flat layers of this model")
        return tuple(nest(s) for s in sub.sublayers)

    return nest(layer)


def init_reversible_blocks(blocks: Sequence[Block], loss_layer: Layer, input_signature: Any,
                           rng: jax.Array) -> tuple[Weights, State]:
    """Initialises every layer of the blocks; the same as ``Serial(*flat).init``.

    Args:
      blocks: the blocks, as returned by `extract_reversible_blocks`.
      loss_layer: the loss layer, as returned by `extract_reversible_blocks`.
      input_signature: `ShapeDtype` (or arrays) of the model's input stack, loss inputs
        included (e.g. ``(inputs, targets, weights)``).
      rng: PRNG key; flat layer ``i`` is initialised with ``split(rng, n_flat)[i]``.

    Returns:
      ``(weights, state)``: tuples with one entry per flat layer (`blocks_to_layers`
      order). Each layer object also keeps its weights and state.
    """
    return Serial(*blocks_to_layers(blocks, loss_layer)).init(input_signature, rng)


def _as_blocks(model_or_blocks: Any) -> tuple[list[Block], Layer]:
    candidate = model_or_blocks
    if (isinstance(candidate, tuple) and len(candidate) == 2
            and isinstance(candidate[1], Layer) and isinstance(candidate[0], (list, tuple))
            and all(isinstance(b, tuple) and len(b) == 2 and isinstance(b[0], Layer)
                    for b in candidate[0])):
        return list(candidate[0]), candidate[1]
    items = _flat_items(candidate)
    if items and items[-1][0]:
        # A reversible stack without a loss (e.g. one ReversibleSerial): an identity ends it.
        return extract_reversible_blocks([candidate, Select([])])
    return extract_reversible_blocks(candidate)


def _relative_error(reconstructed: Any, stored: Any) -> float:
    """``max |reconstructed - stored| / max(max |stored|, tiny)`` over all leaves."""
    error = 0.0
    for rec, ref in zip(jax.tree.leaves(reconstructed), jax.tree.leaves(stored), strict=True):
        ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
        rec = np.asarray(jnp.asarray(rec, jnp.float32), np.float64)
        scale = max(float(np.max(np.abs(ref), initial=0.0)), _TINY)
        error = max(error, float(np.max(np.abs(rec - ref), initial=0.0)) / scale)
    return error


def reconstruction_error(model_or_blocks: Any, batch: Any, rng: jax.Array,
                         keep_every: int | None = None) -> list[float]:
    """Returns, per reversible layer, the relative error of its reconstructed input.

    Runs the model forward on ``batch`` (flat rng split, each layer's own weights and
    state) storing every reversible layer's input, then reverses each block from its
    stored output down to its first reversible layer, as a reversible trainer does, so
    errors accumulate along a block the way they would in training. For each reversible
    layer the figure is ``max |reconstructed - stored| / max(max |stored|, 1e-30)`` over
    its inputs. Float32 stacks stay at rounding level; values near 1e-2 or above mean
    the depth or precision is unsafe for reversal.

    With ``keep_every=k`` the reversal restarts from the exact input of every ``k``-th
    reversible layer of a block (``p = k, 2k, ...``, counting from 0), as the block
    trainers' ``keep_every`` does: those layers' figures are 0 and drift accumulates over
    at most ``k - 1`` reversals. ``benchmarks/reconstruction_drift.py`` measures it
    against depth, precision and ``keep_every`` (the table is in docs/design.md).

    Args:
      model_or_blocks: a layer or list of layers (ending in the loss layer, or in a
        reversible layer: a loss is not needed here), or a ``(blocks, loss_layer)`` pair
        from `extract_reversible_blocks`.
      batch: the model's input stack (one array or a tuple, loss inputs included).
      rng: PRNG key, split over the flat layers as trainers do.
      keep_every: restart the reversal from the stored input every this many reversible
        layers of a block; None reverses each block from its output to its start.

    Returns:
      A list of floats, one per reversible layer in flat order.

    Raises:
      ValueError: when a layer is not initialised, the model is empty, or ``keep_every
        < 1``.
    """
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every={keep_every} must be >= 1 or None")
    blocks, loss_layer = _as_blocks(model_or_blocks)
    flat = blocks_to_layers(blocks, loss_layer)
    for layer in flat:
        if not layer.initialized:
            raise ValueError(f"layer {layer.name} (created at {layer.caller}) is not "
                             f"initialised; call init_reversible_blocks or model.init first")
    rngs = iter(split_rng(rng, len(flat)))
    errors: list[float] = []
    stack = batch
    for std_layer, rev_layers in blocks:
        stack = _run(std_layer, stack, next(rngs))
        records = []
        for layer in rev_layers:
            x = inputs_from_stack(stack, layer.n_in)
            r = next(rngs)
            y, new_state = layer.pure_fn(x, layer.weights, layer.state, r)
            records.append((layer, x, new_state, r))
            stack = outputs_onto_stack(y, stack, layer.n_in)
        errors.extend(_reverse_block(records, stack, keep_every))
    return errors


def _run(layer: Layer, stack: Any, rng: jax.Array | None) -> Any:
    y, _ = layer.pure_fn(inputs_from_stack(stack, layer.n_in), layer.weights, layer.state,
                         rng)
    return outputs_onto_stack(y, stack, layer.n_in)


def is_keep_point(position: int, keep_every: int | None) -> bool:
    """Whether reversible layer ``position`` of a block (counting from 0) keeps a copy of
    its input, so the backward pass recomputes it from that copy instead of reversing it:
    every ``keep_every``-th layer after the first (None: none). The one rule of the block
    trainers' plans (`revtrain.trainers.block.plan`) and of `reconstruction_error`."""
    return keep_every is not None and position > 0 and position % keep_every == 0


def _reverse_block(records: list, stack: Any, keep_every: int | None) -> list[float]:
    """Reverses ``records`` (layer, stored input, new state, rng) from ``stack``, taking
    the stored input of every ``keep_every``-th layer instead of reversing it."""
    errors = []
    for p in range(len(records) - 1, -1, -1):
        layer, stored, new_state, r = records[p]
        if is_keep_point(p, keep_every):
            x = stored
        else:
            y = inputs_from_stack(stack, layer.n_out)
            x = layer.reverse(y, layer.weights, layer.state, new_state, r)
        errors.append(_relative_error(x, stored))
        stack = outputs_onto_stack(x, stack, layer.n_out)
    return errors[::-1]


__all__ = ["Block", "extract_reversible_blocks", "blocks_to_layers", "init_reversible_blocks",
           "is_keep_point", "reconstruction_error"]
