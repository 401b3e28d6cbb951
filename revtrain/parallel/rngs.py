"""Per-device and per-layer rngs of a step: Trax's split by device, then by layer.

Device ``d`` of ``n`` gets ``split(rng, n)[d]`` (the rng itself for one device) and layer
``i`` of a block trainer ``split(that, n_layers)[i]``, exactly what ``Serial(*layers)``
gives its sublayers from the device key, so every trainer draws the same keys.
`StepKeys` derives a step's table on the devices (no host round trip); `per_device_rngs`
is the same table computed on the host CPU.

On a mesh with a ``seq`` axis the keys are split over the batch's row slices only: every
device of one ``seq`` group (the devices holding the positions of the same rows) gets the
same key, ``split(rng, data x fsdp)[d * fsdp + f]``, as the sequence-parallel layers
expect (`revtrain.layers.sequence_parallel`): attention dropout hashes a probability's
global position, so it does not depend on the split, and `Dropout` folds in the shard
index, so shards draw independent masks (a position's mask then depends on ``seq``, as
per-device keys make masks depend on the device count).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from revtrain.parallel.placement import Placement


def as_key(rng: Any) -> jax.Array:
    """A typed PRNG key from a key or raw uint32 key data (``jax.random.PRNGKey``).

    Raises:
      TypeError: for anything else (e.g. an int seed), naming ``jax.random.key``.
    """
    if isinstance(rng, jax.Array) and jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.shape:
            raise TypeError(f"rng must be one key; got a key array of shape {rng.shape}")
        return rng
    data = rng if isinstance(rng, jax.Array) else np.asarray(rng)
    if data.dtype != np.uint32 or data.shape != (2,):
        raise TypeError(f"rng={rng!r} is not a PRNG key; pass jax.random.key(seed)")
    return jax.random.wrap_key_data(data if isinstance(data, jax.Array)
                                    else jax.device_put(data))


def _cpu_device() -> jax.Device:
    return jax.local_devices(backend="cpu")[0]


def device_rngs(rng: jax.Array, n_devices: int) -> jax.Array:
    """Keys ``[n_devices]`` for the devices: ``rng[None]`` for one device, else a split."""
    return rng[None] if n_devices == 1 else jax.random.split(rng, n_devices)


def per_device_rngs(rng: jax.Array, n_devices: int, n_layers: int,
                    process_index: int = 0, process_count: int = 1) -> np.ndarray:
    """Splits ``rng`` by device first, then by layer; computed on the host CPU.

    For one device the result row equals ``jax.random.split(rng, n_layers)``; for several,
    row ``d`` is ``split(split(rng, n_devices)[d], n_layers)``. A model run as
    ``Serial(*layers)`` with the device key therefore gives layer ``i`` key ``[d, i]``.
    The split runs on the CPU so it does not fragment accelerator memory. With several
    processes the split is over all ``n_devices * process_count`` devices and this
    process's ``n_devices`` rows are returned.

    Returns:
      uint32 numpy key data ``[n_devices, n_layers, *key_shape]`` (wrap with
      ``jax.random.wrap_key_data`` on use).
    """
    keys = per_device_keys(rng, n_devices, process_index, process_count)
    with jax.default_device(_cpu_device()):
        keys = jax.random.wrap_key_data(jax.device_put(keys, _cpu_device()))
        keys = jax.vmap(lambda k: jax.random.split(k, n_layers))(keys)
        return np.asarray(jax.random.key_data(keys))


def per_device_keys(rng: jax.Array, n_devices: int, process_index: int = 0,
                    process_count: int = 1) -> np.ndarray:
    """uint32 key data ``[n_devices, *key_shape]`` of this process's `device_rngs` rows."""
    with jax.default_device(_cpu_device()):
        rng = jax.device_put(rng, _cpu_device())
        keys = device_rngs(rng, n_devices * process_count)
        start = process_index * n_devices
        return np.asarray(jax.random.key_data(keys))[start:start + n_devices]



def _key_table(rng: jax.Array, n_total: int, n_seq: int, start: int, n_local: int,
               n_layers: int | None) -> jax.Array:
    """Rows ``start..start + n_local`` of the mesh's ``n_total`` device keys: one key per
    row slice of the batch, repeated over its ``n_seq`` devices."""
    keys = jnp.repeat(device_rngs(rng, n_total // n_seq), n_seq, axis=0)[start:start + n_local]
    if n_layers is not None:
        keys = jax.vmap(lambda k: jax.random.split(k, n_layers))(keys)
    return jax.random.key_data(keys)


class StepKeys:
    """A step's key data, derived on the devices from the step's rng.

    Calling it with a key gives uint32 key data ``[devices of the mesh, n_layers,
    *key_shape]`` (``[devices, *key_shape]`` when ``n_layers`` is None), sharded one row
    per device (`Placement.per_device`): the rows `per_device_rngs` computes on the host
    (on a ``seq`` mesh, each row slice's key repeated over its ``seq`` group), without the
    host reading anything. Each process computes only its own rows, on its
    own devices, and the global array is assembled from them (no collective).

    Args:
      placement: the trainer's placement.
      n_layers: keys per device (a block trainer's flat layers), or None for one.
    """

    def __init__(self, placement: Placement, n_layers: int | None):
        self._placement, self._n_layers = placement, n_layers
        local = placement.local_mesh
        single = jax.process_count() == 1  # Then the table is made in its own sharding.
        self._local_replicated = placement.replicated if single else NamedSharding(local, P())
        n_local = local.devices.size
        start = jax.process_index() * n_local
        self._table = jax.jit(
            lambda rng: _key_table(rng, placement.n_global_devices, placement.n_seq, start,
                                   n_local, n_layers),
            out_shardings=placement.per_device if single else placement.local_per_device)

    def signature(self) -> jax.ShapeDtypeStruct:
        """The shape, dtype and sharding of what a call gives (for precompilation)."""
        key_shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape
        layers = () if self._n_layers is None else (self._n_layers,)
        return jax.ShapeDtypeStruct((self._placement.n_global_devices, *layers, *key_shape),
                                    np.uint32, sharding=self._placement.per_device)

    def abstract_call(self) -> tuple[Any, tuple]:
        """``(jitted program, abstract arguments)`` of a call, to compile it ahead."""
        key = jax.eval_shape(lambda: jax.random.key(0))
        return self._table, (jax.ShapeDtypeStruct(key.shape, key.dtype,
                                                  sharding=self._local_replicated),)

    def __call__(self, rng: Any) -> jax.Array:
        """The key data of ``rng`` (a typed key or raw uint32 key data).

        Raises:
          TypeError: as `as_key`.
        """
        rng = jax.device_put(as_key(rng), self._local_replicated)
        table = self._table(rng)
        if jax.process_count() == 1:
            return table
        shape = (self._placement.n_global_devices,) + table.shape[1:]
        return jax.make_array_from_single_device_arrays(
            shape, self._placement.per_device, [s.data for s in table.addressable_shards])


__all__ = ["StepKeys", "as_key", "device_rngs", "per_device_keys", "per_device_rngs"]
