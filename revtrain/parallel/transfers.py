"""Moving training values between host memory and the devices, and reading them back.

Every put makes buffers the runtime owns (the trainers donate them to their updates), and
every read of a device value into host memory is explicit (``jax.device_get``), so a step
that should not touch the host shows up under ``jax.transfer_guard('disallow')``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from revtrain.parallel.placement import Placement


def _host(a: Any) -> np.ndarray:
    """An explicit device-to-host read of one addressable array."""
    return np.asarray(jax.device_get(a))


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Copies ``tree`` onto every device of ``mesh`` into buffers the runtime owns.

    The copy is a compiled one (one small program per leaf shape and dtype): ``device_put``
    may share memory with its source (a device array's buffer, or on the CPU backend a
    suitably aligned numpy array's), and the trainers donate these buffers to their
    updates. A donated buffer the runtime owns is updated in place; one that shares a
    numpy array's memory cannot be, so the first step would allocate every layer's
    weights and slots anew between its temporaries (on the CPU backend a one-off rise of
    the process's resident memory by the model's size).
    """
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda a: _copy(jax.device_put(a, sharding)), tree)


def _owned_copy(a: jax.Array) -> jax.Array:
    """A new buffer holding ``a``, strongly typed: a weak-typed scalar (optax's
    ``inject_hyperparams`` leaves ``b1``, ``eps``, ... weak for a layer without weights)
    would give the compiled functions another signature than the one traced ahead of the
    first step, and a retrace in each of the first steps."""
    return jnp.copy(jnp.asarray(a, dtype=a.dtype))


_copy = jax.jit(_owned_copy)


def put_sharded(tree: Any, shardings: Any, owned: bool = True) -> Any:
    """Copies host (or device) ``tree`` onto the devices with one sharding per leaf.

    Every process passes the whole (global) value; each device receives only its own
    slice (``jax.make_array_from_callback``), so with ``fsdp`` shardings no device ever
    holds a full copy. A ``jax.Array`` in another sharding (e.g. restored from a checkpoint
    saved with another device count or ``fsdp`` setting) is resharded on the devices
    (``jax.device_put``), never through one host. Always new buffers the runtime owns,
    never an alias of the input (the compiled copy of `replicate`: ``device_put`` may hand
    back the input's buffer for a shard already in place, and trainers donate these).

    With ``owned=False`` a host leaf is put without that extra device copy: on the CPU
    backend its shards may then share the host array's memory. For a caller that owns the
    host arrays and does not write them while the device arrays live
    (`revtrain.trainers.block.host_store.HostStore`, whose programs donate and so only free them).
    """
    def put(a, sharding):
        if isinstance(a, jax.Array):
            return _copy(a if a.sharding == sharding else jax.device_put(a, sharding))
        host = np.asarray(a)
        # This put is explicit; the guard counts the callback's slices as implicit ones.
        with jax.transfer_guard_host_to_device("allow"):
            array = jax.make_array_from_callback(host.shape, sharding,
                                                 lambda index: host[index])
        return _copy(array) if owned else array
    return jax.tree.map(put, tree, shardings)


def unreplicate(tree: Any) -> Any:
    """Host (numpy) copy of a replicated tree, read from this process's first copy."""
    return jax.tree.map(lambda a: _host(a.addressable_shards[0].data)
                        if isinstance(a, jax.Array) else np.asarray(a), tree)


def shard_per_device(tree: Any, placement: Placement) -> Any:
    """Puts this process's ``[n_devices, ...]`` leaves on the placement's mesh, one row per
    device (`Placement.per_device`: in the mesh's row-major order).

    With several processes the result is a global array of ``n_devices * process_count``
    rows (``jax.make_array_from_process_local_data``).
    """
    sharding = placement.per_device
    if jax.process_count() == 1:  # One call for the whole tree: its puts are batched.
        return jax.device_put(tree, sharding)
    with jax.transfer_guard_host_to_device("allow"):  # Explicit, as device_put above.
        return jax.tree.map(
            lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), tree)


def local_rows(tree: Any) -> Any:
    """Host copy of this process's rows ``[n_devices, ...]`` of per-device values.

    The fully addressable leaves are read in one ``jax.device_get`` (their copies start
    together, and the host pays one call, not one per leaf)."""
    leaves, treedef = jax.tree.flatten(tree)
    whole = [k for k, a in enumerate(leaves)
             if isinstance(a, jax.Array) and a.is_fully_addressable]
    out = [np.asarray(a) if not isinstance(a, jax.Array) else None for a in leaves]
    for k, value in zip(whole, jax.device_get([leaves[k] for k in whole]), strict=True):
        out[k] = np.asarray(value)
    for k, a in enumerate(leaves):
        if out[k] is None:  # Spans other processes: this process's shards, in row order.
            shards = sorted(a.addressable_shards, key=lambda s: s.index[0].start or 0)
            out[k] = np.concatenate([_host(s.data) for s in shards])
    return treedef.unflatten(out)


def on_cpu(tree: Any) -> Any:
    """Host memory (numpy) copies of the leaves of ``tree``."""
    return jax.tree.map(np.asarray, jax.device_get(tree))


def on_accelerator(tree: Any, device: jax.Device | int | None = None) -> Any:
    """Puts ``tree`` on one device (an index into ``jax.local_devices()`` or a Device).

    Raises:
      ValueError: when the index names a device this process does not have.
    """
    devices = jax.local_devices()
    if device is None:
        device = devices[0]
    elif isinstance(device, int):
        if not 0 <= device < len(devices):
            raise ValueError(f"device index {device} does not exist: this process has "
                             f"{len(devices)} devices (0..{len(devices) - 1})")
        device = devices[device]
    return jax.device_put(tree, device)


def first_device_slice(tree: Any) -> Any:
    """Host copy of device 0's entry of per-device values (Trax's ``unreplicate``)."""
    return jax.tree.map(lambda a: _host(a.addressable_shards[0].data)[0]
                        if isinstance(a, jax.Array) else np.asarray(a)[0], tree)


def host_value(a: Any) -> np.ndarray:
    """The whole (global) value of one leaf in host memory.

    A replicated ``jax.Array`` is read from this process's first copy; a sharded one is
    assembled from its shards: this process's own when they cover the whole value on
    every process (`covered_by_every_process`: e.g. weights sharded over ``fsdp`` inside
    each process and replicated over ``data`` across processes), else all-gathered over
    processes (a collective every process reaches, as each takes the same branch).
    """
    if not isinstance(a, jax.Array):
        return np.asarray(a)
    if a.sharding.is_fully_replicated:
        return _host(a.addressable_shards[0].data)
    if a.is_fully_addressable:
        return _host(a)
    if covered_by_every_process(a.sharding, a.shape):
        out = np.empty(a.shape, a.dtype)
        for shard in a.addressable_shards:
            out[shard.index] = _host(shard.data)
        return out
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def host_values(tree: Any) -> Any:
    """Every leaf of ``tree`` as a host numpy array (`host_value`, leaf by leaf)."""
    return jax.tree.map(host_value, tree)


@functools.lru_cache(maxsize=256)
def covered_by_every_process(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> bool:
    """Whether each process's devices hold every element of an array of ``shape`` laid
    out by ``sharding`` (the same answer on every process: it reads the global layout)."""
    size = int(np.prod(shape, dtype=np.int64))
    cover: dict[int, dict[tuple, int]] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        key = tuple(s.indices(n) for s, n in zip(index, shape, strict=True))
        cover.setdefault(device.process_index, {})[key] = int(np.prod(
            [len(range(*k)) for k in key], dtype=np.int64))
    return all(sum(blocks.values()) == size for blocks in cover.values())


def block_until_ready_live(tree: Any) -> None:
    """Waits for the live jax arrays of ``tree`` (deleted ones, e.g. donated by a failed
    step, have nothing to wait for)."""
    jax.block_until_ready([leaf for leaf in jax.tree.leaves(tree)
                           if isinstance(leaf, jax.Array) and not leaf.is_deleted()])


def device_bytes(tree: Any, device: jax.Device) -> int:
    """Bytes of ``tree``'s live jax-array shards on ``device``."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total


def abstract_device_bytes(tree: Any) -> int:
    """Bytes one device holds of the `jax.ShapeDtypeStruct` leaves of ``tree``: each leaf's
    shard (``sharding.shard_shape``; the whole leaf without a sharding) times its item
    size: the abstract twin of `device_bytes`, for values that do not exist yet."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = tuple(sharding.shard_shape(shape))
        try:
            itemsize = np.dtype(leaf.dtype).itemsize
        except TypeError:  # An extended dtype (a typed PRNG key): its key data's size.
            itemsize = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).size * 4
        total += int(np.prod(shape, dtype=np.int64)) * itemsize
    return total


def delete_arrays(tree: Any) -> None:
    """Frees the device buffers of the jax arrays in ``tree`` (trainer-owned ones only)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def delete_quietly(tree: Any) -> None:
    """Deletes device buffers that may hold the error of a failed computation."""
    for leaf in jax.tree.leaves(tree):
        try:
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
        except Exception:  # noqa: BLE001 -- a failed buffer is gone either way.
            pass


def put_batched(tree: Any, shardings: Any) -> Any:
    """``tree``'s host leaves on the devices, one sharding per leaf, in as few calls as
    the layouts allow; the device arrays may share the host arrays' memory (no owned
    copy: for a caller that keeps the host arrays unwritten while they live).

    The leaves whose sharding this process addresses whole go in one ``jax.device_put``
    (the runtime batches them: about half the per-leaf cost of one call each, which for a
    layer's weights and optimizer slots -- dozens of small leaves -- is most of what a put
    costs the host); a leaf spanning other processes is made from this process's slices
    (`put_sharded`), with no cross-process check of the value.
    """
    leaves, treedef = jax.tree.flatten(tree)
    per_leaf = treedef.flatten_up_to(shardings)
    local = [k for k, s in enumerate(per_leaf) if s.is_fully_addressable]
    out = list(leaves)
    if local:
        put = jax.device_put([leaves[k] for k in local], [per_leaf[k] for k in local])
        for k, array in zip(local, put, strict=True):
            out[k] = array
    for k in sorted(set(range(len(leaves))) - set(local)):
        out[k] = put_sharded(leaves[k], per_leaf[k], owned=False)
    return treedef.unflatten(out)


def put_values(tree: Any, shardings: Any) -> Any:
    """New device buffers holding ``tree`` with one ``NamedSharding`` per leaf.

    ``tree``'s leaves are host arrays or ``jax.Array`` s in any sharding; only each
    device's slice is transferred (`put_sharded`), and an array that spans other processes
    is resharded on the devices.
    """
    def put(a, sharding):
        if (isinstance(a, jax.Array) and not a.is_fully_addressable
                and a.sharding != sharding):
            return jax.device_put(a, sharding)
        return put_sharded(a, sharding)
    return jax.tree.map(put, tree, shardings)


__all__ = ["abstract_device_bytes", "block_until_ready_live", "delete_arrays",
           "delete_quietly", "device_bytes", "first_device_slice", "host_value", "local_rows",
           "on_accelerator", "on_cpu",
           "put_batched", "put_sharded", "put_values", "replicate", "shard_per_device",
           "unreplicate"]
