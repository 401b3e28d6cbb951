"""What every trainer shares: optimizer set-up, the learning rate, batches, observers, and
the ownership of the training values (`TrainState`).

The three trainers differ in where weights live and how gradients are computed; this
module holds the parts that must not differ between them, so they stay equivalent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from revtrain.layers.base import Layer
from revtrain.parallel import transfers
from revtrain.parallel.inflight import InflightLimit
from revtrain.parallel.placement import Placement
from revtrain.trainers.common.dispatch import LiveDispatcher
from revtrain.trainers.common.learning_rate import (
    PlacedRate,
    check_learning_rate,
    has_injectable_learning_rate,
    learning_rate_of,
)
from revtrain.trainers.common.protocols import DeviceFootprint, Observer, TrainState
from revtrain.trainers.common.structure import check_same_structure, lists_as_tuples

OptimizerFn = Callable[[], optax.GradientTransformation]


def _check_each_layer_once(layers: Sequence[Layer]) -> None:
    """Raises ValueError when a layer object with weights appears twice in ``layers``."""
    seen: dict[int, Layer] = {}
    for layer in layers:
        if id(layer) in seen and jax.tree.leaves(layer.weights):
            raise ValueError(f"layer {layer.name} (created at {layer.caller}) is used more "
                             f"than once; each use would train its own copy of its weights, "
                             f"so build one layer object per use")
        seen[id(layer)] = layer


class TrainerBase:
    """Shared machinery; subclasses implement `one_step` and where the values live.

    A trainer owns its values: `train_state` gives host copies, `restore` replaces them
    (after structure checks), and layer objects change only through `sync_to`.

    Attributes:
      placement: the mesh and the layout of the values (`revtrain.parallel.placement`).
      learning_rate: the current injectable learning rate (float), or None when the
        optimizer has none.
      observers: `revtrain.trainers.common.protocols.Observer` objects told of every dispatch of
        a compiled function and of each phase of a step (e.g. `revtrain.memory`'s ledger).
    """

    def __init__(self, layers: Sequence[Layer], optimizer_fn: OptimizerFn,
                 n_devices: int | None, mesh: Mesh | None = None, fsdp: bool = False,
                 placement: Placement | None = None):
        _check_each_layer_once(layers)
        for layer in layers:
            if not layer.initialized:
                raise ValueError(
                    f"layer {layer.name} (created at {layer.caller}) is not initialised; call "
                    f"init(input_signature) (or init_reversible_blocks) before building a "
                    f"trainer")
        if not callable(optimizer_fn):
            raise TypeError(f"optimizer_fn must be a function returning an optax "
                            f"GradientTransformation; got {optimizer_fn!r}")
        self.placement = resolve_placement(n_devices, mesh, fsdp, placement)
        self._inflight = InflightLimit(self.placement)  # Avoids a CPU-client hang; see inflight.
        self._optimizer_fn = optimizer_fn
        self.observers: list[Observer] = []
        self._dispatcher = LiveDispatcher(lambda: self.observers, self._inflight)
        self._copy_batch = False
        self._placed_learning_rate = PlacedRate(self.placement)
        # Built on shapes only (`is_abstract`): it plans (`walk_abstract`), never runs.
        self.abstract = is_abstract([layer.weights for layer in layers])

    @property
    def mesh(self) -> Mesh:
        """The mesh (``placement.mesh``)."""
        return self.placement.mesh

    @property
    def n_devices(self) -> int:
        """This process's devices the batch is split over (``placement.n_devices``)."""
        return self.placement.n_devices

    @property
    def fsdp(self) -> bool:
        """Whether weights and slots are sharded over the mesh (``placement.fsdp``)."""
        return self.placement.fsdp

    # ----------------------------------------------------------------------------------
    # The training values.

    @property
    def train_state(self) -> TrainState:
        """Host (numpy) copies of the weights, state and optimizer slots."""
        return TrainState(*(self.host_values(part) for part in TrainState._fields))

    def host_values(self, part: str) -> Any:
        """Host copy of one part of `train_state` (``'weights'``, ``'state'`` or
        ``'slots'``) without copying the others (evaluation needs no optimizer slots)."""
        raise NotImplementedError

    def saved_values(self, part: str) -> Any:
        """One part of `train_state` as it lives, for a sharded checkpoint (no host copy).

        Global ``jax.Array`` s in their own sharding (every process then writes only its
        own shards), or host arrays where the values live in host memory. This default,
        for trainers that keep no sharded values, is `host_values`.

        The arrays are the trainer's own, valid until the next step, which donates them:
        save them (or copy them) before stepping again; `restore` refuses deleted ones.
        """
        return self.host_values(part)

    def value_shardings(self, part: str) -> Any:
        """Per leaf of ``part``, the ``NamedSharding`` to restore a checkpoint into.

        The tree of `train_state`'s ``part`` with a ``jax.sharding.NamedSharding`` (or None
        for a value restored to host memory) at each leaf. A checkpoint read with these
        shardings goes straight to the devices, each reading only its own slices, whatever
        device count or ``fsdp`` setting it was saved with. This default: all None.
        """
        return jax.tree.map(lambda _: None, getattr(self._signature, part))

    def value_signature(self, part: str) -> Any:
        """The ``jax.ShapeDtypeStruct`` of every leaf of `train_state`'s ``part``.

        Shapes and dtypes only (no value is read, nothing moves): with `value_shardings`
        this is a checkpoint's restore template.

        Raises:
          ValueError: for a ``part`` that is not a `TrainState` field.
        """
        if part not in TrainState._fields:
            raise ValueError(f"part={part!r} is not one of {TrainState._fields}")
        return getattr(self._signature, part)

    def restore(self, train_state: TrainState) -> None:
        """Replaces the trainer's values by ``train_state``.

        Leaves may be host arrays or ``jax.Array`` s in any sharding (e.g. restored from a
        checkpoint with `value_shardings`); they are resharded as the trainer stores them,
        and never aliased (the trainer donates its buffers).

        Raises:
          ValueError: naming the first path whose structure, shape or dtype differs from
            the trainer's own (nothing is changed then).
        """
        raise NotImplementedError

    def device_footprint(self) -> DeviceFootprint:
        """Bytes of weights and slots resident on the mesh's first device now."""
        raise NotImplementedError

    def block_until_ready(self) -> None:
        """Waits until the updates of every step run so far have landed.

        `one_step` returns as soon as its work is dispatched (JAX's asynchronous dispatch);
        this waits for the trainer's values -- weights, state, optimizer slots and, for a
        trainer that keeps them in host memory, their transfers back -- as
        ``jax.block_until_ready`` does for arrays. It copies nothing to the host that lives
        on the devices, so it is cheap enough for timing every step (unlike reading
        `train_state`). Waiting for the returned loss and stats alone does not cover the
        last layers' optimizer updates.
        """
        raise NotImplementedError

    @property
    def weights(self) -> Any:
        """Host copy of the weights (``train_state.weights``)."""
        return self.host_values("weights")

    @property
    def state(self) -> Any:
        """Host copy of device 0's layer state (``train_state.state``)."""
        return self.host_values("state")

    @property
    def slots(self) -> Any:
        """Host copy of the optimizer slots (``train_state.slots``)."""
        return self.host_values("slots")

    def _checked(self, train_state: Any) -> TrainState:
        """``train_state`` as a `TrainState` after checking it against the current one."""
        if not isinstance(train_state, tuple) or len(train_state) != 3:
            raise TypeError(f"restore takes a TrainState(weights, state, slots); got "
                            f"{type(train_state).__name__}")
        train_state = TrainState(*(lists_as_tuples(t) for t in train_state))
        for name in TrainState._fields:
            check_same_structure(getattr(train_state, name),
                                         getattr(self._signature, name), name)
            _check_not_deleted(getattr(train_state, name), name)
        return train_state

    def _remember_signature(self, train_state: TrainState) -> None:
        """Keeps the shapes and dtypes `restore` checks against: they never change, and
        reading them must not need the device values (which a failed step may poison)."""
        self._signature = TrainState(*(jax.tree.map(_shape_dtype, lists_as_tuples(t))
                                       for t in train_state))

    def sync_to(self, layers: Layer | Sequence[Layer] | None = None) -> None:
        """Writes the trainer's current weights and state into layer objects.

        Layer objects are never changed behind the caller's back (as flax NNX's
        ``update``): call this to see the trained values in ``layer.weights``.

        Args:
          layers: the layers whose values ``train_state`` holds, in its order: a block
            trainer's flat layers, or `Trainer`'s ``model_with_loss`` (the default: the
            layers the trainer was built from).

        Raises:
          ValueError: when the layers do not match the trainer's values.
        """
        layers = self._own_layers() if layers is None else layers
        layers = [layers] if isinstance(layers, Layer) else list(layers)
        values = self.train_state
        weights, state = self._per_layer(values.weights), self._per_layer(values.state)
        if len(layers) != len(weights):
            raise ValueError(f"sync_to got {len(layers)} layers for {len(weights)} entries "
                             f"of the trainer's values; pass the layers the trainer was "
                             f"built from, in order")
        for layer, w, s in zip(layers, weights, state, strict=True):
            check_same_structure(w, layer.weights, f"weights of {layer.name}")
            check_same_structure(s, layer.state, f"state of {layer.name}")
        for layer, w, s in zip(layers, weights, state, strict=True):
            layer.weights, layer.state = w, s

    def _own_layers(self) -> list[Layer]:
        raise NotImplementedError

    def _per_layer(self, tree: Any) -> list[Any]:
        """``tree`` as one entry per layer of `_own_layers`."""
        raise NotImplementedError

    def trace_counts(self) -> dict[str, int]:
        """``{function: times traced}`` of every compiled function (equinox's counter);
        after the first step these stay fixed unless something recompiles."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------------
    # Learning rate.

    def _init_learning_rate(self, slots: Any) -> None:
        self._injectable = has_injectable_learning_rate(slots)
        self.learning_rate = learning_rate_of(slots)

    def _learning_rate_arg(self, learning_rate: float | None) -> np.ndarray | None:
        """The checked float32 rate of this step (`check_learning_rate`)."""
        return check_learning_rate(learning_rate, self.learning_rate, self._injectable)

    # ----------------------------------------------------------------------------------
    # Batches.

    def _shard_batch(self, batch: Any) -> Any:
        """``[batch, ...]`` leaves -> per-device arrays (`Placement.split_batch`)."""
        check_not_abstract(self.abstract, "run a step")
        if not isinstance(batch, (tuple, list)):
            raise TypeError(f"batch must be a tuple of arrays (inputs, targets, weights); got "
                            f"{type(batch).__name__}")
        if self._copy_batch:
            # Host copies first, so every device buffer of the step is the trainer's own.
            batch = tuple(transfers.on_cpu(b) for b in batch)
        split = self.placement.split_batch(tuple(batch))
        return transfers.shard_per_device(split, self.placement)

    def _abstract_inputs(self, batch_signature: Sequence[Any], learning_rate: float | None,
                         keys: Any, device: Any = None) -> tuple[tuple, Any, Any]:
        """The abstract per-device batch (`abstract_batch`), step keys and learning-rate
        argument a step given ``batch_signature`` and ``learning_rate`` would dispatch
        with; ``device.track`` (the planner's) accounts for them as device values."""
        rate = learning_rate if learning_rate is not None else (
            1.0 if self._injectable else None)  # Only whether a rate is passed matters.
        inputs = (abstract_batch(batch_signature, self.placement), keys,
                  self._placed_learning_rate.abstract(self._learning_rate_arg(rate)))
        return inputs if device is None else device.track(inputs)


def abstract_batch(batch_signature: Sequence[Any], placement: Placement) -> tuple:
    """The abstract per-device batch (`Placement.per_device_shape` of each item:
    ``[devices of the mesh, batch // (n_devices // seq), length // seq, ...]``, ``batch``
    this process's).

    Raises:
      ValueError: when the batch does not split over the mesh (`Placement.split_batch`).
    """
    return tuple(jax.ShapeDtypeStruct(placement.per_device_shape(np.shape(item)),
                                      np.dtype(item.dtype), sharding=placement.per_device)
                 for item in batch_signature)


def is_abstract(tree: Any) -> bool:
    """True when a leaf of ``tree`` is a `jax.ShapeDtypeStruct`: a model initialised with
    ``jax.eval_shape`` (`revtrain.training.build_model`'s ``abstract``; its loss layer may
    hold small real values), from which a trainer is built for planning only
    (`revtrain.planning`)."""
    return any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(tree))


def check_not_abstract(abstract: bool, what: str) -> None:
    """Raises ValueError when a trainer built on abstract values is asked for ``what``.

    Raises:
      ValueError: naming ``what`` and the fix (build the model with values).
    """
    if abstract:
        raise ValueError(f"this trainer was built on abstract values (shapes only, for "
                         f"planning) and cannot {what}; build it from an initialised model")


def _shape_dtype(a: Any) -> jax.ShapeDtypeStruct:
    dtype = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
    return jax.ShapeDtypeStruct(np.shape(a), dtype)


def resolve_placement(n_devices: int | None, mesh: Mesh | None, fsdp: bool,
                      placement: Placement | None) -> Placement:
    """A trainer's `Placement`: ``placement`` itself, or the one its ``n_devices``,
    ``mesh`` and ``fsdp`` arguments describe.

    Raises:
      ValueError: when ``placement`` is given with any of the other three.
      TypeError, ValueError: as `Placement.resolve`.
    """
    if placement is None:
        return Placement.resolve(n_devices, mesh, fsdp)
    if n_devices is not None or mesh is not None or fsdp:
        raise ValueError("placement= was given with n_devices=, mesh= or fsdp=; pass either "
                         "a Placement or those arguments")
    if not isinstance(placement, Placement):
        raise TypeError(f"placement={placement!r} is not a revtrain Placement; build one "
                        f"with Placement.resolve(n_devices, mesh, fsdp)")
    return placement


def _check_not_deleted(tree: Any, what: str) -> None:
    """Raises ValueError naming the first deleted ``jax.Array`` of ``tree``: `saved_values`
    hands out the live arrays, which the next step donates, and restoring one would fail
    half-way (a crash of the CPU runtime with several devices)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ValueError(f"restore: {what}{jax.tree_util.keystr(path)} is a deleted "
                             f"jax.Array (a later step donated it); restore from host_values "
                             f"or a checkpoint, or from saved_values taken after the last step")

