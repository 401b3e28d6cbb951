"""A bound on the programs a trainer leaves queued on XLA's CPU client with several devices.

XLA's CPU client (PJRT, jaxlib 0.10) lets each device hold at most 32 computations in
flight (``CpuClientOptions.max_inflight_computations_per_device``, not settable from JAX),
and it launches each device's part of a multi-device program from a thread pool that does
not keep the dispatch order. When a program whose devices meet in a collective (the
gradient ``psum``, the FSDP all-gather) finds one device's 32 slots taken by *later*
programs, which wait on its outputs, that device never joins the collective and the
process hangs (XLA aborts it after
``--xla_cpu_collective_call_terminate_timeout_seconds``, 40 s by default). A plain chain
of 64 jitted ``all_gather``s over 4 forced CPU devices is enough to show it; a block
trainer dispatches two programs per layer and only waits for the loss, so a deep or wide
model on ``--xla_force_host_platform_device_count=4`` hung in its first step.

`InflightLimit` keeps the trainer's programs in flight below that bound: it counts the
programs dispatched and waits for every ``limit``-th one to finish (and so for all before
it). It holds no reference to any output, so it keeps nothing alive (a queue of outputs
to wait on would hold activations, and outputs donated to the next program could not be
waited on). On one device, and on GPU/TPU (whose clients queue each device's programs in
order on a stream), it does nothing. On CPU the wait costs little: the "devices" share
the host's cores, and the next program is dispatched as soon as the wait ends.

The other CPU-client hazard, the collectives of *one* program taking every thread of the
client, is `revtrain.parallel.cpu_collectives`'s: `InflightLimit.admit` runs its check
before a program first runs.
"""

from __future__ import annotations

from typing import Any

import jax

from revtrain.parallel.cpu_collectives import CollectiveThreads
from revtrain.parallel.placement import Placement

#: Programs (per trainer) dispatched between two waits. Each counted program brings at most
#: a few small ones with it (an optimizer update, a copy), so this stays well below the CPU
#: client's 32 per device.
DEFAULT_LIMIT = 8


class InflightLimit:
    """Waits for every ``limit``-th counted program to finish.

    Args:
      placement: the trainer's placement; the limit is active only on a CPU mesh of more
        than one device (`Placement.is_multi_device_cpu`).
      limit: programs dispatched between two waits (positive).

    Raises:
      ValueError: for ``limit < 1``.
    """

    def __init__(self, placement: Placement, limit: int = DEFAULT_LIMIT):
        if limit < 1:
            raise ValueError(f"limit={limit} must be at least 1")
        self.active = placement.is_multi_device_cpu
        self.limit = limit
        self._count = 0
        self._threads = CollectiveThreads(placement.mesh)

    def admit(self, label: str, program: Any, args: tuple) -> None:
        """Before dispatching ``program(*args)``: on a multi-device CPU mesh, checks once
        per argument signature that its collectives cannot take every thread of XLA's CPU
        client (`revtrain.parallel.cpu_collectives.CollectiveThreads.check`).

        Raises:
          RuntimeError: as `CollectiveThreads.check`; the program has not run.
        """
        self._threads.check(label, program, args)

    def note(self, outputs: Any) -> None:
        """Counts one program just dispatched, whose results are ``outputs`` (any pytree);
        on every ``limit``-th, waits until they are ready."""
        if not self.active:
            return
        self._count += 1
        if self._count >= self.limit:
            self._count = 0
            jax.block_until_ready(outputs)
