"""Host heap upkeep: hand memory the C allocator has freed back to the system.

glibc's ``malloc`` keeps freed memory in per-thread arenas for reuse. Compiling a
function (XLA, LLVM) frees a great deal of short-lived memory on the compiling thread,
while the compiled code's buffers are allocated from the runtime's worker threads, whose
arenas cannot reuse it: without a trim the first step's peak resident memory is the
compiler's leftovers *plus* the step's own use. ``malloc_trim(0)`` returns every free
page of every arena (glibc >= 2.8), at a cost of milliseconds.
"""

from __future__ import annotations

import ctypes


def release_free_host_memory() -> bool:
    """Returns the C heap's free pages to the system (glibc ``malloc_trim(0)``).

    Takes milliseconds to tens of milliseconds (it walks every arena); the trainers call
    it after compiling a function, not on every step. Live data is never touched.

    Returns:
      True when the C library has ``malloc_trim`` (glibc) and it released memory; False
      where it has none (macOS, musl) or there was nothing to release.
    """
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(malloc_trim(0))
