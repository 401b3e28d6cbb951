"""Test set-up shared by the whole suite.

Four CPU devices are forced before JAX starts its backend, so the multi-device code paths
(shard_map over the ``batch`` axis, per-device rngs) run on a machine without accelerators.

JAX's persistent compilation cache is on (in the system temp folder, shared by xdist
workers): the tests build many trainers whose per-layer functions compile to the same
executables, and compiling dominates their run time on CPU.
"""
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

import revtrain  # noqa: E402, F401  (threads for CPU collectives, before the backend starts)

N_TEST_DEVICES = 4
jax.config.update("jax_num_cpu_devices", N_TEST_DEVICES)
jax.config.update("jax_compilation_cache_dir",
                  os.path.join(tempfile.gettempdir(), "revtrain-tests-jax-cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
