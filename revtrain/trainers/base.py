"""What every trainer shares: optimizer set-up, the learning rate, batches, write-back.

The three trainers differ in where weights live and how gradients are computed; this
module holds the parts that must not differ between them, so they stay equivalent.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from revtrain.layers.base import Layer, _Deferred
from revtrain.trainers import devices
from revtrain.trainers.fbo import has_injectable_learning_rate, learning_rate_of

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
    """Shared machinery; subclasses implement `one_step` and the weight/slot storage.

    Attributes:
      n_devices: number of devices the batch is split over.
      mesh: the one-axis (``batch``) mesh.
      learning_rate: the current injectable learning rate (float), or None when the
        optimizer has none.
      memory_ledger: optional `revtrain.memory.MemoryLedger`; when set, every dispatch of a
        compiled function is recorded with it (used by the benchmarks).
    """

    def __init__(self, layers: Sequence[Layer], optimizer_fn: OptimizerFn,
                 n_devices: int | None):
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
        self.n_devices = devices.resolve_n_devices(n_devices)
        self.mesh = devices.make_mesh(self.n_devices)
        self._optimizer_fn = optimizer_fn
        self.memory_ledger = None
        self._copy_batch = False
        self._host_cache: dict[Any, Any] = {}

    # ----------------------------------------------------------------------------------
    # Learning rate.

    def _init_learning_rate(self, slots: Any) -> None:
        self._injectable = has_injectable_learning_rate(slots)
        self.learning_rate = learning_rate_of(slots)

    def _learning_rate_arg(self, learning_rate: float | None) -> np.ndarray | None:
        """Validates a ``learning_rate`` override and returns the value to pass this step."""
        if learning_rate is None:
            return None if self.learning_rate is None else np.float32(self.learning_rate)
        if isinstance(learning_rate, bool) or not isinstance(learning_rate, numbers.Real):
            raise TypeError(f"learning_rate={learning_rate!r} must be a real number (or None "
                            f"to keep the current rate)")
        if not self._injectable:
            raise ValueError(
                f"learning_rate={learning_rate} was given but the optimizer has no injectable "
                f"learning rate; build it with optax.inject_hyperparams(optax.adam)"
                f"(learning_rate=...)")
        if not np.isfinite(learning_rate):
            raise ValueError(f"learning_rate={learning_rate} is not finite")
        return np.float32(learning_rate)

    # ----------------------------------------------------------------------------------
    # Batches and rngs.

    def _shard_batch(self, batch: Any) -> Any:
        """``[batch, ...]`` leaves -> per-device ``[n_devices, batch // n, ...]`` arrays."""
        if not isinstance(batch, (tuple, list)):
            raise TypeError(f"batch must be a tuple of arrays (inputs, targets, weights); got "
                            f"{type(batch).__name__}")
        if self._copy_batch:
            # Host copies first, so every device buffer of the step is the trainer's own.
            batch = tuple(np.asarray(b) for b in batch)
        reshaped = devices.reshape_by_device(tuple(batch), self.n_devices)
        return devices.shard_per_device(reshaped, self.mesh)

    def _weight_totals(self, batch: Any) -> jax.Array:
        """Per-device totals of the batch weights (``[n_devices]`` float32, on the mesh);
        the loss functions turn them into each device's share of the global loss."""
        totals = devices.weight_totals_by_device(batch, self.n_devices)
        return devices.shard_per_device(totals, self.mesh)

    def _rng_data(self, rng: jax.Array, n_layers: int | None = None) -> np.ndarray:
        """uint32 key data: ``[n_devices, n_layers, 2]`` (split by device, then by layer),
        or ``[n_devices, 2]`` device keys when ``n_layers`` is None."""
        rng = as_key(rng)
        where = (jax.process_index(), jax.process_count())
        if n_layers is None:
            return devices.per_device_keys(rng, self.n_devices, *where)
        return devices.per_device_rngs(rng, self.n_devices, n_layers, *where)

    def _record(self, label: str, fn: Callable | None = None, args: tuple = ()) -> None:
        if self.memory_ledger is not None:
            self.memory_ledger.record(label, fn, args)

    # ----------------------------------------------------------------------------------
    # Writing new values back into the layer objects (lazily).

    def _cached_host(self, key: Any, fetch: Callable[[], Any]) -> Any:
        if key not in self._host_cache:
            self._host_cache[key] = fetch()
        return self._host_cache[key]

    def _write_back(self, layer: Layer, key: Any, weights_fetch: Callable[[], Any],
                    state_fetch: Callable[[], Any]) -> None:
        """Makes ``layer.weights``/``layer.state`` read this trainer's values on first use."""
        layer.weights = _Deferred(lambda: self._cached_host(("w", key), weights_fetch))
        layer.state = _Deferred(lambda: self._cached_host(("s", key), state_fetch))

    def _new_step(self) -> None:
        self._host_cache = {}


def as_key(rng: Any) -> jax.Array:
    """A typed PRNG key from a key or raw uint32 key data (``jax.random.PRNGKey``).

    Raises:
      TypeError: for anything else (e.g. an int seed), naming ``jax.random.key``.
    """
    if isinstance(rng, jax.Array) and jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.shape:
            raise TypeError(f"rng must be one key; got a key array of shape {rng.shape}")
        return rng
    data = np.asarray(rng)
    if data.dtype != np.uint32 or data.shape != (2,):
        raise TypeError(f"rng={rng!r} is not a PRNG key; pass jax.random.key(seed)")
    return jax.random.wrap_key_data(data)


def stats_with_learning_rate(stats: dict[str, Any], learning_rate: Any) -> dict[str, Any]:
    """Adds ``learning_rate`` to ``stats`` when the optimizer has one."""
    if learning_rate is not None:
        stats["learning_rate"] = learning_rate
    return stats
