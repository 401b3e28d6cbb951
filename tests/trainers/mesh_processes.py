"""One process of a two-process run on the hybrid mesh ``{'data': 2, 'fsdp': 2}``.

Run as ``python -m tests.trainers.mesh_processes COORDINATOR PROCESS_ID OUT_DIR`` by
``tests/trainers/test_mesh_processes.py`` (two processes of two CPU devices each, through
``jax.distributed``). Each process feeds its half of `tests.mesh_models.global_batch`;
each of `TRAINERS` takes two steps; process 0 writes ``result.json``: per trainer the
losses, gradient norms, weights and, per collective of every compiled program, the
processes of each replica group; and, as ``WINDOWS``, `MemoryEfficientTrainer` with
``scan_window=2`` on `tests.mesh_models.transformer` (its two layers one scanned window,
put from host memory). ``ReversibleSerialTrainer``'s values are
also saved as a sharded checkpoint in ``OUT_DIR/checkpoint`` (each process writes its
shards).
"""
import json
import os
import sys

import jax
import numpy as np

TRAINERS = ("Trainer", "ReversibleSerialTrainer", "MemoryEfficientTrainer")
"""The trainers run, and whose programs' HLO is read."""
WINDOWS = "MemoryEfficientTrainer/scan_window=2/transformer"


class _Collectives:
    """An observer that compiles each dispatched program once and records, per collective
    kind, the processes of each replica group (device ids index ``mesh.devices.flat``)."""

    def __init__(self, mesh):
        self._processes = [d.process_index for d in mesh.devices.flat]
        self._seen = set()
        self.groups = {"all-gather": [], "reduce-scatter": [], "all-reduce": []}

    def on_dispatch(self, label, fn, args):
        from tests.hlo_groups import collective_groups
        if id(fn) in self._seen:
            return
        self._seen.add(id(fn))
        text = fn.lower(*args).compile().as_text()
        for op, found in self.groups.items():
            for groups in collective_groups(text, op):
                found.append([sorted({self._processes[i] for i in g}) for g in groups])


def main(coordinator: str, process_id: int, out_dir: str) -> None:
    jax.distributed.initialize(coordinator, num_processes=2, process_id=process_id)
    from revtrain.parallel.mesh import mesh_from_shape
    from revtrain.training import Checkpointer
    from tests import mesh_models

    mesh = mesh_from_shape({"data": 2, "fsdp": 2})
    half = mesh_models.BATCH // 2
    batch = tuple(b[process_id * half:(process_id + 1) * half]
                  for b in mesh_models.global_batch())
    results = {}
    for name in TRAINERS:
        trainer = mesh_models.build(name, mesh=mesh)
        collectives = _Collectives(trainer.mesh)
        trainer.observers.append(collectives)
        losses, norms, weights = mesh_models.two_steps(trainer, batch)
        results[name] = {"losses": losses, "norms": norms,
                         "weights": [np.asarray(w).tolist() for w in jax.tree.leaves(weights)],
                         "collectives": collectives.groups}
        if name == "ReversibleSerialTrainer":
            checkpointer = Checkpointer(os.path.join(out_dir, "checkpoint"))
            checkpointer.save(2, {part: trainer.saved_values(part)
                                  for part in ("weights", "state", "slots")})
            checkpointer.close()
    trainer = mesh_models.build("MemoryEfficientTrainer", mesh_models.transformer, mesh=mesh,
                                scan_window=2)
    losses, norms, weights = mesh_models.two_steps(trainer, batch)
    results[WINDOWS] = {"losses": losses, "norms": norms,
                        "weights": [np.asarray(w).tolist() for w in jax.tree.leaves(weights)],
                        "programs": sorted(trainer.trace_counts())}
    if process_id == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
