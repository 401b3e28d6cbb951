"""revtrain.parallel: where values live and how they move between devices.

One floor below the trainers and used by evaluation too (as ``optax/transforms`` is one
concept behind one face):

- `mesh`: the named device mesh (axes ``data``, ``fsdp``, ``seq``) and how one is built;
- `placement`: `Placement`, the one object that says which axis shards what;
- `batches`: a global batch split into per-device rows (and positions over ``seq``);
- `rngs`: per-device, per-layer keys, split as `Serial` splits them (the invariance);
- `collectives`: the FSDP weight gathers and gradient reductions inside a program;
- `transfers`: host <-> device moves, replication, batched puts;
- `inflight`: how many programs a multi-device CPU run may have queued at once;
- `cpu_collectives`: whether XLA's CPU client has threads enough for a program's
  collectives, checked before it first runs.
"""

from revtrain.parallel.batches import for_n_devices, reshape_by_device
from revtrain.parallel.inflight import InflightLimit
from revtrain.parallel.mesh import BATCH_AXIS, MESH_AXES, make_mesh, mesh_from_shape
from revtrain.parallel.placement import Placement
from revtrain.parallel.rngs import StepKeys, per_device_rngs
from revtrain.parallel.transfers import on_accelerator, on_cpu, replicate, unreplicate

__all__ = [
    "BATCH_AXIS", "MESH_AXES", "InflightLimit", "Placement", "StepKeys", "for_n_devices",
    "make_mesh", "mesh_from_shape", "on_accelerator", "on_cpu", "per_device_rngs",
    "replicate", "reshape_by_device", "unreplicate",
]
