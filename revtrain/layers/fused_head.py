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
output only the loss's first input, so nothing else can read the logits. None of these
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
from revtrain.layers.chunked_loss import (
    chunk_count,
    chunked_weighted_sums,
    flatten_positions,
    mean_from_sums,
)
from revtrain.layers.combinators import Serial
from revtrain.layers.core import Dense
from revtrain.layers.layer import Layer
from revtrain.layers.metrics import CrossEntropyLoss, WeightedCategoryCrossEntropy
from revtrain.layers.scan import run_in_series
from revtrain.layers.stack import check_n_items, check_per_sublayer

_LOSSES = (WeightedCategoryCrossEntropy, CrossEntropyLoss)

Path = tuple[int, ...]


class _PassThrough(Layer):
    """Stands in for the fused ``Dense`` and ``LogSoftmax``: passes the features on."""

    def forward_with_state(self, x, weights, state, rng):
        return x, state


class _FusedLoss(Layer):
    """``(features, targets, weights) -> loss`` of ``dense``, ``log_softmax``, ``loss``.

    Weights: ``(dense_weights, loss_weights)``; state: the loss's (``()``).
    """

    def __init__(self, dense: Dense, log_softmax: LogSoftmax, loss: Layer):
        super().__init__(n_in=3, n_out=1, name=f"Fused{loss.name}")
        self._layers = (dense, log_softmax, loss)

    def _unfused(self, x, weights, state):
        dense, log_softmax, loss = self._layers
        features, targets, mask = x
        logits, _ = dense.pure_fn(features, weights[0], (), None)
        log_probs, _ = log_softmax.pure_fn(logits, (), (), None)
        return loss.pure_fn((log_probs, targets, mask), weights[1], state, None)

    def forward_with_state(self, x, weights, state, rng):
        check_n_items(self, x)
        features, targets, mask = x
        if (features.shape[:-1] != targets.shape
                or not jnp.issubdtype(targets.dtype, jnp.integer)):
            return self._unfused(x, weights, state)
        dense, log_softmax, loss = self._layers
        dense_weights = weights[0]

        def per_position(chunk_features, chunk_targets):
            logits, _ = dense.pure_fn(chunk_features, dense_weights, (), None)
            log_probs, _ = log_softmax.pure_fn(logits, (), (), None)
            return loss.per_position(log_probs, chunk_targets)

        rows = flatten_positions(features, targets, mask)
        vocab_size = dense_weights[0].shape[-1]
        n_chunks = chunk_count(targets.size, vocab_size, loss.n_chunks)
        sums = chunked_weighted_sums(per_position, rows[:2], rows[2], n_chunks)
        return mean_from_sums(*sums), state


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


def find_heads(layers: Sequence[Layer]) -> list[tuple[Path, Path, Path]]:
    """Paths of each fusable ``(Dense, LogSoftmax, loss)`` run by ``Serial(*layers)``.

    A path is the sublayer index at each level of nested plain `Serial` objects. Runs do
    not overlap; the rules are in this module's docstring.
    """
    leaves, found, i = _leaves(layers), [], 0
    while i + 2 < len(leaves):
        triple = leaves[i:i + 3]
        if _fusable(*(layer for _, layer in triple)):
            found.append(tuple(path for path, _ in triple))
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


def _fused_layers(layers: Sequence[Layer], heads: Sequence[tuple[Path, Path, Path]]
                  ) -> list[Layer]:
    new: dict[Path, Layer] = {}
    for dense_path, softmax_path, loss_path in heads:
        dense, log_softmax, loss = (_get_layer(layers, p)
                                    for p in (dense_path, softmax_path, loss_path))
        new[dense_path] = _PassThrough()
        new[softmax_path] = _PassThrough()
        new[loss_path] = _FusedLoss(dense, log_softmax, loss)
    return _replace_layers(layers, new)


def _fused_weights(weights: Sequence, heads: Sequence[tuple[Path, Path, Path]]) -> list:
    new: dict[Path, Any] = {}
    for dense_path, softmax_path, loss_path in heads:
        new[dense_path] = ()
        new[softmax_path] = _get(weights, softmax_path)
        new[loss_path] = (_get(weights, dense_path), _get(weights, loss_path))
    return _replace_tree(weights, new)


def fuse_heads(layers: Sequence[Layer], weights: Sequence) -> tuple[Sequence[Layer], Sequence]:
    """``Serial(*layers)``'s sublayers and weights with each fusable head fused.

    The rewrite `FusedSerial` runs (with its heads found once, at construction).

    Args:
      layers: a `Serial`'s sublayers.
      weights: their weights, one entry per sublayer.

    Returns:
      ``(layers, weights)`` unchanged when nothing fuses; else new lists in which each
      ``Dense`` and ``LogSoftmax`` of a fused run is a pass-through without weights and
      its loss a layer taking ``(dense_weights, loss_weights)``, nested plain `Serial`
      objects rebuilt around them. States and rng keys keep their layout. Running them
      gives the original's outputs and new states to float rounding.
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
    """A `Serial` that computes each fusable ``Dense, LogSoftmax, loss`` run in chunks.

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
    def heads(self) -> tuple[tuple[Path, Path, Path], ...]:
        """The fused runs: ``(dense_path, log_softmax_path, loss_path)`` each (`find_heads`)."""
        return self._heads

    def forward_with_state(self, x, weights, state, rng):
        check_n_items(self, x)
        check_per_sublayer(self, weights=weights, state=state)
        return run_in_series(self._fused, x, _fused_weights(weights, self._heads), state, rng,
                             scan=self.scan)


def fuse_loss_heads(layer: Layer) -> Layer:
    """``layer`` with its LM head and loss computed together, so no full logits exist.

    Apply once to a model with its loss, where it is assembled for training (e.g.
    ``fuse_loss_heads(Serial(model, loss))`` for `revtrain.trainers.Trainer`; the loss layer
    of `revtrain.layers.extract_reversible_blocks` is already fused). It matches, among the
    consecutive leaves of a plain `Serial` (nested plain ``Serial`` objects opened), a
    ``Dense`` then ``LogSoftmax(axis=-1)`` then a `WeightedCategoryCrossEntropy` or
    `CrossEntropyLoss` whose ``n_chunks`` is not 1 (exact classes; the rules are in this
    module's docstring): ``(features [batch, length, d_model], targets int[batch, length],
    weights [batch, length]) -> float32 scalar``, computed one chunk of positions at a time.

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
