"""Reversible layers: layers whose inputs can be recomputed from their outputs.

A reversible layer adds two methods to the `Layer` contract:

* ``reverse(output, weights, state, new_state, rng) -> input`` recomputes the input from the
  output, and
* ``reverse_and_grad(output, ct, weights, state, new_state, rng) -> (input, (input_ct,
  weights_ct))`` does that and also back-propagates the cotangent ``ct`` of the output.

``output``/``input`` (and ``ct``/``input_ct``) follow the stack convention: one array when the
layer has one item, else a tuple. ``state`` is the *old* state (what the forward pass was
given) and ``new_state`` what the forward pass returned; ``rng`` is the forward pass's rng, so
dropout masks are recomputed exactly. Reversing never returns a state: a stateful sublayer
(e.g. BatchNorm) is updated once, by the forward pass, never again by the reconstruction.
A trainer that reverses a stack of such layers needs only the last output, not every
activation, so activation memory does not grow with depth.

Differentiation: ``pure_fn`` of every reversible layer is the ordinary forward computation,
so plain ``jax.grad`` through a model containing reversible layers *stores* activations and
gives the gradient of the same function; the memory saving comes from trainers that call
``reverse_and_grad`` layer by layer instead.

References:
  Gomez et al., "The Reversible Residual Network: Backpropagation Without Storing
  Activations", NeurIPS 2017 (RevNet). Kitaev et al., "Reformer: The Efficient Transformer",
  ICLR 2020 (reversible half-residual Transformer blocks). API names follow Trax's
  ``trax.layers.reversible``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from revtrain.layers.combinators import (
    Select,
    Serial,
    flatten_layers,
    split_rng,
)
from revtrain.layers.layer import Layer, State, Weights
from revtrain.layers.position_chunks import chunked_half_residual_reverse, reverse_chunk_size
from revtrain.layers.scan import run_in_series
from revtrain.layers.sequence_parallel import check_not_split
from revtrain.layers.series_init import init_in_series
from revtrain.layers.signatures import LayerError, error_signature
from revtrain.layers.stack import (
    check_n_items,
    check_per_sublayer,
    inputs_from_stack,
    outputs_onto_stack,
    stack_items,
    stack_of,
)


def _raising_layer_errors(method: Callable) -> Callable:
    """Wraps a ``reverse``/``reverse_and_grad`` method so it raises `LayerError`s."""
    if getattr(method, "_raises_layer_errors", False):
        return method

    @functools.wraps(method)
    def wrapped(self, output, *args, **kwargs):
        try:
            return method(self, output, *args, **kwargs)
        except LayerError:
            raise
        except Exception as e:
            raise LayerError(self.name, method.__name__, self.caller, error_signature(output),
                             e) from e

    wrapped._raises_layer_errors = True
    return wrapped


class ReversibleLayer(Layer):
    """Base class of layers whose input can be recomputed from their output.

    Subclasses implement ``forward_with_state`` (the forward pass, also used by ``pure_fn``
    and hence by ``jax.grad``, which stores activations) and `reverse`. The default
    `reverse_and_grad` reconstructs the input with `reverse`, then takes ``jax.vjp`` of
    ``pure_fn`` at the reconstructed input; subclasses may fuse the two.

    As ``pure_fn`` does, `reverse` and `reverse_and_grad` (a subclass's overrides too)
    re-raise any exception as a `LayerError` naming the layer, where it was created and
    the output shapes.
    """

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        for name in ("reverse", "reverse_and_grad"):
            if name in cls.__dict__:
                setattr(cls, name, _raising_layer_errors(cls.__dict__[name]))

    @_raising_layer_errors
    def reverse(self, output: Any, weights: Weights, state: State, new_state: State,
                rng: jax.Array | None) -> Any:
        """Returns the input that produced ``output``.

        Args:
          output: the layer's output (one array when ``n_out == 1``, else a tuple).
          weights: the weights the forward pass used.
          state: the *old* state, the one the forward pass was given.
          new_state: the state the forward pass returned.
          rng: the rng the forward pass used.

        Returns:
          The input, one array when ``n_in == 1``, else a tuple.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define reverse")

    @_raising_layer_errors
    def reverse_and_grad(self, output: Any, ct: Any, weights: Weights, state: State,
                         new_state: State, rng: jax.Array | None
                         ) -> tuple[Any, tuple[Any, Weights]]:
        """Reconstructs the input and back-propagates ``ct`` through the layer.

        Args:
          output: the layer's output, as for `reverse`.
          ct: cotangent of ``output`` (same structure; float0 for integer outputs).
          weights: the layer's weights, as for `reverse`.
          state: the state the forward pass started from, as for `reverse`.
          new_state: the state the forward pass returned, as for `reverse`.
          rng: the forward pass's PRNG key, as for `reverse`.

        Returns:
          ``(input, (input_ct, weights_ct))``; ``input_ct`` has the structure of the input
          (float0 for integer inputs, as ``jax.vjp`` gives), ``weights_ct`` that of
          ``weights``.
        """
        x = self.reverse(output, weights, state, new_state, rng)

        def f(x, w):
            return self.pure_fn(x, w, state, rng)[0]

        _, vjp_fn = jax.vjp(f, x, weights)
        return x, vjp_fn(ct)


class ReversibleSelect(ReversibleLayer):
    """Permutes the top ``len(indices)`` stack items: outputs ``x[i]`` for ``i`` in indices.

    Args:
      indices: a permutation of ``range(len(indices))``.

    Raises:
      ValueError: when ``indices`` is not a permutation (a copy or a drop is not reversible).
    """

    def __init__(self, indices: Sequence[int], name: str | None = None):
        indices = tuple(int(i) for i in indices)
        if sorted(indices) != list(range(len(indices))):
            raise ValueError(f"ReversibleSelect indices {list(indices)} are not a permutation "
                             f"of range({len(indices)}); use plain Select to copy or drop")
        super().__init__(n_in=len(indices), n_out=len(indices),
                         name=name or f"ReversibleSelect{list(indices)}")
        self._indices = indices
        self._inverse = tuple(indices.index(j) for j in range(len(indices)))

    def _permute(self, x: Any, order: tuple[int, ...]) -> Any:
        check_n_items(self, x)
        items = stack_items(x)
        return stack_of(items[i] for i in order)

    def forward_with_state(self, x, weights, state, rng):
        return self._permute(x, self._indices), state

    def reverse(self, output, weights, state, new_state, rng):
        check_n_items(self, output, self.n_out, "output items")
        return self._permute(output, self._inverse)

    def reverse_and_grad(self, output, ct, weights, state, new_state, rng):
        check_n_items(self, output, self.n_out, "output items")
        check_n_items(self, ct, self.n_out, "ct items")
        return (self._permute(output, self._inverse),
                (self._permute(ct, self._inverse), _zeros_like(weights)))


class ReversibleSwap(ReversibleSelect):
    """Swaps the top two stack items: ``(x1, x2) -> (x2, x1)``; its own inverse."""

    def __init__(self):
        super().__init__([1, 0], name="ReversibleSwap")


class ReversibleReshape(ReversibleLayer):
    """Reshapes the top ``n_in`` items to ``[batch, *shape1]``; reverse to ``[batch, *shape2]``.

    The leading (batch) axis is kept. ``shape2`` must be the non-batch shape of the input,
    since the layer holds no state to remember it (as Trax's ``ReversibleReshape``).

    Args:
      shape1: non-batch output shape (may hold one -1).
      shape2: non-batch input shape, restored by `reverse`.
      n_in: how many stack items to reshape, all alike.
    """

    def __init__(self, shape1: Sequence[int], shape2: Sequence[int], n_in: int = 1):
        super().__init__(n_in=n_in, n_out=n_in)
        self._shapes = (tuple(shape1), tuple(shape2))

    def _reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        check_n_items(self, x)
        check_not_split("ReversibleReshape", "reshape before the length is split or use "
                        "seq=1", why="reshapes fixed shapes")
        return stack_of(jnp.reshape(a, (a.shape[0],) + shape) for a in stack_items(x))

    def forward_with_state(self, x, weights, state, rng):
        return self._reshape(x, self._shapes[0]), state

    def reverse(self, output, weights, state, new_state, rng):
        check_n_items(self, output, self.n_out, "output items")
        return self._reshape(output, self._shapes[1])

    def reverse_and_grad(self, output, ct, weights, state, new_state, rng):
        check_n_items(self, output, self.n_out, "output items")
        check_n_items(self, ct, self.n_out, "ct items")
        return (self._reshape(output, self._shapes[1]),
                (self._reshape(ct, self._shapes[1]), _zeros_like(weights)))


class ReversibleHalfResidual(ReversibleLayer):
    """``(acc, *ctx) -> (acc + f(ctx), *ctx)``; the reverse subtracts ``f(ctx)``.

    ``f`` runs ``Serial(*layers)`` (the compute part) on ``ctx`` and then ``attention_layer``
    on the resulting stack; the residual is the single item left on top. Two half-residuals
    with `ReversibleSwap` after each make one RevNet / Reformer block:
    ``y1 = x1 + F(x2); y2 = x2 + G(y1)``. The residual is cast to ``acc``'s dtype, so the
    residual streams keep their dtype whatever ``f`` computes in.

    ``sublayers == (Serial(*layers), attention_layer)``; without an attention layer the
    second is an identity (``Select([0])``, no weights), so ``weights == (compute_weights,
    attention_weights)`` always. The rng is split into one key per sublayer, as `Serial`.

    Recomputing ``f`` in `reverse` uses the forward rng, the *old* state of the compute
    part and the *new* state of the attention layer (as Trax and Reformer, whose attention
    layers keep what they computed in the forward pass, e.g. hash buckets, in their state).
    `reverse_and_grad` is fused: ``f`` runs once, under ``jax.vjp``; with ``chunk_size`` (or
    a `revtrain.layers.Chunk` in the compute part) over chunks of positions where ``f``
    allows it, so that only attention's core sees the whole length
    (`revtrain.layers.position_chunks`).

    Args:
      *layers: the compute part (lists are flattened as in `Serial`).
      attention_layer: an optional layer run after the compute part.
      chunk_size: positions per chunk of `reverse_and_grad`, or None: a `Chunk`'s size if
        the compute part has one, else none (the LMs pass ``ff_chunk_size``).

    Raises:
      ValueError: when ``f`` does not leave exactly one item (the residual), or for a
        ``chunk_size`` that is not a positive int, or not a `Chunk`'s in the compute part.
    """

    def __init__(self, *layers: Any, attention_layer: Layer | None = None,
                 name: str | None = None, chunk_size: int | None = None):
        compute = Serial(*layers)
        attention = Select([0]) if attention_layer is None else attention_layer
        f = Serial(compute, attention)
        f_n_in, f_n_out = f.n_in, f.n_out
        if f_n_out != 1:
            raise ValueError(f"ReversibleHalfResidual: its layers leave {f_n_out} items but "
                             f"the residual must be exactly one; end them with one output")
        super().__init__(n_in=1 + f_n_in, n_out=1 + f_n_in, name=name,
                         sublayers=(compute, attention))
        self._chunking = (reverse_chunk_size(compute, chunk_size), attention_layer is not None)

    def _residual(self, ctx: Any, weights: Weights, state: State,
                  rng: jax.Array | None) -> tuple[jax.Array, State]:
        """Runs ``f`` on the context stack; returns ``(residual, new_state)``."""
        return run_in_series(self.sublayers, ctx, weights, state, rng)

    def init_weights_and_state(self, input_signature, rng):
        _, ctx, _ = self._split(input_signature)
        return init_in_series(self.sublayers, ctx, rng)

    def _split(self, x: Any) -> tuple[jax.Array, Any, tuple]:
        check_n_items(self, x)
        ctx_items = tuple(x[1:])
        return x[0], stack_of(ctx_items), ctx_items

    def forward_with_state(self, x, weights, state, rng):
        acc, ctx, ctx_items = self._split(x)
        residual, new_state = self._residual(ctx, weights, state, rng)
        return (acc + residual.astype(acc.dtype),) + ctx_items, new_state

    def _reverse_state(self, weights: Weights, state: State, new_state: State) -> State:
        check_per_sublayer(self, weights=weights, state=state, new_state=new_state)
        return (state[0], new_state[1])

    def reverse(self, output, weights, state, new_state, rng):
        check_n_items(self, output, self.n_out, "output items")
        acc, ctx, ctx_items = self._split(output)
        residual, _ = self._residual(ctx, weights,
                                     self._reverse_state(weights, state, new_state), rng)
        return (acc - residual.astype(acc.dtype),) + ctx_items

    def reverse_and_grad(self, output, ct, weights, state, new_state, rng):
        check_n_items(self, output, self.n_out, "output items")
        check_n_items(self, ct, self.n_out, "ct items")
        acc, ctx, ctx_items = self._split(output)
        ct_acc, ct_ctx = ct[0], tuple(ct[1:])
        run_state = self._reverse_state(weights, state, new_state)
        chunked = chunked_half_residual_reverse(self.sublayers, self._chunking, acc, ctx_items,
                                                ct, weights, run_state, rng)
        if chunked is not None:
            return chunked

        def f(ctx, w):
            residual, _ = self._residual(ctx, w, run_state, rng)
            return residual.astype(acc.dtype)

        residual, vjp_fn = jax.vjp(f, ctx, weights)
        f_ctx_ct, weights_ct = vjp_fn(ct_acc)
        f_ctx_ct = f_ctx_ct if isinstance(f_ctx_ct, tuple) else (f_ctx_ct,)
        input_ct = (ct_acc,) + tuple(_add_ct(a, b) for a, b in zip(ct_ctx, f_ctx_ct, strict=True))
        return (acc - residual,) + ctx_items, (input_ct, weights_ct)


def _zeros_like(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)


def _add_ct(a: Any, b: Any) -> Any:
    """Adds two cotangents; float0 (integer-input) cotangents stay as they are."""
    if getattr(a, "dtype", None) == jax.dtypes.float0:
        return a
    return a + b


class ReversibleSerial(ReversibleLayer):
    """Runs reversible sublayers one after another; reversible itself.

    Stack, rng and state conventions are `Serial`'s: the rng is split into one key per
    sublayer (``jax.random.split(rng, n)``), ``state``/``weights`` are tuples of the
    sublayers'. `reverse` walks the sublayers backwards, giving sublayer ``i`` its own old
    state ``state[i]`` and new state ``new_state[i]``; `reverse_and_grad` chains the
    sublayers' (possibly fused) ``reverse_and_grad``. The forward pass scans repeated runs
    of sublayers as `Serial` does (``scan=False`` runs them unrolled).

    Raises:
      TypeError: when a sublayer is not a `ReversibleLayer` (the message names it).
    """

    def __init__(self, *layers: Any, name: str | None = None, scan: bool = True):
        sublayers = flatten_layers(layers)
        for i, layer in enumerate(sublayers):
            if not isinstance(layer, ReversibleLayer):
                raise TypeError(f"ReversibleSerial: sublayer {i} ({layer.name}, created at "
                                f"{layer.caller}) is not a ReversibleLayer; move it out of "
                                f"the ReversibleSerial or use a reversible equivalent")
        serial = Serial(*sublayers)
        super().__init__(n_in=serial.n_in, n_out=serial.n_out, name=name,
                         sublayers=sublayers)
        self.scan = scan  # Read by `revtrain.layers.run_layout.is_series`, as `Serial.scan`.

    def forward_with_state(self, x, weights, state, rng):
        check_n_items(self, x)
        check_per_sublayer(self, weights=weights, state=state)
        return run_in_series(self.sublayers, x, weights, state, rng, scan=self.scan)

    def init_weights_and_state(self, input_signature, rng):
        check_n_items(self, input_signature)
        return init_in_series(self.sublayers, input_signature, rng)

    def _backwards(self, weights: Weights, state: State, new_state: State,
                   rng: jax.Array | None) -> list:
        check_per_sublayer(self, weights=weights, state=state, new_state=new_state)
        n = len(self.sublayers)
        return list(zip(self.sublayers, range(n), state, new_state,
                        split_rng(rng, n), strict=True))[::-1]

    def reverse(self, output, weights, state, new_state, rng):
        check_n_items(self, output, self.n_out, "output items")
        stack = output
        for layer, i, s, new_s, r in self._backwards(weights, state, new_state, rng):
            y = inputs_from_stack(stack, layer.n_out)
            x = layer.reverse(y, weights[i], s, new_s, r)
            stack = outputs_onto_stack(x, stack, layer.n_out)
        return stack

    def reverse_and_grad(self, output, ct, weights, state, new_state, rng):
        check_n_items(self, output, self.n_out, "output items")
        check_n_items(self, ct, self.n_out, "ct items")
        stack, ct_stack = output, ct
        weights_ct = [None] * len(self.sublayers)
        for layer, i, s, new_s, r in self._backwards(weights, state, new_state, rng):
            y = inputs_from_stack(stack, layer.n_out)
            y_ct = inputs_from_stack(ct_stack, layer.n_out)
            x, (x_ct, weights_ct[i]) = layer.reverse_and_grad(y, y_ct, weights[i], s, new_s, r)
            stack = outputs_onto_stack(x, stack, layer.n_out)
            ct_stack = outputs_onto_stack(x_ct, ct_stack, layer.n_out)
        return stack, (ct_stack, tuple(weights_ct))


__all__ = ["ReversibleLayer", "ReversibleSelect", "ReversibleSwap", "ReversibleReshape",
           "ReversibleHalfResidual", "ReversibleSerial"]
