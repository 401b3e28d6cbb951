"""Named meshes: the ``data``, ``fsdp`` and ``seq`` axes, and the checks a mesh must pass.

A trainer's mesh has either the one axis ``batch`` (`BATCH_AXIS`:
``n_devices=``, ``fsdp=`` or a user's one-axis mesh, as before named meshes) or the three
named axes `MESH_AXES`, each with one job (MaxText's and Paxml's named mesh axes):

* ``data`` splits the batch; weights and optimizer slots are replicated over it;
* ``fsdp`` splits the batch too, and shards weights and slots (ZeRO-3 inside each group of
  ``fsdp`` devices: hybrid sharding, so the weight all-gathers stay inside a group);
* ``seq`` splits the length axis of the batch and of every activation (sequence
  parallelism: `revtrain.layers.sequence_parallel`).

A user's mesh with any of these names (``jax.make_mesh((2, 2, 1), ('data', 'fsdp',
'seq'))``, or ``('fsdp', 'data')``, or the one axis ``('seq',)``) becomes the canonical
mesh `canonical_mesh`: the same device at the same coordinates, the axes in the order of
`MESH_AXES`, a missing axis of size 1, and ``jax.sharding.AxisType.Auto`` axes (the
trainers place every value themselves). A one-axis mesh of another name (``'data'``,
``'batch'``, ...) keeps its old meaning: the ``batch`` axis.

Multi-host: each process holds the same number of devices of the mesh, consecutive in
its row-major order, and every ``seq`` group lies inside one process (a process feeds
whole rows of the global batch). `mesh_from_shape` builds such a mesh from axis sizes by
name: devices ordered by process, the last axes (``seq``, then ``fsdp``) fastest, so with
``{'data': n_processes, 'fsdp': devices per process}`` every ``fsdp`` group is one
process's devices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from revtrain.layers.sequence_parallel import SEQ_AXIS

BATCH_AXIS = "batch"
DATA_AXIS, FSDP_AXIS = "data", "fsdp"
MESH_AXES = (DATA_AXIS, FSDP_AXIS, SEQ_AXIS)
EXAMPLE = "jax.make_mesh((2, 2, 1), ('data', 'fsdp', 'seq'))"


def describe(mesh: Mesh) -> str:
    """``"mesh {'data': 2, 'fsdp': 2, 'seq': 1}"``: how errors name a mesh."""
    return f"mesh {dict(mesh.shape)}"


def is_named(mesh: Mesh) -> bool:
    """Whether ``mesh`` is read by its axis names (several axes, or the one axis ``fsdp``
    or ``seq``) rather than as the one ``batch`` axis."""
    names = tuple(mesh.axis_names)
    return len(names) > 1 or names[0] in (FSDP_AXIS, SEQ_AXIS)


def canonical_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with the axes `MESH_AXES` in that order (missing ones of size 1).

    Raises:
      ValueError: for an axis name outside `MESH_AXES`, naming the mesh and the fix.
    """
    names = tuple(mesh.axis_names)
    unknown = [name for name in names if name not in MESH_AXES]
    if unknown:
        raise ValueError(f"{describe(mesh)} has axis {unknown[0]!r}; name every axis of a "
                         f"mesh of several axes 'data', 'fsdp' or 'seq' (e.g. {EXAMPLE}), "
                         f"or pass a one-axis mesh")
    devices = np.transpose(mesh.devices, [names.index(n) for n in MESH_AXES if n in names])
    shape = [mesh.shape[n] if n in names else 1 for n in MESH_AXES]
    return Mesh(devices.reshape(shape), MESH_AXES)


def local_device_count(mesh: Mesh) -> int:
    """This process's devices in ``mesh``, after checking how the processes share it.

    Raises:
      ValueError: when the mesh holds no device of this process, a different number of
        devices of each process, a process's devices not consecutive (row-major), or, for
        a named mesh, a ``seq`` group split over processes.
    """
    flat = list(mesh.devices.flat)
    counts: dict[int, int] = {}
    for device in flat:
        counts[device.process_index] = counts.get(device.process_index, 0) + 1
    local = counts.get(jax.process_index(), 0)
    if local == 0 or len(set(counts.values())) != 1:
        raise ValueError(f"{describe(mesh)} holds {counts} devices per process index; it "
                         f"must hold the same number (> 0) of devices of every process")
    order = [d.process_index for d in flat]
    if sum(a != b for a, b in zip(order, order[1:], strict=False)) != len(counts) - 1:
        raise ValueError(f"{describe(mesh)}: its devices belong to processes {order} in "
                         f"that order; each process's devices must be consecutive in the "
                         f"mesh's row-major order (each process feeds one contiguous slice "
                         f"of the global batch)")
    if SEQ_AXIS in mesh.axis_names and mesh.shape[SEQ_AXIS] > 1:
        groups = np.vectorize(lambda d: d.process_index)(mesh.devices)
        if not (groups == groups[..., :1]).all():
            raise ValueError(f"{describe(mesh)} splits a 'seq' group over processes; keep "
                             f"each 'seq' group inside one process (put the processes on "
                             f"the 'data' or 'fsdp' axis)")
    return local


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
    return Mesh(np.array(_first_devices(resolve_n_devices(n_devices))), (BATCH_AXIS,))


def _processes() -> str:
    n = jax.process_count()
    return f"{n} process" + ("es" if n > 1 else "")


def _first_devices(n_devices: int) -> list[jax.Device]:
    """The first ``n_devices`` devices of every process, ordered by process."""
    by_process: dict[int, list] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    return [d for p in sorted(by_process) for d in by_process[p][:n_devices]]


def resolve_mesh(n_devices: int | None, mesh: Mesh | None) -> tuple[Mesh, int]:
    """The trainer's mesh and its devices per process, from either argument.

    Without ``mesh``, `make_mesh(n_devices)`. A named ``mesh`` (several axes, or the one
    axis ``fsdp`` or ``seq``: `is_named`) becomes its canonical ``('data', 'fsdp',
    'seq')`` mesh (`canonical_mesh`); any other
    one-axis `jax.sharding.Mesh` (e.g. ``'data'``) keeps today's meaning: its devices, in
    its order, become the ``batch`` axis. Under ``jax.distributed`` either may span
    processes.

    Raises:
      ValueError: for an axis name outside ``data``/``fsdp``/``seq`` on a mesh of several
        axes; a mesh that holds no device of this process, a different number of devices
        of each process, a process's devices not consecutive, or a ``seq`` group split
        over processes (`local_device_count`); or an ``n_devices``
        that contradicts ``mesh``.
      TypeError: when ``mesh`` is not a ``jax.sharding.Mesh``.
    """
    if mesh is None:
        n_devices = resolve_n_devices(n_devices)
        return make_mesh(n_devices), n_devices
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh={mesh!r} is not a jax.sharding.Mesh; pass a mesh (e.g. "
                        f"{EXAMPLE}) or use n_devices")
    if is_named(mesh):
        mesh = canonical_mesh(mesh)
    else:
        mesh = Mesh(np.array(list(mesh.devices.flat)), (BATCH_AXIS,))
    local = local_device_count(mesh)
    if n_devices is not None and n_devices != local:
        raise ValueError(f"n_devices={n_devices} but {describe(mesh)} holds {local} "
                         f"devices of this process; pass only one of them")
    return mesh, local


def check_mesh_shape(shape: Mapping[str, int], binding: str = "mesh_shape") -> dict[str, int]:
    """``shape`` as ``{axis: size}`` for every axis of `MESH_AXES` (missing ones 1).

    Raises:
      ValueError: for a non-mapping, an axis name outside `MESH_AXES` or a size that is
        not an integer >= 1, naming ``binding`` and the fix.
    """
    if not isinstance(shape, Mapping):
        raise ValueError(f"{binding}={shape!r} must map axis names to sizes, e.g. "
                         f"{{'data': 2, 'fsdp': 2}}")
    for name, size in shape.items():
        if name not in MESH_AXES:
            raise ValueError(f"{binding}={dict(shape)!r} has axis {name!r}; use the axes "
                             f"'data', 'fsdp' and 'seq'")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"{binding}={dict(shape)!r}: axis {name!r} has size {size!r}; "
                             f"give every axis an integer size >= 1")
    return {name: int(shape.get(name, 1)) for name in MESH_AXES}


def mesh_from_shape(shape: Mapping[str, int], n_devices: int | None = None,
                    binding: str = "mesh_shape") -> Mesh:
    """The canonical mesh of axis sizes ``shape`` (e.g. ``{'data': 2, 'fsdp': 2}``).

    It spans the first ``n_devices`` devices (default: all) of every process, ordered by
    process, reshaped row-major to ``(data, fsdp, seq)``.

    Raises:
      ValueError: as `check_mesh_shape` and `resolve_n_devices`, or when the sizes do not
        multiply to the devices of the run (naming both and the fix).
      TypeError: as `resolve_n_devices`.
    """
    sizes = check_mesh_shape(shape, binding)
    local = resolve_n_devices(n_devices)
    chosen = _first_devices(local)
    if math.prod(sizes.values()) != len(chosen):
        raise ValueError(f"{binding}={dict(shape)!r} has {math.prod(sizes.values())} devices "
                         f"but the run has {len(chosen)} ({_processes()} x {local} devices); "
                         f"give axis sizes whose product is {len(chosen)}")
    mesh = Mesh(np.array(chosen).reshape([sizes[n] for n in MESH_AXES]), MESH_AXES)
    local_device_count(mesh)
    return mesh


__all__ = ["BATCH_AXIS", "DATA_AXIS", "FSDP_AXIS", "MESH_AXES", "SEQ_AXIS",
           "canonical_mesh", "check_mesh_shape", "describe", "is_named",
           "local_device_count", "make_mesh", "mesh_from_shape", "resolve_mesh",
           "resolve_n_devices"]
