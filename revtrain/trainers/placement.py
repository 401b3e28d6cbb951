"""`Placement`: a trainer's mesh and what is split over which of its axes.

Every trainer runs data-parallel: the global batch is split over the mesh's batch axes,
each device getting ``batch // n_devices`` rows (a per-device value has a leading axis over
those axes, the layout ``jax.pmap`` used, which keeps Trax's per-device rng semantics).
Weights and optimizer slots are replicated, or with ``fsdp`` sharded over the weight axes
(ZeRO-3 / FSDP). A `Placement` holds that decision once; the stores, the compiled
programs and `Trainer` ask it for shardings and partition specs, so the sharding rule is
written only here (`fsdp_spec`).

Today the mesh has one axis, ``batch`` (`BATCH_AXIS`), which is both the batch axis and,
with ``fsdp``, the weight axis; `Placement.batch_axes` and `Placement.weight_axes` name
them so that a mesh with separate ``data``/``fsdp``/``seq`` axes extends this class rather
than every signature.

Multi-host: ``n_devices`` counts *this process's* devices. The mesh spans the first
``n_devices`` devices of every process (``jax.process_count()`` of them under
``jax.distributed``), ordered by process, so each process feeds one contiguous slice of the
global batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

BATCH_AXIS = "batch"

FSDP_MIN_SIZE = 1024
"""Leaves with fewer elements than this stay replicated under ``fsdp=True``: biases, norms
and optimizer counters are too small for sharding to save memory worth a collective."""


def resolve_n_devices(n_devices: int | None) -> int:
    """Returns ``n_devices`` or, when None, the number of local devices.

    Raises:
      TypeError: for a non-int ``n_devices``.
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
    chosen = [d for p in sorted(by_process) for d in by_process[p][:n_devices]]
    return Mesh(np.array(chosen), (BATCH_AXIS,))


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


def fsdp_spec(shape: tuple[int, ...], n_shards: int, min_size: int = FSDP_MIN_SIZE,
              axis: str = BATCH_AXIS) -> P:
    """The FSDP partition of one leaf over ``axis`` (ZeRO-3 / FSDP layout).

    The leaf is split along its largest dimension that ``n_shards`` divides (the first
    such dimension on a tie); it stays replicated (``P()``) when it has fewer than
    ``min_size`` elements, when no dimension is divisible by ``n_shards``, or when
    ``n_shards == 1``. This is the rule of MaxText/flax FSDP meshes: split weights along
    the data axis, keep what cannot be split whole.

    Args:
      shape: the leaf's full (global) shape.
      n_shards: size of ``axis`` (devices of all processes).
      min_size: smallest number of elements that is sharded.
      axis: the mesh axis the leaf is split over.

    Returns:
      A ``PartitionSpec`` naming ``axis`` on at most one dimension.
    """
    size = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if n_shards == 1 or size < min_size:
        return P()
    divisible = [d for d, n in enumerate(shape) if n % n_shards == 0]
    if not divisible:
        return P()
    dim = max(divisible, key=lambda d: (shape[d], -d))
    return P(*([None] * dim), axis)


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Where a trainer's values live: its mesh, the batch split and the weight layout.

    Build one with `Placement.resolve` (from a trainer's ``n_devices``/``mesh``/``fsdp``
    arguments); it is immutable and shared by everything a trainer builds.

    Attributes:
      mesh: the trainer's mesh (axis `BATCH_AXIS`).
      n_devices: this process's devices in the mesh (the batch each process passes is
        split into that many per-device slices).
      fsdp: weights and optimizer slots are sharded over `weight_axes` by `fsdp_spec`
        instead of replicated.
    """

    mesh: Mesh
    n_devices: int
    fsdp: bool = False

    @classmethod
    def resolve(cls, n_devices: int | None = None, mesh: Mesh | None = None,
                fsdp: bool = False) -> Placement:
        """The placement of a trainer built with these arguments.

        Raises:
          TypeError: for a non-bool ``fsdp`` and as `resolve_mesh`.
          ValueError: as `resolve_mesh`.
        """
        if not isinstance(fsdp, bool):
            raise TypeError(f"fsdp={fsdp!r} must be True or False")
        mesh, n_devices = resolve_mesh(n_devices, mesh)
        return cls(mesh, n_devices, fsdp)

    # ----------------------------------------------------------------------------------
    # Axes.

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch (and every per-device value) is split over."""
        return (BATCH_AXIS,)

    @property
    def weight_axes(self) -> tuple[str, ...]:
        """The mesh axes weights and slots are sharded over (none without ``fsdp``)."""
        return (BATCH_AXIS,) if self.fsdp else ()

    @property
    def n_global_devices(self) -> int:
        """Devices of the mesh, over all processes."""
        return self.mesh.devices.size

    # ----------------------------------------------------------------------------------
    # Shardings.

    def weight_spec(self, shape: tuple[int, ...]) -> P:
        """The ``PartitionSpec`` of one stored weight or slot leaf of global ``shape``."""
        if not self.fsdp:
            return P()
        return fsdp_spec(tuple(shape), self.n_global_devices, axis=BATCH_AXIS)

    def weight_specs(self, tree: Any) -> Any:
        """Per-leaf `weight_spec` of ``tree`` (arrays or ``ShapeDtypeStruct`` s)."""
        return jax.tree.map(lambda a: self.weight_spec(np.shape(a)), tree)

    def weight_shardings(self, tree: Any) -> Any:
        """Per-leaf ``NamedSharding`` of stored weights or slots (`weight_spec`)."""
        return jax.tree.map(lambda a: NamedSharding(self.mesh, self.weight_spec(np.shape(a))),
                            tree)

    @functools.cached_property
    def replicated(self) -> NamedSharding:
        """The sharding of a value held whole on every device."""
        return NamedSharding(self.mesh, P())

    @functools.cached_property
    def per_device(self) -> NamedSharding:
        """The sharding of a value whose leading axis is the device axis."""
        return NamedSharding(self.mesh, P(*self.batch_axes))

    @functools.cached_property
    def local_mesh(self) -> Mesh:
        """This process's devices of the mesh, in the mesh's order."""
        local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        return Mesh(np.array(local), (BATCH_AXIS,))

    @property
    def first_local_device(self) -> jax.Device:
        """This process's first device of the mesh (the one device footprints and memory
        logs describe: under ``jax.distributed`` the mesh's very first device belongs to
        process 0 and cannot be inspected from another process)."""
        return self.local_mesh.devices.flat[0]

    @property
    def is_multi_device_cpu(self) -> bool:
        """A CPU mesh of more than one device (see `revtrain.trainers.inflight`)."""
        return self.n_global_devices > 1 and all(d.platform == "cpu"
                                                 for d in self.mesh.devices.flat)


__all__ = ["BATCH_AXIS", "FSDP_MIN_SIZE", "Placement", "fsdp_spec", "make_mesh",
           "resolve_mesh", "resolve_n_devices"]
