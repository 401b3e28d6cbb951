"""Fusing ``Dense, LogSoftmax, cross-entropy loss`` so that no full logits buffer exists.

A language model ends in ``Dense(vocab_size), LogSoftmax()`` and trains with a
cross-entropy loss after it. Run one after another, the loss step (forward and backward)
holds several ``[batch, length, vocab_size]`` float buffers at once: the logits, the
log-probabilities and their gradients (about 4 logits buffers for the reversible LM's
loss layer at vocab 32,000; 0.4 fused). `fuse_loss_heads`, applied once where a model and
its loss are put together for training (`revtrain.layers.extract_reversible_blocks` does it
for the loss layer it returns; ``Serial(model, loss)`` for `revtrain.trainers.Trainer` is
passed through it), finds these three layers where a `Serial` runs them consecutively and
returns a `FusedSerial` that computes them together, one chunk of positions at a time (a
``jax.lax.scan`` with each chunk under ``jax.checkpoint``,
`revtrain.layers.chunked_loss.chunked_weighted_sums`): each chunk applies the ``Dense``,
the ``LogSoftmax`` and the loss's own per-position function to its features, so the full
logits never exist and the step peaks near one logits buffer.

When it fuses. Three *consecutive leaves* of a `Serial` (nested plain `Serial` objects,
exact class, are opened; any other combinator, subclasses such as ``Residual`` included,
is a leaf) must be:

* a `Dense` (exact class; with or without bias),
* a `LogSoftmax` (exact class) over ``axis=-1``,
* a `WeightedCategoryCrossEntropy` (any ``label_smoothing``) or `CrossEntropyLoss`
  (exact classes) whose ``n_chunks`` is not 1.

Consecutive on the stack means the ``Dense`` output feeds only the ``LogSoftmax`` and that
output only the loss's first input, so nothing else can read the logits.

The position-wise work before the head joins the fusion too when it is a `Chunk` leaf
right before the ``Dense`` whose layer (nested plain Serials opened) is ``position_wise``
leaves (`revtrain.layers.Layer`: no rng, no state), the first of them possibly a
``Concatenate(axis=-1)`` of feature items: the reversible LM's ``Chunk(Serial(Concatenate,
LayerNorm))`` over its two residual streams. Each loss chunk then computes its own
normalised features from the streams' rows, so neither the ``[batch, length, 2 * d_model]``
features nor their cotangent exist at full length (the loss program of a block trainer
holds the streams, their cotangents and one chunk's temporaries). Its chunks are at most
the `Chunk`'s ``batch * chunk_size`` positions where the position count has a divisor
near that (`_prefix_chunk_count`); at a prime count they are fewer and larger. None of these
layers reads its mode, rng or state (their state is ``()``), and each computes every
position from that position alone, so chunking positions changes only the order of the
final float32 sums: the fused value and gradients equal the unfused ones to float
rounding, in any dtype (the same layer code runs on each chunk). The chunk count is the
loss's: ``chunk_count(positions, vocab_size, loss n_chunks)``, so with the default
``n_chunks=None`` a byte-level model (vocab 256, 8 x 256 positions) is one chunk.
Features whose leading shape is not the targets' shape, or non-integer targets, run the
three layers unfused (their own errors then apply).

Nothing outside the traced computation changes: the `FusedSerial` has the `Serial`'s
sublayers (the same objects), so its weights and state trees (one entry per sublayer), rng
keys (one per sublayer, as `Serial` splits them), checkpoints and the model without its
loss (e.g. for decoding) are those of the `Serial`. A plain `Serial` never fuses.

Opt-out: ``n_chunks=1`` on the loss layer (never chunk) also never fuses.

References: the fused linear cross-entropy of large-vocabulary training (e.g. Wijmans et
al., 2024, "Cut Your Losses in Large-Vocabulary Language Models");
`revtrain.layers.projected_loss.ProjectedCrossEntropy`, the same computation as one layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from revtrain.layers.activations import LogSoftmax
from revtrain.layers.chunk import Chunk
from revtrain.layers.chunked_loss import (
    chunk_count,
    chunked_weighted_sums,
    flatten_positions,
    mean_from_sums,
)
from revtrain.layers.combinators import Concatenate, Serial
from revtrain.layers.core import Dense
from revtrain.layers.layer import Layer
from revtrain.layers.metrics import CrossEntropyLoss, WeightedCategoryCrossEntropy
from revtrain.layers.remat import RematSchedule
from revtrain.layers.scan import run_in_series
from revtrain.layers.stack import check_n_items, check_per_sublayer

_LOSSES = (WeightedCategoryCrossEntropy, CrossEntropyLoss)

Path = tuple[int, ...]


class _PassThrough(Layer):
    """Stands in for a fused ``Chunk``, ``Dense`` or ``LogSoftmax``: passes its ``n_items``
    items on."""

    def __init__(self, n_items: int = 1):
        super().__init__(n_in=n_items, n_out=n_items)

    def forward_with_state(self, x, weights, state, rng):
        return x, state


def _empty_state(layer: Layer) -> Any:
    """The state tree of a stateless position-wise ``layer`` (plain Serials opened)."""
    if type(layer) is Serial:
        return tuple(_empty_state(sub) for sub in layer.sublayers)
    return ()


class _FusedLoss(Layer):
    """``(*features, targets, weights) -> loss`` of ``prefix`` (a `Chunk` or None),
    ``dense``, ``log_softmax``, ``loss``.

    Weights: ``(prefix_weights or (), dense_weights, loss_weights)``; state: the loss's
    (``()``). ``features`` are the prefix's ``n_in`` inputs, or one item without a prefix.
    """

    def __init__(self, prefix: Chunk | None, dense: Dense, log_softmax: LogSoftmax,
                 loss: Layer):
        n_features = 1 if prefix is None else prefix.n_in
        super().__init__(n_in=n_features + 2, n_out=1, name=f"Fused{loss.name}")
        self._layers = (prefix, dense, log_softmax, loss)

    def _features(self, items, prefix_weights):
        prefix = self._layers[0]
        if prefix is None:
            return items[0]
        (inner,), (inner_weights,) = prefix.sublayers, prefix_weights
        x = tuple(items) if len(items) > 1 else items[0]
        return inner.pure_fn(x, inner_weights, _empty_state(inner), None)[0]

    def _unfused(self, x, weights, state):
        prefix, dense, log_softmax, loss = self._layers
        *items, targets, mask = x
        features = items[0] if prefix is None else prefix.pure_fn(
            tuple(items) if len(items) > 1 else items[0], weights[0],
            (_empty_state(prefix.sublayers[0]),), None)[0]
        logits, _ = dense.pure_fn(features, weights[1], (), None)
        log_probs, _ = log_softmax.pure_fn(logits, (), (), None)
        return loss.pure_fn((log_probs, targets, mask), weights[2], state, None)

    def forward_with_state(self, x, weights, state, rng):
        check_n_items(self, x)
        *items, targets, mask = x
        if (any(f.ndim < 1 or f.shape[:-1] != targets.shape for f in items)
                or not jnp.issubdtype(targets.dtype, jnp.integer)):
            return self._unfused(x, weights, state)
        prefix, dense, log_softmax, loss = self._layers
        if prefix is not None and targets.size == 0:  # Nothing to chunk: the Chunk's rules.
            return self._unfused(x, weights, state)
        prefix_weights, dense_weights = weights[0], weights[1]

        def per_position(*chunk_rows):
            *chunk_items, chunk_targets = chunk_rows
            # A prefix sees [1, rows, features] items: its leaves are position-wise.
            features = self._features([f[None] for f in chunk_items], prefix_weights)[0]
            logits, _ = dense.pure_fn(features, dense_weights, (), None)
            log_probs, _ = log_softmax.pure_fn(logits, (), (), None)
            return loss.per_position(log_probs, chunk_targets)

        first, flat_targets, flat_mask = flatten_positions(items[0], targets, mask)
        rows = (first, *(f.reshape(first.shape[0], f.shape[-1]) for f in items[1:]),
                flat_targets)
        vocab_size = dense_weights[0].shape[-1]
        n_chunks = chunk_count(targets.size, vocab_size, loss.n_chunks)
        if prefix is not None and targets.ndim >= 2:
            per_chunk = targets.size // targets.shape[1] * prefix.chunk_size_for(
                targets.shape[1])
            n_chunks = _prefix_chunk_count(targets.size, vocab_size, max(
                n_chunks, -(-targets.size // per_chunk)))
        sums = chunked_weighted_sums(per_position, rows, flat_mask, n_chunks)
        return mean_from_sums(*sums), state


def _prefix_chunk_count(n_positions: int, vocab: int, wanted: int) -> int:
    """Equal chunks of at most ``n_positions / wanted`` positions (the Chunk's size): the
    first divisor of ``n_positions`` from ``wanted`` up to ``2 * wanted``; where there is
    none (a prime length), `chunk_count`'s largest divisor below, so the chunks stay few
    (and larger than the Chunk's)."""
    for n in range(wanted, min(2 * wanted, n_positions) + 1):
        if n_positions % n == 0:
            return n
    return chunk_count(n_positions, vocab, wanted)


def _leaves(layers: Sequence[Layer], prefix: Path = ()) -> list[tuple[Path, Layer]]:
    """``(path, layer)`` of the layers run in order, opening nested plain Serials."""
    out = []
    for i, layer in enumerate(layers):
        if type(layer) is Serial:
            out += _leaves(layer.sublayers, prefix + (i,))
        else:
            out.append((prefix + (i,), layer))
    return out


def _fusable(dense: Layer, log_softmax: Layer, loss: Layer) -> bool:
    return (type(dense) is Dense and type(log_softmax) is LogSoftmax
            and log_softmax.axis == -1 and type(loss) in _LOSSES
            and loss.n_chunks != 1)


def _absorbable(layer: Layer) -> bool:
    """A `Chunk` of position-wise leaves, the first possibly a ``Concatenate(axis=-1)``."""
    if type(layer) is not Chunk:
        return False
    first, *rest = [leaf for _, leaf in _leaves(layer.sublayers)]
    return ((first.position_wise or (type(first) is Concatenate and first.axis == -1))
            and all(leaf.position_wise for leaf in rest))


def find_heads(layers: Sequence[Layer]) -> list[tuple[Path, ...]]:
    """Paths of each fusable ``([Chunk,] Dense, LogSoftmax, loss)`` run by
    ``Serial(*layers)``: three paths, or four when the `Chunk` before the ``Dense`` joins.

    A path is the sublayer index at each level of nested plain `Serial` objects. Runs do
    not overlap; the rules are in this module's docstring.
    """
    leaves, found, i = _leaves(layers), [], 0
    while i + 2 < len(leaves):
        triple = leaves[i:i + 3]
        if _fusable(*(layer for _, layer in triple)):
            run = leaves[i - 1:i + 3] if i > 0 and _absorbable(leaves[i - 1][1]) else triple
            found.append(tuple(path for path, _ in run))
            i += 3
        else:
            i += 1
    return found


def _get(tree: Any, path: Path) -> Any:
    for i in path:
        tree = tree[i]
    return tree


def _replace(items: Sequence, new: dict[Path, Any], rebuild: Callable[[Any, list], Any],
             children: Callable[[Any], Sequence], prefix: Path = ()) -> list:
    """``items`` with the entry at each path of ``new`` replaced, the containers on the way
    rebuilt by ``rebuild(old_container, new_children)`` (one walk for layers and weights)."""
    out = []
    for i, item in enumerate(items):
        path = prefix + (i,)
        if path in new:
            item = new[path]
        elif any(p[:len(path)] == path for p in new):
            item = rebuild(item, _replace(children(item), new, rebuild, children, path))
        out.append(item)
    return out


def _replace_layers(layers: Sequence[Layer], new: dict[Path, Layer]) -> list[Layer]:
    return _replace(layers, new, lambda layer, subs: Serial(*subs, name=layer.name,
                                                            scan=layer.scan),
                    lambda layer: layer.sublayers)


def _replace_tree(tree: Sequence, new: dict[Path, Any]) -> list:
    return _replace(tree, new, lambda _, values: tuple(values), lambda value: value)


def _split(head: tuple[Path, ...]) -> tuple[Path | None, Path, Path, Path]:
    return (None, *head) if len(head) == 3 else head


def _fused_layers(layers: Sequence[Layer], heads: Sequence[tuple[Path, ...]]) -> list[Layer]:
    new: dict[Path, Layer] = {}
    for head in heads:
        prefix_path, dense_path, softmax_path, loss_path = _split(head)
        prefix = None if prefix_path is None else _get_layer(layers, prefix_path)
        dense, log_softmax, loss = (_get_layer(layers, p)
                                    for p in (dense_path, softmax_path, loss_path))
        if prefix is not None:
            new[prefix_path] = _PassThrough(prefix.n_in)
        new[dense_path] = _PassThrough()
        new[softmax_path] = _PassThrough()
        new[loss_path] = _FusedLoss(prefix, dense, log_softmax, loss)
    return _replace_layers(layers, new)


def _fused_weights(weights: Sequence, heads: Sequence[tuple[Path, ...]]) -> list:
    new: dict[Path, Any] = {}
    for head in heads:
        prefix_path, dense_path, softmax_path, loss_path = _split(head)
        prefix_weights = ()
        if prefix_path is not None:
            prefix_weights, new[prefix_path] = _get(weights, prefix_path), ()
        new[dense_path] = ()
        new[softmax_path] = _get(weights, softmax_path)
        new[loss_path] = (prefix_weights, _get(weights, dense_path), _get(weights, loss_path))
    return _replace_tree(weights, new)


def fuse_heads(layers: Sequence[Layer], weights: Sequence) -> tuple[Sequence[Layer], Sequence]:
    """``Serial(*layers)``'s sublayers and weights with each fusable head fused.

    The rewrite `FusedSerial` runs (with its heads found once, at construction).

    Args:
      layers: a `Serial`'s sublayers.
      weights: their weights, one entry per sublayer.

    Returns:
      ``(layers, weights)`` unchanged when nothing fuses; else new lists in which each
      ``Chunk``, ``Dense`` and ``LogSoftmax`` of a fused run is a pass-through without
      weights and its loss a layer taking ``(chunk_weights or (), dense_weights,
      loss_weights)``, nested plain `Serial` objects rebuilt around them. States and rng
      keys keep their layout. Running them gives the original's outputs and new states
      to float rounding.
    """
    heads = find_heads(layers)
    if not heads:
        return layers, weights
    return _fused_layers(layers, heads), _fused_weights(weights, heads)


def _get_layer(layers: Sequence[Layer], path: Path) -> Layer:
    layer = layers[path[0]]
    for i in path[1:]:
        layer = layer.sublayers[i]
    return layer


class FusedSerial(Serial):
    """A `Serial` that computes each fusable ``[Chunk,] Dense, LogSoftmax, loss`` run in
    chunks.

    Built by `fuse_loss_heads`. Its sublayers, ``n_in``/``n_out``, weights and state trees,
    initialisation and rng use are the `Serial`'s; its heads (`find_heads`) are found once,
    here, and each trace runs the rewritten layers of `fuse_heads` on the rewritten weights
    (a re-nesting of the same arrays), so the full ``[batch, length, vocab]`` logits never
    exist. Outputs, new states and gradients equal the `Serial`'s to float rounding.

    Args:
      *layers: the sublayers, as for `Serial`.
      name: the layer's name, as for `Serial`.
      scan: scan repeated runs of sublayers, as for `Serial`.
    """

    def __init__(self, *layers: Any, name: str | None = None, scan: bool = True):
        super().__init__(*layers, name=name, scan=scan)
        self._heads = tuple(find_heads(self.sublayers))
        self._fused = _fused_layers(self.sublayers, self._heads)

    @property
    def heads(self) -> tuple[tuple[Path, ...], ...]:
        """The fused runs: ``([chunk_path,] dense_path, log_softmax_path, loss_path)`` each
        (`find_heads`)."""
        return self._heads

    def forward_with_state(self, x, weights, state, rng, remat: RematSchedule | None = None):
        """`Serial.forward_with_state` of the rewritten layers (a fused head is one layer,
        its stand-ins weightless)."""
        check_n_items(self, x)
        check_per_sublayer(self, weights=weights, state=state)
        return run_in_series(self._fused, x, _fused_weights(weights, self._heads), state, rng,
                             scan=self.scan, remat=remat)


def fuse_loss_heads(layer: Layer) -> Layer:
    """``layer`` with its LM head and loss computed together, so no full logits exist.

    Apply once to a model with its loss, where it is assembled for training (e.g.
    ``fuse_loss_heads(Serial(model, loss))`` for `revtrain.trainers.Trainer`; the loss layer
    of `revtrain.layers.extract_reversible_blocks` is already fused). It matches, among the
    consecutive leaves of a plain `Serial` (nested plain ``Serial`` objects opened), a
    ``Dense`` then ``LogSoftmax(axis=-1)`` then a `WeightedCategoryCrossEntropy` or
    `CrossEntropyLoss` whose ``n_chunks`` is not 1 (exact classes; the rules are in this
    module's docstring), with a position-wise `Chunk` right before the ``Dense`` joining
    them: ``(features [batch, length, d_model] (one per Chunk input), targets
    int[batch, length], weights [batch, length]) -> float32 scalar``, computed one chunk of
    positions at a time.

    Args:
      layer: any layer; only a plain `Serial` (exact class) can fuse.

    Returns:
      A `FusedSerial` with ``layer``'s sublayers (the same objects, so the same weights,
      state, rng and checkpoint layout, initialised when they are) when it has a
      fusable head; else ``layer`` itself.

    References: the fused linear cross-entropy of Wijmans et al., 2024, "Cut Your Losses in
    Large-Vocabulary Language Models"; `revtrain.layers.ProjectedCrossEntropy` is the same
    computation as one layer.
    """
    if type(layer) is not Serial or not find_heads(layer.sublayers):
        return layer
    return FusedSerial(*layer.sublayers, name=layer.name, scan=layer.scan)


__all__ = ["FusedSerial", "find_heads", "fuse_heads", "fuse_loss_heads"]
