"""Device helpers shared by every trainer: meshes, device reshape, per-device rngs, moves.

All trainers run data-parallel over a one-axis mesh whose axis is named ``batch``
(`BATCH_AXIS`). A per-device value has a leading axis over that mesh axis (the layout
``jax.pmap`` used, which keeps Trax's per-device rng semantics); weights and optimizer
slots are replicated.

Multi-host: ``n_devices`` counts *this process's* devices. The mesh spans the first
``n_devices`` devices of every process (``jax.process_count()`` of them under
``jax.distributed``), so gradients are combined over all processes. Each process gives its
own per-device values (its slice of the global batch, ``[n_devices, ...]``), and reads back
its own; replicated values are read from a local copy.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

BATCH_AXIS = "batch"


def resolve_n_devices(n_devices: int | None) -> int:
    """Returns ``n_devices`` or, when None, the number of local devices.

    Raises:
      ValueError: when ``n_devices`` is < 1 or more than the local devices.
    """
    available = jax.local_device_count()
    if n_devices is None:
        return available
    if isinstance(n_devices, bool) or not isinstance(n_devices, (int, np.integer)):
        raise TypeError(f"n_devices={n_devices!r} must be an int; use 1 <= n_devices <= "
                        f"{available} or None for all devices")
    if not 1 <= n_devices <= available:
        raise ValueError(f"n_devices={n_devices} but this process has {available} devices; "
                         f"use 1 <= n_devices <= {available}")
    return int(n_devices)


def make_mesh(n_devices: int) -> Mesh:
    """A one-axis mesh named ``batch`` over the first ``n_devices`` devices of each process.

    With one process these are the first ``n_devices`` local devices; under
    ``jax.distributed`` the mesh has ``n_devices * jax.process_count()`` devices, ordered by
    process.
    """
    n_devices = resolve_n_devices(n_devices)
    by_process: dict[int, list] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    devices = [d for p in sorted(by_process) for d in by_process[p][:n_devices]]
    return Mesh(np.array(devices), (BATCH_AXIS,))


def resolve_mesh(n_devices: int | None, mesh: Mesh | None) -> tuple[Mesh, int]:
    """The trainer's ``batch`` mesh and its devices per process, from either argument.

    ``mesh`` is a user's one-axis `jax.sharding.Mesh` (any axis name, e.g. ``'data'``;
    under ``jax.distributed`` it may span processes): its devices, in its order, become the
    trainer's ``batch`` axis. Without it, `make_mesh(n_devices)`.

    Raises:
      ValueError: for a mesh with more than one axis of size > 1; one that holds no device
        of this process, a different number of devices of each process, or a process's
        devices not consecutive; or an ``n_devices`` that contradicts ``mesh``.
      TypeError: when ``mesh`` is not a ``jax.sharding.Mesh``.
    """
    if mesh is None:
        n_devices = resolve_n_devices(n_devices)
        return make_mesh(n_devices), n_devices
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh={mesh!r} is not a jax.sharding.Mesh; pass a one-axis Mesh or "
                        f"use n_devices")
    big_axes = [(name, size) for name, size in mesh.shape.items() if size > 1]
    if len(big_axes) > 1:
        raise ValueError(f"mesh has axes {dict(mesh.shape)}; revtrain splits the batch (and, "
                         f"with fsdp=True, the weights) over one axis: pass a one-axis mesh")
    flat = list(mesh.devices.flat)
    counts: dict[int, int] = {}
    for device in flat:
        counts[device.process_index] = counts.get(device.process_index, 0) + 1
    local = counts.get(jax.process_index(), 0)
    if local == 0 or len(set(counts.values())) != 1:
        raise ValueError(f"mesh holds {counts} devices per process index; it must hold the "
                         f"same number (> 0) of devices of every process")
    order = [d.process_index for d in flat]
    if sum(a != b for a, b in zip(order, order[1:], strict=False)) != len(counts) - 1:
        raise ValueError(f"mesh devices belong to processes {order} in that order; each "
                         f"process's devices must be consecutive along the mesh axis (each "
                         f"process feeds one contiguous slice of the global batch)")
    if n_devices is not None and n_devices != local:
        raise ValueError(f"n_devices={n_devices} but mesh holds {local} devices of this "
                         f"process; pass only one of them")
    return Mesh(np.array(flat), (BATCH_AXIS,)), local


FSDP_MIN_SIZE = 1024
"""Leaves with fewer elements than this stay replicated under ``fsdp=True``: biases, norms
and optimizer counters are too small for sharding to save memory worth a collective."""


def fsdp_spec(shape: tuple[int, ...], n_shards: int,
              min_size: int = FSDP_MIN_SIZE) -> P:
    """The FSDP partition of one leaf over the ``batch`` axis (ZeRO-3 / FSDP layout).

    The leaf is split along its largest dimension that ``n_shards`` divides (the first
    such dimension on a tie); it stays replicated (``P()``) when it has fewer than
    ``min_size`` elements, when no dimension is divisible by ``n_shards``, or when
    ``n_shards == 1``. This is the rule of MaxText/flax FSDP meshes: split weights along
    the data axis, keep what cannot be split whole.

    Args:
      shape: the leaf's full (global) shape.
      n_shards: size of the ``batch`` axis (devices of all processes).
      min_size: smallest number of elements that is sharded.

    Returns:
      A ``PartitionSpec`` naming `BATCH_AXIS` on at most one dimension.
    """
    size = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if n_shards == 1 or size < min_size:
        return P()
    divisible = [d for d, n in enumerate(shape) if n % n_shards == 0]
    if not divisible:
        return P()
    dim = max(divisible, key=lambda d: (shape[d], -d))
    return P(*([None] * dim), BATCH_AXIS)


def value_shardings(tree: Any, mesh: Mesh, fsdp: bool) -> Any:
    """``NamedSharding`` per leaf of ``tree`` (arrays or ShapeDtypeStructs): `fsdp_spec`
    when ``fsdp`` is True, replicated otherwise."""
    n_shards = mesh.devices.size
    return jax.tree.map(
        lambda a: NamedSharding(mesh, fsdp_spec(tuple(np.shape(a)), n_shards) if fsdp
                                else P()), tree)


def first_local_device(mesh: Mesh) -> jax.Device:
    """This process's first device of ``mesh`` (the device footprints and memory logs
    describe: under ``jax.distributed`` the mesh's very first device belongs to process 0
    and cannot be inspected from another process)."""
    return next(d for d in mesh.devices.flat if d.process_index == jax.process_index())


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of a value held whole on every device of ``mesh``."""
    return NamedSharding(mesh, P())


def per_device(mesh: Mesh) -> NamedSharding:
    """The sharding of a value whose leading axis is the device axis."""
    return NamedSharding(mesh, P(BATCH_AXIS))


def reshape_by_device(x: Any, n_devices: int) -> Any:
    """Reshapes each leaf ``[batch, ...]`` to ``[n_devices, batch // n_devices, ...]``.

    Args:
      x: a pytree of arrays (numpy or jax) with a leading batch axis.
      n_devices: number of devices.

    Raises:
      ValueError: when the batch is empty, when leaves disagree on the batch size, or when
        it is not divisible by ``n_devices`` (names both numbers).
    """
    leaves = [a if hasattr(a, "reshape") else np.asarray(a) for a in jax.tree.leaves(x)]
    sizes = sorted({a.shape[0] if a.ndim else None for a in leaves}, key=str)
    if len(sizes) > 1:
        raise ValueError(f"batch items have different batch sizes {sizes}; give every item "
                         f"(inputs, targets, weights) the same leading batch axis")
    batch = sizes[0] if sizes else None
    if batch is None or batch == 0 or batch % n_devices:
        raise ValueError(f"batch size {batch} is not divisible by n_devices={n_devices}; "
                         f"use a non-empty global batch that is a multiple of {n_devices}")

    def reshape(a):
        a = a if hasattr(a, "reshape") else np.asarray(a)
        return a.reshape((n_devices, batch // n_devices) + tuple(a.shape[1:]))
    return jax.tree.map(reshape, x)


def weight_totals_by_device(batch: Any, n_devices: int) -> np.ndarray:
    """The total of each device's batch weights: float32 ``[n_devices]``, on the host.

    A batch ``(inputs, targets, weights, ...)`` carries per-position loss weights (a 0/1
    padding mask, Trax's convention) as its third item; device ``d`` gets rows
    ``[d * batch // n_devices, (d + 1) * batch // n_devices)`` and its total is the sum of
    those rows' weights. A batch of fewer than three items has no weights: each device's
    total is its row count. The trainers weight each device's loss by its total over the
    global sum (`revtrain.trainers.fbo.loss_share`), so the loss is the weighted mean over
    the global batch however it is split: ``sum(w * loss) / sum(w)``, the same number as
    on one device. A weights item broadcast to the targets' shape counts each weight the
    same number of times on every device, so its ratio of totals is unchanged.

    Args:
      batch: a tuple of arrays with a leading batch axis divisible by ``n_devices``.
      n_devices: number of devices (this process's, under ``jax.distributed``).

    Raises:
      ValueError: as `reshape_by_device`, for a batch that does not split.
    """
    items = tuple(batch)
    if len(items) < 3:
        rows = np.shape(jax.tree.leaves(reshape_by_device(items, n_devices))[0])[1]
        return np.full((n_devices,), rows, np.float32)
    weights = reshape_by_device(np.asarray(items[2]), n_devices)
    return weights.reshape(n_devices, -1).sum(axis=1, dtype=np.float64).astype(np.float32)


def for_n_devices(x: Any, n_devices: int) -> Any:
    """Broadcasts each leaf to a leading device axis: ``[...] -> [n_devices, ...]``."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n_devices,) + np.shape(a)), x)


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
    sharding = replicated(mesh)
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
    (`revtrain.trainers.stores.HostStore`, whose programs donate and so only free them).
    """
    def put(a, sharding):
        if isinstance(a, jax.Array):
            return _copy(a if a.sharding == sharding else jax.device_put(a, sharding))
        host = np.asarray(a)
        array = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
        return _copy(array) if owned else array
    return jax.tree.map(put, tree, shardings)


def unreplicate(tree: Any) -> Any:
    """Host (numpy) copy of a replicated tree, read from this process's first copy."""
    return jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data)
                        if isinstance(a, jax.Array) else np.asarray(a), tree)


def shard_per_device(tree: Any, mesh: Mesh) -> Any:
    """Puts this process's ``[n_devices, ...]`` leaves on ``mesh``, one row per device.

    With several processes the result is a global array of ``n_devices * process_count``
    rows (``jax.make_array_from_process_local_data``).
    """
    sharding = per_device(mesh)
    if jax.process_count() == 1:
        return jax.tree.map(lambda a: jax.device_put(a, sharding), tree)
    return jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), tree)


def local_rows(tree: Any) -> Any:
    """Host copy of this process's rows ``[n_devices, ...]`` of per-device values."""
    def rows(a):
        if not isinstance(a, jax.Array) or a.is_fully_addressable:
            return np.asarray(a)
        shards = sorted(a.addressable_shards, key=lambda s: s.index[0].start or 0)
        return np.concatenate([np.asarray(s.data) for s in shards])
    return jax.tree.map(rows, tree)


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
    return jax.tree.map(lambda a: jax.device_put(a, device), tree)


def first_device_slice(tree: Any) -> Any:
    """Host copy of device 0's entry of per-device values (Trax's ``unreplicate``)."""
    return jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data)[0]
                        if isinstance(a, jax.Array) else np.asarray(a)[0], tree)


def check_same_structure(new: Any, old: Any, what: str) -> None:
    """Raises ValueError naming the first path where ``new`` differs from ``old``.

    Compares the tree structures (empty subtrees included; a list stands for a tuple),
    then each leaf's shape and dtype.
    """
    new, old = _lists_as_tuples(new), _lists_as_tuples(old)
    new_leaves, new_def = jax.tree_util.tree_flatten_with_path(new)
    old_leaves, old_def = jax.tree_util.tree_flatten_with_path(old)
    new_paths = [jax.tree_util.keystr(p) for p, _ in new_leaves]
    old_paths = [jax.tree_util.keystr(p) for p, _ in old_leaves]
    for i, old_path in enumerate(old_paths):
        if i >= len(new_paths) or new_paths[i] != old_path:
            got = f"{what}{new_paths[i]}" if i < len(new_paths) else "nothing"
            raise ValueError(f"{what} structure mismatch at {what}{old_path}: expected that "
                             f"path, got {got}{_kind_hint(what)}")
    if len(new_paths) > len(old_paths):
        raise ValueError(f"{what} structure mismatch at {what}{new_paths[len(old_paths)]}: "
                         f"unexpected extra leaf")
    if new_def != old_def:
        raise ValueError(f"{what} structure mismatch: expected {old_def}, got {new_def}")
    for (path, a), (_, b) in zip(new_leaves, old_leaves, strict=True):
        if np.shape(a) != np.shape(b) or np.dtype(_dtype(a)) != np.dtype(_dtype(b)):
            raise ValueError(
                f"{what}{jax.tree_util.keystr(path)} has shape {np.shape(a)} dtype "
                f"{np.dtype(_dtype(a))}; expected {np.shape(b)} {np.dtype(_dtype(b))}")


def _kind_hint(what: str) -> str:
    """Why optimizer slots most often mismatch: values of the other kind of trainer."""
    if what != "slots":
        return ""
    return ("; values from another kind of trainer? `Trainer` keeps one optimizer state "
            "for the whole model, the block trainers one per flat layer")


def lists_as_tuples(tree: Any) -> Any:
    """``tree`` with every list (and plain tuple) turned into a tuple, recursively; other
    nodes (dicts, NamedTuples such as optax states) are kept as they are."""
    return _lists_as_tuples(tree)


def _lists_as_tuples(tree: Any) -> Any:
    if isinstance(tree, list):
        tree = tuple(tree)
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_lists_as_tuples(t) for t in tree)
    return tree


def _dtype(a: Any) -> Any:
    return a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype


def host_value(a: Any) -> np.ndarray:
    """The whole (global) value of one leaf in host memory.

    A replicated ``jax.Array`` is read from this process's first copy; a sharded one is
    assembled from its shards (all-gathered over processes when not all are addressable:
    a collective every process must reach).
    """
    if not isinstance(a, jax.Array):
        return np.asarray(a)
    if a.sharding.is_fully_replicated:
        return np.asarray(a.addressable_shards[0].data)
    if a.is_fully_addressable:
        return np.asarray(a)
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


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
