"""Test set-up shared by the whole suite.

Four CPU devices are forced before JAX starts its backend, so the multi-device code paths
(shard_map over the ``batch`` axis, per-device rngs) run on a machine without accelerators.

JAX's persistent compilation cache is on (in the system temp folder, shared by xdist
workers): the tests build many trainers whose per-layer functions compile to the same
executables, and compiling dominates their run time on CPU. It is set in the environment
(``JAX_COMPILATION_CACHE_DIR``) before JAX is imported, so every child process a test
starts shares it too, and the tools' default cache in the user's home
(`revtrain.training.compile_cache`) is never written: a JAX setting wins over it.

JAX's ``jax_disable_most_optimizations`` is on too (also in the environment, so child
processes inherit it): XLA skips LLVM's expensive optimisation passes. The tests run small
programs for a few steps, so compiling, not running, is what they wait for: the README's
test command on 2 cores with an empty cache took 27 min 40 s and 31 min 32 s in two runs
with it, 37 min 05 s without (each alone on the machine). The code XLA emits is slower,
and where it sums in another order a float32 result can differ in its last bits: a test
that compares two programs computing one sum in different orders (a chunked and a whole
weight gradient) needs a tolerance on the sum's scale, not the optimised code's luck.

Each test module's compiled programs are released when the module ends (`jax.clear_caches`):
an xdist worker runs hundreds of tests, JAX keeps the executables of module-level jitted
functions and eager operations for every shape they ran on, and each CPU executable holds
about six memory mappings. Kept, they reached Linux's ``vm.max_map_count`` (65,530) in one
worker, and XLA then crashed loading a program (docs/troubleshooting.md). The module
teardown also fails if the process still holds over half that limit after the release.
"""
import gc
import os
import tempfile

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
TEST_CACHE = os.path.join(tempfile.gettempdir(), "revtrain-tests-jax-cache")
os.environ.update(JAX_COMPILATION_CACHE_DIR=TEST_CACHE, JAX_ENABLE_COMPILATION_CACHE="true",
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
                  JAX_DISABLE_MOST_OPTIMIZATIONS="1")

import jax  # noqa: E402

import revtrain  # noqa: E402, F401  (threads for CPU collectives, before the backend starts)

N_TEST_DEVICES = 4
jax.config.update("jax_num_cpu_devices", N_TEST_DEVICES)
# Also here, in case JAX was imported before this file (a plugin).
jax.config.update("jax_compilation_cache_dir", TEST_CACHE)
jax.config.update("jax_enable_compilation_cache", True)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
jax.config.update("jax_disable_most_optimizations", True)


MAX_MAP_COUNT_FILE = "/proc/sys/vm/max_map_count"


def memory_mappings() -> int | None:
    """How many memory mappings this process holds (None where /proc does not say)."""
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """Releases the module's executables after its last test; fails if the process still
    holds over half of ``vm.max_map_count`` mappings, which would crash XLA later."""
    yield
    jax.clear_caches()
    gc.collect()
    held = memory_mappings()
    try:
        with open(MAX_MAP_COUNT_FILE) as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return
    assert held is None or held <= limit // 2, (
        f"after {request.module.__name__} and jax.clear_caches() the process holds {held} "
        f"memory mappings (vm.max_map_count {limit}): something outside JAX's caches keeps "
        f"executables alive; release them at the end of the test")
