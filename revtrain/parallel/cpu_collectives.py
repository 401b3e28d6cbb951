"""Enough threads for the collectives of a multi-device program on XLA's CPU client.

On the CPU backend with several devices (``--xla_force_host_platform_device_count`` or
``jax_num_cpu_devices``) a collective is a blocking rendezvous: each device's part of an
``all-reduce``, ``all-gather``, ``reduce-scatter`` or ``collective-permute`` holds a thread
of the client until every device of its group has arrived (jaxlib 0.10,
``xla/backends/cpu/collectives/in_process_communicator.cc``). XLA's CPU runtime runs a
program's operations as a dataflow graph and orders its collectives only by *scheduling*
edges (``xla/runtime/execution_graph.h``: ``KindOf(kCollectiveCommunicator)`` is
``kScheduling``: a collective may start once the previous one has *started*). A loop or
conditional that holds collectives (ring attention's ``fori_loop`` of ``ppermute``, a
scanned run of FSDP layers) can finish asynchronously, so the collectives after it start
while it still runs, and a device can wait in several collectives at once, on several
threads, in an order that differs from device to device. Those threads come from one pool
of ``max(cores, devices)`` threads (``xla/pjrt/cpu/cpu_client.cc``: 4 on a 2-core machine
with 4 devices). When every thread of the pool waits in a collective, the device that has
not yet arrived has no thread left to get there: a deadlock, and after
``--xla_cpu_collective_call_terminate_timeout_seconds`` (40 s) XLA aborts the process.

Evidence (issue 40): the 2-layer ``ReversibleTransformerLM`` (d_model 64, length 256,
batch 8) under `ReversibleSerialTrainer` on the mesh ``(data, fsdp, seq) = (1, 2, 2)`` of 4
forced CPU devices, beside two busy processes on a 2-core machine, hung in its first
step in 5 runs of 5. ``gdb`` on the hung process showed the pool's 4 ``tf_XLAEigen``
threads all in ``InProcessCommunicator`` rendezvous (two in an ``all reduce`` over devices
0-3, one in a ``collective permute`` inside two nested ``WhileThunk`` s, one in a
``reduce scatter`` over devices 1 and 3, all of one ``run_id``), the 4 client threads
waiting for their devices' programs, and the process used no CPU time in 10 s: a
deadlock, not a slow machine. With a pool of 128 threads (``NPROC=128``) the same
run passed 3 runs of 3, with the 256 `reserve_threads` asks for 2 of 2, and
``benchmarks/mesh_soak.py`` (every invariance-suite mesh, 20 steps of two trainers, beside
busy processes) 3 of 3. It is not two programs' collectives meeting (the CPU client
starts a multi-device program only after the previous one finished:
``GetLastCollectiveLaunchEvent`` in cpu_client.cc; `revtrain.parallel.inflight` bounds the
queue behind it), and XLA has no option to run a program's collectives one at a time (its
legacy sequential runtime, ``--xla_cpu_use_thunk_runtime=false``, is no longer supported).

The bound: a device waits in at most `max_waiting_collectives` collectives at once (one
per program level, plus, recursively, one set per loop or conditional holding collectives
that may still be running); if the pool has at least ``devices x`` that many threads, some
thread is always free and every device reaches every collective. So:

* `reserve_threads` (run by ``import revtrain``, before JAX creates its CPU client) sets
  ``NPROC``, which sizes the client's pools, to `RESERVED_THREADS` (XLA's cap), and raises
  the collective abort timeout to `TERMINATE_TIMEOUT_S` so a slow machine waits instead of
  aborting; values the user set are kept. If it still fires (a machine stalled that
  long), XLA ends the process with status 134; checkpoints are saved atomically, so the
  newest complete one is intact.
* `CollectiveThreads.check` reads each program's compiled HLO before its first run on a
  multi-device CPU mesh and refuses, with one line, a program whose collectives could
  take every thread (a pool smaller than ``devices x max_waiting_collectives``): it is
  never started, so it cannot hang. A program whose collectives are not inside a loop or
  conditional (a bound of 1, e.g. an evaluation's sums) always fits: XLA gives the pool a
  thread per device.

On one device, and on GPU/TPU (whose collectives do not hold a client thread), nothing
changes.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import jax
from jax.sharding import Mesh

from revtrain._xla_cpu import RESERVED_THREADS, TERMINATE_TIMEOUT_S, reserve_threads

__all__ = ["RESERVED_THREADS", "TERMINATE_TIMEOUT_S", "reserve_threads", "client_threads",
           "max_waiting_collectives", "CollectiveThreads"]

_COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|collective-permute|"
                         r"all-to-all|collective-broadcast|ragged-all-to-all)(-start)?\(")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"(?:body|calls|to_apply|true_computation|false_computation)="
                     r"%?([\w.\-]+)|branch_computations=\{([^}]*)\}")


def client_threads(n_devices: int) -> int:
    """Threads in XLA's CPU client pool that runs the devices' programs.

    Counted from the process's ``tf_XLAEigen`` threads where ``/proc`` lists them (Linux);
    elsewhere XLA's rule: ``max(NPROC or the CPU count, devices)``, at most 256.
    """
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path, encoding="utf-8") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    counted = names.count("tf_XLAEigen")
    if counted:
        return counted
    nproc = os.environ.get("NPROC", "")
    cores = int(nproc) if nproc.isdigit() else (os.cpu_count() or 1)
    return min(max(cores, n_devices), RESERVED_THREADS)


def _computations(hlo_text: str) -> dict[str, list[str]]:
    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = bodies.setdefault(header.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return bodies


def max_waiting_collectives(hlo_text: str) -> int:
    """How many collectives one device of a compiled program can wait in at once.

    A computation contributes one if it holds a collective itself (XLA's CPU runtime
    finishes a plain collective before it starts the next one), plus, for every loop,
    conditional or call in it, what the computations it runs contribute (such an
    operation may still be running when the collectives after it start). A program
    without collectives gives 0, one whose collectives are not inside loops 1.

    Args:
      hlo_text: the program's compiled HLO (``jit(f).lower(...).compile().as_text()``).

    Returns:
      An upper bound, a non-negative int.
    """
    bodies = _computations(hlo_text)
    memo: dict[str, int] = {}

    def bound(name: str, seen: frozenset = frozenset()) -> int:
        if name in memo:
            return memo[name]
        lines = bodies.get(name, [])
        total = int(any(_COLLECTIVE.search(line) for line in lines))
        for line in lines:
            for single, several in _CALLED.findall(line):
                for called in ([single] if single else re.findall(r"%?([\w.\-]+)", several)):
                    if called in bodies and called not in seen:
                        total += bound(called, seen | {name})
        memo[name] = total
        return total

    entry = next((m.group(1) for m in map(_HEADER.match, hlo_text.splitlines())
                  if m and m.string.startswith("ENTRY")), None)
    return bound(entry) if entry else 0


def _signature(args: Any) -> tuple:
    leaves, structure = jax.tree.flatten(args)
    return structure, tuple((a.shape, a.dtype) if hasattr(a, "dtype") else type(a)
                            for a in leaves)


class CollectiveThreads:
    """Refuses a program whose collectives could take every thread of the CPU client.

    Args:
      mesh: the trainer's mesh; the check is active only for a CPU mesh of more than one
        device of this process.
    """

    def __init__(self, mesh: Mesh):
        local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        self.n_devices = len(local)
        self.active = self.n_devices > 1 and all(d.platform == "cpu" for d in local)
        self._checked: set[tuple] = set()

    def check(self, label: str, program: Any, args: tuple) -> None:
        """Before ``program(*args)`` first runs with these argument shapes: lowers and
        compiles it (the call then reuses the executable) and checks its bound.

        Raises:
          RuntimeError: one line naming the program, its bound, the devices and threads,
            and the fix, when ``devices x max_waiting_collectives`` exceeds the client's
            threads; the program has not run.
        """
        if not self.active or not hasattr(program, "lower"):
            return
        key = (id(program), _signature(args))
        if key in self._checked:
            return
        waiting = max_waiting_collectives(program.lower(*args).compile().as_text())
        threads = client_threads(self.n_devices)
        if self.n_devices * waiting > threads:
            raise RuntimeError(
                f"program {label!r} can wait in {waiting} collectives at once on each of "
                f"{self.n_devices} CPU devices, more than the {threads} threads of XLA's "
                f"CPU client, and could deadlock; import revtrain before JAX starts (it "
                f"sets NPROC={RESERVED_THREADS}: {RESERVED_THREADS} threads), or use fewer "
                f"CPU devices")
        self._checked.add(key)
