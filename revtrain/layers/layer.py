"""`Layer`: the base class of all layers, holding weights and computing through `pure_fn`.

A layer is an object that holds weights and state but computes through one pure function,
``pure_fn(x, weights, state, rng) -> (y, new_state)``, which is jit-able and never reads
mutable attributes of the layer. Subclasses implement two hooks:

* ``forward_with_state(x, weights, state, rng) -> (y, new_state)`` -- the computation.
* ``init_weights_and_state(input_signature, rng) -> (weights, state)`` -- returns new weights
  and state from the input signature alone (no real batch). The default gives ``((), ())``.

``Weights`` and ``State`` are pytrees of arrays; a layer without them has ``()`` (`EMPTY`),
and a layer with sublayers (a combinator) has exactly ``tuple(s.weights for s in
sublayers)``. The vocabulary is described in `revtrain.layers.base`.

References: Trax's ``trax.layers.base.Layer``, whose API names revtrain keeps.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax

from revtrain.layers.signatures import (
    LayerError,
    creation_site,
    error_signature,
    signature_of,
)
from revtrain.layers.stack import check_n_items, check_per_sublayer
from revtrain.layers.structure_keys import structure_key_of

Weights = Any
State = Any

EMPTY = ()


def _has_own_weights(layer: Layer) -> bool:
    """True for a leaf layer that makes weights or state (it overrides the init hook)."""
    return (not layer.sublayers
            and type(layer).init_weights_and_state is not Layer.init_weights_and_state)


def _check_no_reused_layers(layer: Layer) -> None:
    """Raises ValueError when one layer object with weights occurs twice under ``layer``.

    Trax shares the weights of a reused layer; revtrain does not: every occurrence would
    get its own copy of the weights in a trainer, only the last copy would be written back
    to the layer object, and the copies would silently diverge. Weightless layers (``Relu``,
    ``Dropout``, ``ReversibleSwap``, ...) may be reused freely.
    """
    seen: set[int] = set()
    pending = list(layer.sublayers)
    while pending:
        sub = pending.pop()
        pending.extend(sub.sublayers)
        if not _has_own_weights(sub):
            continue
        if id(sub) in seen:
            raise ValueError(
                f"{sub.name} (created at {sub.caller}) is used more than once in {layer.name}; "
                f"revtrain does not share weights between uses of one layer object; create "
                f"a separate {sub.name} for each use")
        seen.add(id(sub))


class Layer:
    """Base class of all layers: an ``n_in -> n_out`` function on the stack with weights.

    Attributes:
      n_in: number of stack items the layer takes.
      n_out: number of stack items the layer puts back.
      name: the layer's name (class name unless given).
      sublayers: tuple of child layers (empty for a leaf layer).
      weights: pytree of arrays; ``()`` for a layer without weights. For a layer with
        sublayers, the tuple of the sublayers' weights; assigning it assigns theirs.
      state: as ``weights``, for values updated by the forward pass.
      rng: the PRNG key used by ``init`` and ``forward`` when none is given.

    A layer object with weights or state may occur only once in a model: a combinator
    whose sublayers contain it twice raises ValueError (Trax would share its weights;
    revtrain's trainers would train two copies). Build one layer object per use.

    Every layer records the arguments it was constructed with; `structure_key` is a hashable
    summary of them, so two layers built with equal arguments are known to compute the same
    function (trainers use this to compile one function for many identical layers). The
    arguments must not change after construction: the key is computed once and kept.

    ``position_wise`` (a class attribute, False here) says that a layer computes each
    position of its ``[batch, length, ...]`` input alone, ignoring its rng and keeping no
    state, so any slice of positions can be computed by itself: `LayerNorm`, `Dense` and
    element-wise activations set it, and a half-residual's reverse then runs over chunks
    of positions (`revtrain.layers.position_chunks`), and a fused loss computes a
    `revtrain.layers.Chunk` of them chunk by chunk (`revtrain.layers.fused_head`). It is
    not inherited: a subclass (which may read its rng or mix positions) is position-wise
    only where its own class body says ``position_wise = True`` again.
    """

    position_wise: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "position_wise" not in cls.__dict__:  # A subclass must say it again.
            cls.position_wise = False

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj._constructor_args = (args, kwargs)
        return obj

    def __init__(self, n_in: int = 1, n_out: int = 1, name: str | None = None,
                 sublayers: Sequence[Layer] = ()):
        if n_in < 0 or n_out < 0:
            raise ValueError(f"n_in={n_in} and n_out={n_out} must be >= 0")
        self._n_in = n_in
        self._n_out = n_out
        self._name = name or type(self).__name__
        self._sublayers = tuple(sublayers)
        self._caller = creation_site(self)
        _check_no_reused_layers(self)
        self._weights: Any = EMPTY
        self._state: Any = EMPTY
        self._initialized = False
        self._rng = None

    # ----------------------------------------------------------------------------------
    # Properties.

    @property
    def n_in(self) -> int:
        return self._n_in

    @property
    def n_out(self) -> int:
        return self._n_out

    @property
    def name(self) -> str:
        return self._name

    @property
    def sublayers(self) -> tuple[Layer, ...]:
        return self._sublayers

    @property
    def constructor_args(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` this layer object was constructed with (the key's source)."""
        return self._constructor_args

    @property
    def caller(self) -> str:
        """``file:line`` where this layer object was created."""
        return self._caller

    @functools.cached_property
    def structure_key(self) -> Any:
        """Hashable key equal for layers of one class built with equal arguments, or None.

        Trainers share one compiled program between layers whose keys are equal and not
        None; None means "never share": the layer's identity cannot be proven (its class
        is defined inside a function, an argument is a lambda, closure, bound method or an
        unhashable object, or a sublayer's key is None). Arguments are bound to the
        constructor's signature with defaults filled in, so ``Concatenate()`` and
        ``Concatenate(axis=-1)`` have the same key. Computed on first access and cached
        (constructor arguments never change). The full rule is in
        `revtrain.layers.structure_keys`.

        Returns:
          ``(module, qualname, args, kwargs)`` with every argument frozen, or None.
        """
        return structure_key_of(self)

    @property
    def weights(self) -> Weights:
        if self._sublayers:
            return tuple(s.weights for s in self._sublayers)
        return self._weights

    @weights.setter
    def weights(self, weights: Weights) -> None:
        self._set_tree("weights", weights)

    @property
    def state(self) -> State:
        if self._sublayers:
            return tuple(s.state for s in self._sublayers)
        return self._state

    @state.setter
    def state(self, state: State) -> None:
        self._set_tree("state", state)

    def _set_tree(self, kind: str, value: Any) -> None:
        if self._sublayers:
            check_per_sublayer(self, **{kind: value})
            for sub, sub_value in zip(self._sublayers, value, strict=True):
                sub._set_tree(kind, sub_value)
        else:
            setattr(self, "_" + kind, value)
        self._initialized = True

    @property
    def initialized(self) -> bool:
        """True once `init` ran or weights were assigned (for combinators: all sublayers)."""
        if self._sublayers:
            return all(s.initialized for s in self._sublayers)
        return self._initialized or not _has_own_weights(self)

    @property
    def rng(self) -> jax.Array:
        if self._rng is None:
            self._rng = jax.random.key(0)
        return self._rng

    @rng.setter
    def rng(self, rng: jax.Array) -> None:
        self._rng = rng

    # ----------------------------------------------------------------------------------
    # Hooks for subclasses.

    def forward_with_state(self, x: Any, weights: Weights, state: State,
                           rng: jax.Array) -> tuple[Any, State]:
        """Computes the layer; subclasses override. Must be pure (see `pure_fn`)."""
        raise NotImplementedError(f"{type(self).__name__} does not define forward_with_state")

    def init_weights_and_state(self, input_signature: Any,
                               rng: jax.Array) -> tuple[Weights, State]:
        """Returns new ``(weights, state)`` for inputs of ``input_signature``."""
        del input_signature, rng
        return EMPTY, EMPTY

    # ----------------------------------------------------------------------------------
    # Public API.

    def pure_fn(self, x: Any, weights: Weights, state: State,
                rng: jax.Array | None) -> tuple[Any, State]:
        """Runs the layer as a pure function: ``(x, weights, state, rng) -> (y, new_state)``.

        Args:
          x: one array when ``n_in == 1``, else a tuple of ``n_in`` arrays.
          weights: the layer's weights pytree.
          state: the layer's state pytree.
          rng: a PRNG key (``jax.random.key``); may be None for deterministic layers.

        Returns:
          ``(y, new_state)``; ``y`` is one array when ``n_out == 1`` else a tuple.

        Raises:
          LayerError: wrapping any exception raised by the computation (or a ValueError
            when ``x`` does not hold ``n_in`` items), naming this layer, where it was
            created and the input shapes.
        """
        try:
            check_n_items(self, x)
            return self.forward_with_state(x, weights, state, rng)
        except LayerError:
            raise
        except Exception as e:
            raise LayerError(self.name, "pure_fn", self._caller, error_signature(x), e) from e

    def forward(self, x: Any) -> Any:
        """Runs the layer on ``x`` with its own weights, state and rng; returns ``y``.

        The new state is stored in the layer (as Trax's ``__call__`` does).
        """
        self._check_initialized()
        y, new_state = self.pure_fn(x, self.weights, self.state, self.rng)
        self.state = new_state
        return y

    def __call__(self, x: Any, weights: Weights | None = None, state: State | None = None,
                 rng: jax.Array | None = None) -> Any:
        """Convenience: ``layer(x)`` runs `forward`; with weights given, `pure_fn` (y only)."""
        if weights is None and state is None and rng is None:
            return self.forward(x)
        self._check_initialized()
        weights = self.weights if weights is None else weights
        state = self.state if state is None else state
        rng = self.rng if rng is None else rng
        y, _ = self.pure_fn(x, weights, state, rng)
        return y

    def init(self, input_signature: Any, rng: jax.Array | None = None) -> tuple[Weights, State]:
        """Creates, stores and returns ``(weights, state)`` from an input signature.

        Args:
          input_signature: a `ShapeDtype` (or array) for ``n_in == 1``, else a tuple of
            ``n_in`` of them. No real batch is needed.
          rng: PRNG key; defaults to the layer's ``rng``. The layer keeps it as its ``rng``.

        Raises:
          LayerError: wrapping any exception raised while initialising (or a ValueError
            when the signature does not hold ``n_in`` items).
        """
        if rng is not None:
            self.rng = rng
        try:
            check_n_items(self, input_signature)
            signature = signature_of(input_signature)
            weights, state = self.init_weights_and_state(signature, self.rng)
        except LayerError:
            raise
        except Exception as e:
            raise LayerError(self.name, "init", self._caller, error_signature(input_signature),
                             e) from e
        self.weights = weights  # The setters mark the layer initialised.
        self.state = state
        return weights, state

    def output_signature(self, input_signature: Any) -> Any:
        """Returns the output `ShapeDtype` signature by abstract evaluation (no FLOPs)."""
        self._check_initialized()
        signature = signature_of(input_signature)
        weights = signature_of(self.weights)
        state = signature_of(self.state)
        y, _ = jax.eval_shape(lambda x, w, s: self.pure_fn(x, w, s, jax.random.key(0)),
                              signature, weights, state)
        return y

    def _check_initialized(self) -> None:
        if not self.initialized:
            raise ValueError(
                f"layer {self.name} (created at {self._caller}) is not initialised; call "
                f"{self.name}.init(input_signature) first")

    def __repr__(self) -> str:
        return self._repr(indent=0)

    def _repr(self, indent: int) -> str:
        head = f"{self.name}_in{self.n_in}_out{self.n_out}"
        if not self._sublayers:
            return head
        inner = "\n".join("  " * (indent + 1) + s._repr(indent + 1) for s in self._sublayers)
        return f"{head}[\n{inner}\n{'  ' * indent}]"



__all__ = ["EMPTY", "Layer", "State", "Weights"]
