"""Test set-up shared by the whole suite.

Four CPU devices are forced before JAX starts its backend, so the multi-device code paths
(shard_map over the ``batch`` axis, per-device rngs) run on a machine without accelerators.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

N_TEST_DEVICES = 4
jax.config.update("jax_num_cpu_devices", N_TEST_DEVICES)
jax.config.update("jax_threefry_partitionable", True)
