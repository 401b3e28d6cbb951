"""`Placement`: a trainer's mesh and what is split over which of its axes.

Every trainer runs data-parallel: the global batch is split over the mesh's batch axes and
a per-device value has a leading axis over *every* mesh axis, one row per device (the
layout ``jax.pmap`` used, which keeps Trax's per-device rng semantics). Weights and
optimizer slots are replicated, or with ``fsdp`` sharded over the weight axis (ZeRO-3 /
FSDP). A `Placement` holds that decision once; the stores, the compiled programs and
`Trainer` ask it for shardings, partition specs and the per-device batch, so the sharding
rule is written only here (`fsdp_spec`, `per_device_spec`, `Placement.split_batch`).

Two kinds of mesh (`revtrain.parallel.mesh`):

* the one axis ``batch`` (`BATCH_AXIS`; from ``n_devices=``, ``fsdp=`` or a one-axis
  user mesh): the batch and, with ``fsdp``, the weights are split over it;
* the named axes ``('data', 'fsdp', 'seq')``: rows of the batch over ``data x fsdp``,
  weights and slots over ``fsdp`` only (replicated over ``data``: hybrid sharding), and
  the length axis of the batch and of every activation over ``seq``
  (`Placement.split_batch`; layers are traced inside `Placement.sequence_context`).

Losses, batch-weight totals and weight gradients are summed over every mesh axis
(`Placement.device_axes`), so the result does not depend on the mesh. Rngs are split over
the batch's row slices (``data x fsdp``) and shared by each ``seq`` group
(`revtrain.parallel.rngs`).

Multi-host: ``n_devices`` counts *this process's* devices. The mesh spans the first
``n_devices`` devices of every process (``jax.process_count()`` of them under
``jax.distributed``), ordered by process, so each process feeds one contiguous slice of the
global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from revtrain.batch_checks import check_divisible
from revtrain.layers import sequence_parallel
from revtrain.parallel import mesh as mesh_lib
from revtrain.parallel.batches import check_split, reshape_by_device, split_sequence
from revtrain.parallel.mesh import BATCH_AXIS, make_mesh, resolve_mesh, resolve_n_devices

FSDP_MIN_SIZE = 1024
"""Leaves with fewer elements than this stay replicated under ``fsdp=True``: biases, norms
and optimizer counters are too small for sharding to save memory worth a collective."""


def per_device_spec(mesh: Mesh) -> P:
    """The ``PartitionSpec`` of a per-device value on ``mesh``: its leading axis split over
    every mesh axis (``P('batch')``, or ``P(('data', 'fsdp', 'seq'))``), one row per
    device in the mesh's row-major order."""
    names = tuple(mesh.axis_names)
    return P(names[0]) if len(names) == 1 else P(names)


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

    ``Placement(mesh)`` is the documented route, as ``jax.sharding.NamedSharding(mesh,
    spec)`` is JAX's: everything else follows from the mesh. A trainer's ``n_devices=``,
    ``mesh=`` and ``fsdp=`` arguments are conveniences that build one
    (`Placement.resolve`). It is immutable and shared by everything a trainer (and the
    run's evaluation) builds.

    Args:
      mesh: a ``jax.sharding.Mesh``: the named axes among ``('data', 'fsdp', 'seq')``
        (any subset, any order: it becomes the canonical three-axis mesh,
        `revtrain.parallel.mesh.canonical_mesh`), or a one-axis mesh of another name,
        whose devices become the ``batch`` axis (`BATCH_AXIS`). May span processes.
      fsdp: shard weights and optimizer slots over `weight_axes` (`fsdp_spec`) instead of
        replicating them. None (the default) decides from the mesh: on a named mesh,
        exactly when its ``fsdp`` axis is larger than 1; on a one-axis mesh, no.

    Attributes:
      mesh: the canonical mesh: the one axis `BATCH_AXIS`, or ``('data', 'fsdp', 'seq')``.
      fsdp: the resolved bool.
      n_devices: this process's devices in the mesh (the rows of this process's
        per-device values; its batch is split into ``n_devices // seq`` slices of rows),
        derived from the mesh.

    Raises:
      TypeError: for a ``mesh`` that is not a ``jax.sharding.Mesh``, or an ``fsdp`` that is
        not a bool or None.
      ValueError: for an ``fsdp`` that contradicts a named mesh, and as
        `revtrain.parallel.mesh.resolve_mesh` (axis names, devices per process).
    """

    mesh: Mesh
    fsdp: bool | None = None
    n_devices: int = dataclasses.field(init=False)

    def __post_init__(self):
        if self.fsdp is not None and not isinstance(self.fsdp, bool):
            raise TypeError(f"fsdp={self.fsdp!r} must be True, False or None")
        mesh, n_devices = resolve_mesh(None, self.mesh)
        named = tuple(mesh.axis_names) == mesh_lib.MESH_AXES
        fsdp = self.fsdp
        if named:
            sharded = mesh.shape[mesh_lib.FSDP_AXIS] > 1
            if fsdp and not sharded:
                raise ValueError(f"fsdp=True but {mesh_lib.describe(mesh)} has fsdp=1; on a "
                                 f"named mesh the 'fsdp' axis shards the weights: give it "
                                 f"the devices to shard over, or drop fsdp=True")
            if fsdp is False and sharded:
                raise ValueError(f"fsdp=False contradicts {mesh_lib.describe(mesh)}: on a "
                                 f"named mesh its 'fsdp' axis shards the weights; use an "
                                 f"fsdp axis of 1 (or the 'data' axis) to replicate them")
            fsdp = sharded
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "fsdp", bool(fsdp))
        object.__setattr__(self, "n_devices", n_devices)

    @classmethod
    def resolve(cls, n_devices: int | None = None, mesh: Mesh | None = None,
                fsdp: bool = False) -> Placement:
        """The placement a trainer's ``n_devices``/``mesh``/``fsdp`` arguments describe.

        Without ``mesh``, a one-axis mesh of ``n_devices`` devices of every process
        (`revtrain.parallel.mesh.make_mesh`); with one, ``n_devices`` may only repeat its
        count of this process's devices. On a named mesh its ``fsdp`` axis decides the
        weight sharding; ``fsdp=True`` is then only accepted when that axis is larger
        than 1.

        Raises:
          TypeError: for a non-bool ``fsdp`` and as `resolve_mesh`.
          ValueError: as `resolve_mesh` and `Placement`.
        """
        if not isinstance(fsdp, bool):
            raise TypeError(f"fsdp={fsdp!r} must be True or False")
        mesh, _ = resolve_mesh(n_devices, mesh)
        return cls(mesh, fsdp=True if fsdp else None if mesh_lib.is_named(mesh) else False)

    # ----------------------------------------------------------------------------------
    # Axes.

    @property
    def named(self) -> bool:
        """Whether the mesh has the named axes ``('data', 'fsdp', 'seq')``."""
        return tuple(self.mesh.axis_names) == mesh_lib.MESH_AXES

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch's rows are split over (``data`` and ``fsdp``)."""
        return (mesh_lib.DATA_AXIS, mesh_lib.FSDP_AXIS) if self.named else (BATCH_AXIS,)

    @property
    def weight_axes(self) -> tuple[str, ...]:
        """The mesh axes weights and slots are sharded over (none without ``fsdp``)."""
        if not self.fsdp:
            return ()
        return (mesh_lib.FSDP_AXIS,) if self.named else (BATCH_AXIS,)

    @property
    def seq_axis(self) -> str | None:
        """The mesh axis the length axis is split over (None on a ``batch`` mesh)."""
        return mesh_lib.SEQ_AXIS if self.named else None

    @property
    def n_seq(self) -> int:
        """The size of `seq_axis` (1 without one)."""
        return self.mesh.shape[mesh_lib.SEQ_AXIS] if self.named else 1

    @property
    def device_axes(self) -> tuple[str, ...]:
        """Every mesh axis: the leading axis of per-device values is split over them, and
        losses, batch-weight totals and weight gradients are summed over them (the
        invariance: every device holds its own rows and positions)."""
        return tuple(self.mesh.axis_names)

    @property
    def n_global_devices(self) -> int:
        """Devices of the mesh, over all processes."""
        return self.mesh.devices.size

    @property
    def n_batch_shards(self) -> int:
        """How many slices of rows the global batch is split into (``data x fsdp``)."""
        return self.n_global_devices // self.n_seq

    @functools.cached_property
    def rows_mesh(self) -> Mesh:
        """This process's devices of the mesh that hold distinct rows, as one `BATCH_AXIS`
        (``n_devices // seq`` of them: a ``seq`` group counts once): where evaluation
        splits an eval batch's rows, each process its own, summed over processes on the
        host (`revtrain.training.evaluation.Evaluator`)."""
        return Mesh(self.local_mesh.devices[:self.n_devices // self.n_seq], (BATCH_AXIS,))

    # ----------------------------------------------------------------------------------
    # Shardings.

    def weight_spec(self, shape: tuple[int, ...]) -> P:
        """The ``PartitionSpec`` of one stored weight or slot leaf of global ``shape``."""
        if not self.fsdp:
            return P()
        axis = self.weight_axes[0]
        return fsdp_spec(tuple(shape), self.mesh.shape[axis], axis=axis)

    def weight_specs(self, tree: Any) -> Any:
        """Per-leaf `weight_spec` of ``tree`` (arrays or ``ShapeDtypeStruct`` s)."""
        return jax.tree.map(lambda a: self.weight_spec(np.shape(a)), tree)

    def weight_shardings(self, tree: Any) -> Any:
        """Per-leaf ``NamedSharding`` of stored weights or slots (`weight_spec`)."""
        return jax.tree.map(lambda a: NamedSharding(self.mesh, self.weight_spec(np.shape(a))),
                            tree)

    def stacked_weight_spec(self, shape: tuple[int, ...]) -> P:
        """The ``PartitionSpec`` of a stacked ``[repeats, *leaf]`` weight or slot leaf (a
        scanned run's): the layer's own `weight_spec` behind a whole repetition axis, so
        with FSDP each scan iteration finds its layer's shards on every device."""
        return P(None, *self.weight_spec(tuple(shape[1:])))

    def stacked_weight_shardings(self, tree: Any) -> Any:
        """Per-leaf ``NamedSharding`` of stacked weights or slots (`stacked_weight_spec`)."""
        return jax.tree.map(
            lambda a: NamedSharding(self.mesh, self.stacked_weight_spec(np.shape(a))), tree)

    @functools.cached_property
    def replicated(self) -> NamedSharding:
        """The sharding of a value held whole on every device."""
        return NamedSharding(self.mesh, P())

    @property
    def device_spec(self) -> P:
        """The ``PartitionSpec`` of a per-device value (`per_device_spec`)."""
        return per_device_spec(self.mesh)

    @functools.cached_property
    def per_device(self) -> NamedSharding:
        """The sharding of a value whose leading axis is the device axis."""
        return NamedSharding(self.mesh, self.device_spec)

    @functools.cached_property
    def local_mesh(self) -> Mesh:
        """This process's devices of the mesh, in the mesh's row-major order, as one axis
        named `BATCH_AXIS`."""
        local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        return Mesh(np.array(local), (BATCH_AXIS,))

    @functools.cached_property
    def local_per_device(self) -> NamedSharding:
        """This process's rows of a per-device value, one per device of `local_mesh`."""
        return NamedSharding(self.local_mesh, P(BATCH_AXIS))

    @property
    def first_local_device(self) -> jax.Device:
        """This process's first device of the mesh (the one device footprints and memory
        logs describe: under ``jax.distributed`` the mesh's very first device belongs to
        process 0 and cannot be inspected from another process)."""
        return self.local_mesh.devices.flat[0]

    @property
    def is_multi_device_cpu(self) -> bool:
        """A CPU mesh of more than one device (see `revtrain.parallel.inflight`)."""
        return self.n_global_devices > 1 and all(d.platform == "cpu"
                                                 for d in self.mesh.devices.flat)

    # ----------------------------------------------------------------------------------
    # Batches.

    def per_device_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The global shape of a per-device batch leaf from this process's ``[batch,
        length, ...]`` leaf: ``(devices of the mesh, batch // (n_devices // seq), length //
        seq, ...)``.

        Raises:
          ValueError: as `split_batch`.
        """
        shape = tuple(shape)
        self._check_batch([shape])
        rows = shape[0] // (self.n_devices // self.n_seq)
        rest = shape[1:] if self.n_seq == 1 else (shape[1] // self.n_seq, *shape[2:])
        return (self.n_global_devices, rows, *rest)

    def split_batch(self, batch: Any) -> Any:
        """This process's batch, each leaf ``[batch, length, ...]``, as per-device values
        ``[n_devices, batch // (n_devices // seq), length // seq, ...]`` (same array kind).

        Device ``(d, f, s)`` of the mesh gets the rows of batch slice ``d * fsdp + f`` and,
        with ``seq > 1``, the ``s``-th contiguous block of the length axis after it is
        permuted by ``revtrain.layers.sequence_parallel.sequence_layout(seq, length)``
        (`revtrain.parallel.batches.split_sequence`). Nothing is put on a device.

        Raises:
          ValueError: one line naming the mesh, the value and the fix, for rows that
            ``data x fsdp`` (this process's share) does not divide, and with ``seq > 1``
            for a leaf without a length axis or a length that ``seq`` does not divide; and
            as `revtrain.parallel.batches.reshape_by_device`.
        """
        self._check_batch([np.shape(a) for a in jax.tree.leaves(batch)])
        shards = reshape_by_device(batch, self.n_devices // self.n_seq)
        if self.n_seq == 1:
            return shards
        length = np.shape(jax.tree.leaves(batch)[0])[1]
        layout = sequence_parallel.sequence_layout(self.n_seq, length)
        return split_sequence(shards, self.n_seq, layout)

    def _check_batch(self, shapes: list[tuple[int, ...]]) -> None:
        if not self.named:
            check_split(shapes[0][0] if shapes and shapes[0] else None, self.n_devices)
            return
        where = mesh_lib.describe(self.mesh)
        rows = {s[0] if s else None for s in shapes}
        if len(rows) == 1 and None not in rows:
            by = "data x fsdp" if jax.process_count() == 1 else "this process's data x fsdp"
            check_divisible(rows.pop(), self.n_devices // self.n_seq, by=by,
                            fix=f"{where} splits the batch {self.n_batch_shards} ways: use "
                                f"a global batch that is a multiple of {self.n_batch_shards}")
        if self.n_seq == 1:
            return
        if len({s[1] for s in shapes if len(s) >= 2}) > 1:
            raise ValueError(f"batch leaves have lengths {[s[1:2] for s in shapes]} but "
                             f"{where} splits one length axis over seq={self.n_seq}; give "
                             f"every batch item the same length or use seq=1")
        for k, shape in enumerate(shapes):
            if len(shape) < 2:
                raise ValueError(f"batch leaf {k} has shape {shape} without a length axis but "
                                 f"{where} splits axis 1 over seq={self.n_seq}; give every "
                                 f"batch item a [batch, length, ...] shape or use seq=1")
            if shape[1] % self.n_seq:
                raise ValueError(f"sequence length {shape[1]} (batch leaf {k}) is not "
                                 f"divisible by seq={self.n_seq} of {where}; use a length "
                                 f"that is a multiple of {self.n_seq} or another seq size")

    def sequence_context(self, stack: Any) -> contextlib.AbstractContextManager:
        """What layers are traced inside, in a program body on the mesh.

        With ``seq > 1``: ``sequence_sharded('seq', seq, length)``
        (`revtrain.layers.sequence_parallel`), the global ``length`` read from the first
        leaf of ``stack`` with a length axis (``[1, rows, length // seq, ...]`` inside
        ``shard_map``); otherwise (or without such a leaf) nothing.
        """
        lengths = [np.shape(a)[2] for a in jax.tree.leaves(stack) if np.ndim(a) >= 3]
        if self.n_seq == 1 or not lengths:
            return contextlib.nullcontext()
        return sequence_parallel.sequence_sharded(mesh_lib.SEQ_AXIS, self.n_seq,
                                                  lengths[0] * self.n_seq)


__all__ = ["BATCH_AXIS", "FSDP_MIN_SIZE", "Placement", "fsdp_spec", "make_mesh",
           "per_device_spec", "resolve_mesh", "resolve_n_devices"]
