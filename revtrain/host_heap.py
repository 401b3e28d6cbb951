"""Host heap upkeep: how the C allocator serves the runtime's buffers, and handing memory
it has freed back to the system.

glibc's ``malloc`` keeps freed memory in per-thread arenas for reuse. Compiling a
function (XLA, LLVM) frees a great deal of short-lived memory on the compiling thread,
while the compiled code's buffers are allocated from the runtime's worker threads, whose
arenas cannot reuse it: without a trim the first step's peak resident memory is the
compiler's leftovers *plus* the step's own use. ``malloc_trim(0)`` returns every free
page of every arena (glibc >= 2.8), at a cost of milliseconds.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

#: ``mallopt`` parameters (glibc ``<malloc.h>``).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
#: Environment variables through which a user already tells glibc how to allocate (the
#: common ones; any other ``MALLOC_*`` name counts as well); when one is set,
#: `configure_host_allocator` leaves the allocator as the user asked.
MALLOC_ENVIRONMENT = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_",
                      "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
#: ``tuned`` (the default) or ``system``: whether `configure_host_allocator` acts.
HOST_ALLOCATOR_ENV = "REVTRAIN_HOST_ALLOCATOR"


def user_malloc_settings() -> list[str]:
    """The environment variables set here that choose how ``malloc`` allocates (sorted):
    every ``MALLOC_*`` name, ``GLIBC_TUNABLES``, and ``LD_PRELOAD`` when it loads another
    allocator (a library with ``malloc`` in its name: jemalloc, tcmalloc, mimalloc), whose
    ``malloc`` glibc's ``mallopt`` would not tune."""
    names = [name for name in os.environ
             if name.startswith("MALLOC_") or name in MALLOC_ENVIRONMENT]
    if "malloc" in os.environ.get("LD_PRELOAD", "").lower():
        names.append("LD_PRELOAD")
    return sorted(names)


def _libc_function(name: str, argtypes: list, restype: Any) -> Any:
    """The C library's function ``name`` with its argument and result types set, or None
    where it has none (glibc's ``mallopt``/``malloc_trim`` are missing on macOS and musl;
    ``CDLL(None)`` is refused on Windows)."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError, TypeError):
        return None
    function.argtypes, function.restype = argtypes, restype
    return function


def _mallopt() -> Any:
    """glibc's ``mallopt(param, value) -> int``, or None."""
    return _libc_function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)


def parse_host_allocator(value: str) -> str:
    """``'tuned'`` or ``'system'`` from a ``REVTRAIN_HOST_ALLOCATOR`` value (any case,
    blanks around it ignored; empty means ``tuned``).

    Raises:
      ValueError: for any other value, naming it and the fix (one line).
    """
    choice = value.strip().lower() or "tuned"
    if choice not in ("tuned", "system"):
        raise ValueError(f"{HOST_ALLOCATOR_ENV}={value!r} is not 'tuned' or 'system'; set "
                         f"one of them, or unset it for 'tuned'")
    return choice


def host_allocator_choice() -> str:
    """``'tuned'`` when `configure_host_allocator` would tune the allocator, ``'system'``
    when the environment opts out (``REVTRAIN_HOST_ALLOCATOR=system``, a ``MALLOC_*`` or
    ``GLIBC_TUNABLES`` setting, or another allocator preloaded: `user_malloc_settings`)
    or the C library has no ``mallopt``. ``REVTRAIN_HOST_ALLOCATOR`` is read without case
    or surrounding blanks; empty means unset (``tuned``).

    Raises:
      ValueError: ``REVTRAIN_HOST_ALLOCATOR`` is set to neither ``tuned`` nor ``system``.
    """
    choice = parse_host_allocator(os.environ.get(HOST_ALLOCATOR_ENV, ""))
    if user_malloc_settings() or _mallopt() is None:
        return "system"
    return choice


def configure_host_allocator() -> bool:
    """Makes glibc's ``malloc`` keep and reuse freed memory instead of mapping it anew.

    XLA's CPU runtime allocates every program's outputs and temporaries with ``malloc``.
    By default glibc maps each block above its mmap threshold (128 KiB, rising to at most
    32 MiB) with ``mmap`` and unmaps it on ``free``, and the runtime's worker threads get
    heaps of their own (at most 64 MiB each) that give freed memory back to the kernel. So
    every training step touches fresh pages that the kernel must fault in and zero: at
    depth 8 (d_model 256, seq 512, batch 8) about 885,000 minor page faults and 1.85 s of
    kernel time per `ReversibleSerialTrainer` step (0.88 s for `Trainer`), a quarter of
    the step's CPU time. This sets, through ``mallopt``:

    * ``M_ARENA_MAX=1``: one heap for every thread, so a buffer freed by one program is
      reused by the next whichever thread allocates it, and large blocks can come from
      the main heap (which grows with ``brk``, without the 64 MiB bound);
    * ``M_MMAP_MAX=0``: no ``mmap`` per allocation;
    * ``M_TRIM_THRESHOLD`` to 2 GiB - 1 (the largest ``int``): freed memory stays in the
      heap unless more than that is free at its top.

    A step then faults in almost no pages (a few thousand instead of 885,000; 0.02 s of
    kernel time at that size). The cost: the process's resident memory no longer shrinks
    after a peak (the block trainers still ``malloc_trim`` once after compiling, see
    `release_free_host_memory`). The same settings as environment variables, for any
    process: ``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4294967296``.

    Call it before the first JAX computation: the runtime's threads choose their heap at
    their first allocation, and a thread that already has one keeps it (only the other two
    settings then apply). The ``revtrain-*`` console scripts call it at start. It leaves the
    allocator alone where ``REVTRAIN_HOST_ALLOCATOR=system``, where a ``MALLOC_*`` or
    ``GLIBC_TUNABLES`` variable is set or ``LD_PRELOAD`` loads another allocator (the
    user's own choice wins), and where the C
    library has no ``mallopt``. Calling it again applies the same settings again.

    Returns:
      True when the settings were applied; False when it left the allocator alone or
      ``mallopt`` refused one of them (a C library other than glibc).

    Raises:
      ValueError: ``REVTRAIN_HOST_ALLOCATOR`` is set to neither ``tuned`` nor ``system``.
    """
    if host_allocator_choice() == "system":
        return False
    mallopt = _mallopt()
    largest = 2**31 - 1  # mallopt takes an int.
    return all([mallopt(_M_ARENA_MAX, 1), mallopt(_M_MMAP_MAX, 0),
                mallopt(_M_TRIM_THRESHOLD, largest)])


def release_free_host_memory() -> bool:
    """Returns the C heap's free pages to the system (glibc ``malloc_trim(0)``).

    Takes milliseconds to tens of milliseconds (it walks every arena); the trainers call
    it after compiling a function, not on every step. Live data is never touched.

    Returns:
      True when the C library has ``malloc_trim`` (glibc) and it released memory; False
      where it has none (macOS, musl) or there was nothing to release.
    """
    malloc_trim = _libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
    return malloc_trim is not None and bool(malloc_trim(0))
