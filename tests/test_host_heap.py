"""revtrain.host_heap: the tuned host allocator stops the per-step page faults, and the
user's own allocator settings win."""

import os
import subprocess
import sys
import textwrap

import pytest

from revtrain import host_heap

# Each call's program returns 4 x 64 MiB of outputs, freed before the next call: 65,536
# fresh 4 KiB pages per call when every buffer is mapped anew, and none once the (single,
# untrimmed) heap has grown to hold them (a few calls: outputs are freed asynchronously).
_FAULTS = textwrap.dedent("""
    import resource, sys
    from revtrain import host_heap
    applied = host_heap.configure_host_allocator()
    import jax, jax.numpy as jnp
    step = jax.jit(lambda x: [x + i for i in range(4)])
    x = jnp.ones((16, 1024, 1024), jnp.float32)
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(16):
        jax.block_until_ready(step(x))
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
""")


def _faults(env_update):
    env = {k: v for k, v in os.environ.items()
           if k not in host_heap.MALLOC_ENVIRONMENT + (host_heap.HOST_ALLOCATOR_ENV,)}
    env.update(env_update)
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tuned_allocator_reuses_the_runtimes_buffers_instead_of_faulting_them_in():
    applied, tuned = _faults({})
    not_applied, system = _faults({host_heap.HOST_ALLOCATOR_ENV: "system"})
    assert applied and not not_applied
    assert system > 16 * 60_000, system  # Mapped anew on every call...
    assert tuned < 0.6 * system, (tuned, system)  # ...against reused (measured ~0.27x).


@pytest.mark.parametrize("env", [{"REVTRAIN_HOST_ALLOCATOR": "system"},
                                 {"MALLOC_ARENA_MAX": "2"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}])
def test_the_users_choice_wins(env, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert host_heap.host_allocator_choice() == "system"
    assert host_heap.configure_host_allocator() is False


def test_bad_choice_names_the_value_and_the_fix(monkeypatch):
    monkeypatch.setenv("REVTRAIN_HOST_ALLOCATOR", "fast")
    with pytest.raises(ValueError, match="REVTRAIN_HOST_ALLOCATOR='fast' is not 'tuned' or "
                                         "'system'"):
        host_heap.configure_host_allocator()


def test_console_script_refuses_a_bad_choice_in_one_line():
    env = dict(os.environ, REVTRAIN_HOST_ALLOCATOR="fast")
    done = subprocess.run([sys.executable, "-m", "revtrain", "--version"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "REVTRAIN_HOST_ALLOCATOR='fast'" in done.stderr, done.stderr
