"""The one barrier of multi-process runs (`multihost_utils.sync_global_devices`)."""

from __future__ import annotations

import jax
from jax.experimental import multihost_utils


def barrier(name: str) -> None:
    """Waits for every process (no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
