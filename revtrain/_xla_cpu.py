"""What XLA's CPU client must be given before JAX creates it (``import revtrain`` runs
`reserve_threads`; `revtrain.parallel.cpu_collectives` explains why). No JAX import here:
this runs before JAX starts."""

import os
from collections.abc import MutableMapping

#: Threads asked of XLA's CPU client (its cap: ``kMaxIntraOpThreads`` in cpu_client.cc).
RESERVED_THREADS = 256
#: Seconds a CPU collective may wait before XLA ends the process (XLA's default: 40).
TERMINATE_TIMEOUT_S = 1800
TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"


def reserve_threads(environ: MutableMapping[str, str] | None = None) -> None:
    """Asks XLA's CPU client for `RESERVED_THREADS` threads (``NPROC``, which sizes its
    pools) and a collective abort timeout of `TERMINATE_TIMEOUT_S` seconds, keeping
    either where the user set it.

    Takes effect only before JAX creates its CPU client (the first ``jax.devices()``, mesh
    or array). Idle threads use no CPU time.

    Args:
      environ: the environment to change (default ``os.environ``).
    """
    environ = os.environ if environ is None else environ
    environ.setdefault("NPROC", str(RESERVED_THREADS))
    flags = environ.get("XLA_FLAGS", "")
    if TIMEOUT_FLAG not in flags:
        environ["XLA_FLAGS"] = f"{flags} {TIMEOUT_FLAG}={TERMINATE_TIMEOUT_S}".strip()
