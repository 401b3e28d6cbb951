"""`Chunk`: a position-wise layer run over chunks of positions (Reformer's chunked FF).

A feed-forward block holds a ``[batch, length, d_ff]`` activation, and in the backward pass
its cotangent: at 64K positions and ``d_ff = 512`` that is 128 MiB each in float32, more
than the rest of a small layer. Position-wise layers compute every position alone, so
they can run ``chunk_size`` positions at a time; `Chunk` does this with ``lax.map`` over
the chunks, each under ``jax.checkpoint``, so the forward pass keeps only the chunk
inputs and the backward pass recomputes one chunk's activations at a time. The buffer
is then ``[batch, chunk_size, d_ff]``, forward and backward, on every backend (a scan's
iterations cannot be merged, where a plain `Remat` may be scheduled away on CPU).

Dropout inside the chunked layer draws its masks with the key ``fold_in(rng, chunk)``: the
distribution is unchanged, but the masks depend on ``chunk_size`` (as they depend on the
device count in the trainers). Without dropout, chunked equals unchunked up to float
rounding.

References: Kitaev et al., 2020, "Reformer: The Efficient Transformer", section 4
("Chunking"); Trax's ``tl.Chunk`` and the ``ff_chunk_size`` of its Reformer models.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from revtrain.layers.layer import Layer
from revtrain.layers.stack import check_per_sublayer


def check_chunk_size(chunk_size: object, owner: str, name: str = "chunk_size") -> int:
    """Returns ``chunk_size`` if it is a positive int, else raises ValueError naming it."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{owner} {name}={chunk_size!r} must be a positive int; use e.g. "
                         f"{name}=1024 (or leave it unset for no chunking)")
    return chunk_size


class Chunk(Layer):
    """Runs a position-wise ``layer`` over chunks of axis 1: ``[batch, length, ...]`` -> same.

    Args:
      layer: a layer with one output that treats positions independently (`LayerNorm`,
        `Dense`, activations, `Dropout`, `Concatenate`, or a `Serial` of them) and keeps no
        state (a chunk must not update state another chunk reads). With ``n_in > 1``
        inputs, every input is ``[batch, length, ...]`` and all are chunked alike.
      chunk_size: positions per chunk; a length it does not divide is zero-padded to a
        multiple (the padding's outputs are cut off and get no gradient).

    Weights and state are ``(layer.weights,)`` and ``(layer.state,)``, so chunking changes
    a model's weight tree (as in Trax).

    Unlike Trax's ``Chunk``, which chunks the batch axis after ``BatchLeadingAxes`` merged
    batch and length, this chunks the length axis and keeps the batch: a chunk's buffer is
    ``[batch, chunk_size, d_ff]``.

    Raises:
      ValueError: for a ``chunk_size`` that is not a positive int, a ``layer`` that is not
        one-in-one-out, or (at ``init``) a layer with state.
    """

    def __init__(self, layer: Layer, chunk_size: int, name: str | None = None):
        if not isinstance(layer, Layer):
            raise TypeError(f"Chunk wraps a Layer; got {type(layer).__name__}: {layer!r}")
        if layer.n_in < 1 or layer.n_out != 1:
            raise ValueError(f"Chunk needs a layer with inputs and one output; "
                             f"{layer.name} takes {layer.n_in} and gives {layer.n_out}")
        super().__init__(n_in=layer.n_in, n_out=1, name=name or "Chunk", sublayers=(layer,))
        self._chunk_size = check_chunk_size(chunk_size, "Chunk")

    def forward_with_state(self, x, weights, state, rng):
        (layer,) = self.sublayers
        check_per_sublayer(self, weights=weights, state=state)
        (layer_weights,), (layer_state,) = weights, state
        items = tuple(x) if self.n_in > 1 else (x,)
        if any(a.ndim < 2 or a.shape[:2] != items[0].shape[:2] for a in items):
            raise ValueError(f"Chunk expects [batch, length, ...] inputs of one batch and "
                             f"length; got shapes {[a.shape for a in items]}")
        batch, length = items[0].shape[:2]
        if length == 0:
            raise ValueError("Chunk got a length-0 input; pass at least one position")
        size = self.chunk_size_for(length)
        n_chunks = -(-length // size)
        pad = n_chunks * size - length

        def to_chunks(a):
            if pad:
                a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
            return jnp.moveaxis(a.reshape((batch, n_chunks, size) + a.shape[2:]), 1, 0)

        @jax.checkpoint
        def run(chunks, index):
            inputs = chunks if self.n_in > 1 else chunks[0]
            return self._run(inputs, layer_weights, layer_state, rng, index)

        chunked = tuple(to_chunks(a) for a in items)
        ys = lax.map(lambda args: run(*args), (chunked, jnp.arange(n_chunks)))
        ys = jnp.moveaxis(ys, 0, 1)
        y = ys.reshape((batch, n_chunks * size) + ys.shape[3:])
        return (y[:, :length] if pad else y), state

    @property
    def chunk_size(self) -> int:
        """Positions per chunk (fewer when the whole length is shorter)."""
        return self._chunk_size

    def chunk_size_for(self, length: int) -> int:
        """Positions per chunk at ``length``: ``min(chunk_size, length)``."""
        return min(self._chunk_size, length)

    def _run(self, inputs, layer_weights, layer_state, rng, index):
        key = None if rng is None else jax.random.fold_in(rng, index)
        return self.sublayers[0].pure_fn(inputs, layer_weights, layer_state, key)[0]

    def run_chunk(self, x: jax.Array, weights: Any, state: Any, rng: jax.Array | None,
                  index: int | jax.Array, length: int) -> jax.Array:
        """Chunk ``index`` of a ``length``-position call, alone: what `forward_with_state`
        computes for those positions (same key, ``fold_in(rng, index)``; the last chunk
        zero-padded to `chunk_size_for` ``(length)`` as it is there).

        Args:
          x: ``[batch, n, ...]``, the chunk's ``n <= chunk_size_for(length)`` positions
            (one input: ``n_in == 1``).
          weights: the layer's weights, as for `forward_with_state`.
          state: the layer's state, as for `forward_with_state`.
          rng: the layer's key, as for `forward_with_state` (None without one).
          index: the chunk's index (an int or a traced int).
          length: the whole call's length.

        Returns:
          ``[batch, n, ...]``.
        """
        (layer_weights,), (layer_state,) = weights, state
        n, size = x.shape[1], self.chunk_size_for(length)
        if n < size:
            x = jnp.pad(x, [(0, 0), (0, size - n)] + [(0, 0)] * (x.ndim - 2))
        y = self._run(x, layer_weights, layer_state, rng, index)
        return y[:, :n] if n < size else y

    def init_weights_and_state(self, input_signature, rng):
        (layer,) = self.sublayers
        weights, state = layer.init(input_signature, rng=rng)
        if jax.tree.leaves(state):
            raise ValueError(f"Chunk cannot run {layer.name} (created at {layer.caller}): it "
                             f"keeps state, which chunks would update in turn; chunk only "
                             f"stateless position-wise layers")
        return (weights,), (state,)


__all__ = ["Chunk", "check_chunk_size"]
