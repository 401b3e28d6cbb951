"""The environment of the tests' child processes that run scripts and console scripts as
a user would (not a test file)."""
import os

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` for a child Python that imports this checkout's ``revtrain``.

    One CPU device (a user's plain run), the tests' persistent compilation cache (set up
    by ``tests/conftest.py``; without one, ``JAX_ENABLE_COMPILATION_CACHE=false``: a child
    never writes the tools' default cache in the user's home), and
    ``JAX_DISABLE_MOST_OPTIMIZATIONS``: the children run tiny programs a few times, where
    XLA's optimisation passes cost more time than they save.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1",
               TF_CPP_MIN_LOG_LEVEL="3", JAX_DISABLE_MOST_OPTIMIZATIONS="1",
               PYTHONPATH=os.pathsep.join(
                   p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    cache = jax.config.jax_compilation_cache_dir
    if cache and jax.config.jax_enable_compilation_cache:
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_ENABLE_COMPILATION_CACHE="true",
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    else:
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env.pop("XLA_FLAGS", None)  # A forced device count would override the one device.
    return env | extra
