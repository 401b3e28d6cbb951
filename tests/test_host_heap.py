"""revtrain.host_heap: the tuned host allocator stops the per-step page faults, and the
user's own allocator settings win."""

import os
import subprocess
import sys
import textwrap

import pytest

from revtrain import host_heap

_REAL_MALLOPT = host_heap._mallopt
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
           if not k.startswith("MALLOC_") and k not in host_heap.MALLOC_ENVIRONMENT
           + (host_heap.HOST_ALLOCATOR_ENV, "LD_PRELOAD")}
    env.update(env_update)
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tuned_allocator_reuses_the_runtimes_buffers_instead_of_faulting_them_in():
    applied, tuned = _faults({})
    not_applied, system = _faults({host_heap.HOST_ALLOCATOR_ENV: "system"})
    assert applied and not not_applied
    # Mapped anew on every call: 65,536 4-KiB pages a call where the kernel backs the
    # buffers with small pages, about a quarter of that where transparent huge pages back
    # part of them (measured 270,000 for the 16 calls); at least 4,000 a call either way...
    assert system > 16 * 4_000, system
    assert tuned < 0.6 * system, (tuned, system)  # ...against reused (measured ~0.25x).


class _FakeMallopt:
    """Stands in for libc's ``mallopt``, so no test tunes the allocator of its own process."""

    def __init__(self, result=1):
        self.calls, self.result = [], result

    def __call__(self, param, value):
        self.calls.append((param, value))
        return self.result


@pytest.fixture
def mallopt(monkeypatch):
    """A recording `_FakeMallopt` as libc's ``mallopt``, with no allocator setting set."""
    for name in host_heap.user_malloc_settings() + [host_heap.HOST_ALLOCATOR_ENV]:
        monkeypatch.delenv(name, raising=False)
    fake = _FakeMallopt()
    monkeypatch.setattr(host_heap, "_mallopt", lambda: fake)
    return fake


@pytest.mark.parametrize("env", [{"REVTRAIN_HOST_ALLOCATOR": "system"},
                                 {"REVTRAIN_HOST_ALLOCATOR": " System\n"},
                                 {"MALLOC_ARENA_MAX": "2"},
                                 {"MALLOC_ARENA_TEST": "1"},  # Not in MALLOC_ENVIRONMENT.
                                 {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
                                 {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}])
def test_the_users_choice_wins(env, mallopt, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert host_heap.host_allocator_choice() == "system"
    assert host_heap.configure_host_allocator() is False
    assert mallopt.calls == []


def test_a_preload_of_something_else_than_an_allocator_keeps_the_tuning(mallopt,
                                                                         monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "libstdc++.so.6")
    assert host_heap.user_malloc_settings() == []
    assert host_heap.configure_host_allocator() is True


@pytest.mark.parametrize("value", ["", "tuned", "TUNED", "  tuned "])
def test_an_empty_or_differently_written_tuned_tunes_every_call_alike(value, mallopt,
                                                                      monkeypatch):
    monkeypatch.setenv(host_heap.HOST_ALLOCATOR_ENV, value)
    assert host_heap.host_allocator_choice() == "tuned"
    assert host_heap.configure_host_allocator() is True
    assert host_heap.configure_host_allocator() is True  # Idempotent: the same settings.
    expected = [(host_heap._M_ARENA_MAX, 1), (host_heap._M_MMAP_MAX, 0),
                (host_heap._M_TRIM_THRESHOLD, 2**31 - 1)]
    assert mallopt.calls == expected * 2


def test_a_c_library_without_mallopt_or_malloc_trim_is_left_alone(mallopt, monkeypatch):
    mallopt.result = 0  # A mallopt that refuses the settings (a stub C library's).
    assert host_heap.configure_host_allocator() is False

    class NoMallopt:  # macOS' libc: no such symbol.
        def __getattr__(self, name):
            raise AttributeError(name)
    def refused(name):  # Windows: CDLL(None) is a TypeError.
        raise TypeError(name)
    monkeypatch.setattr(host_heap, "_mallopt", _REAL_MALLOPT)
    for cdll in (lambda name: NoMallopt(), refused):
        monkeypatch.setattr(host_heap.ctypes, "CDLL", cdll)
        assert host_heap.host_allocator_choice() == "system"
        assert host_heap.configure_host_allocator() is False
        assert host_heap.release_free_host_memory() is False


def test_bad_choice_names_the_value_and_the_fix(monkeypatch):
    monkeypatch.setenv("REVTRAIN_HOST_ALLOCATOR", "fast")
    with pytest.raises(ValueError, match="REVTRAIN_HOST_ALLOCATOR='fast' is not 'tuned' or "
                                         "'system'"):
        host_heap.configure_host_allocator()


def test_console_script_refuses_a_bad_choice_in_one_line_naming_the_command():
    env = dict(os.environ, REVTRAIN_HOST_ALLOCATOR="fast\nest")
    done = subprocess.run([sys.executable, "-m", "revtrain", "--version"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert done.stderr.startswith("revtrain-train: error: ValueError: REVTRAIN_HOST_ALLOCATOR="
                                  "'fast\\nest' is not 'tuned' or 'system'; set one of "
                                  "them, or unset it"), done.stderr


# Three steps of a small reversible LM: the heap now hands back reused, unzeroed memory
# where mmap gave fresh zero pages, so a buffer read before it is written would show here.
_STEPS = textwrap.dedent("""
    import sys
    from revtrain import host_heap
    applied = host_heap.configure_host_allocator()
    import jax
    from benchmarks import harness
    config = dict(vocab_size=32, d_model=32, d_ff=64, depth=2, n_heads=2, seq_len=32,
                  dropout=0.1, seed=0, batch_size=4, n_devices=1, trainer=sys.argv[1])
    trainer, batch = harness.build(config)
    losses = [float(trainer.one_step(batch, jax.random.key(s))[0]) for s in range(3)]
    print(applied, *[loss.hex() for loss in losses])
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
@pytest.mark.parametrize("trainer", ["trainer", "reversible"])
def test_tuned_allocator_gives_bitwise_the_same_steps(trainer):
    runs = {}
    for choice in ("tuned", "system"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        env[host_heap.HOST_ALLOCATOR_ENV] = choice
        env["PYTHONPATH"] = os.pathsep.join([_ROOT, env.get("PYTHONPATH", "")])
        out = subprocess.run([sys.executable, "-c", _STEPS, trainer], env=env, text=True,
                             capture_output=True, timeout=300, check=True).stdout.split()
        runs[choice] = out
    assert runs["tuned"][0] == "True" and runs["system"][0] == "False"
    assert runs["tuned"][1:] == runs["system"][1:]
