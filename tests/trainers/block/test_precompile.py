"""Tests for revtrain.trainers.block.precompile: every program of a block trainer's step compiled
ahead of the first step (`revtrain.trainers.block.compiling`: side by side only while the
persistent compilation cache is off), and nothing traced or compiled again afterwards."""
import math
import threading

import jax
import numpy as np
import pytest

from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer
from revtrain.trainers.block.compiling import compile_all, compile_workers, n_equations
from tests.trainers.conftest import adam, initialised_blocks, run_steps, signature

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class _CompileCounter:
    def __init__(self):
        self.n = 0

    def __call__(self, event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            self.n += 1


@pytest.mark.parametrize("trainer_cls,n_devices,kwargs", [
    (ReversibleSerialTrainer, 2, {}), (ReversibleSerialTrainer, 1, {"clip_global_norm": 0.1}),
    (MemoryEfficientTrainer, 4, {"keep_every": 2})])
def test_precompile_leaves_nothing_to_compile_in_the_steps(trainer_cls, n_devices, kwargs,
                                                           batch):
    trainer = trainer_cls(*initialised_blocks("two", batch), adam, n_devices=n_devices,
                          **kwargs)
    times = trainer.precompile(signature(batch))
    assert times.n_programs >= 4 and math.isnan(times.run_s)
    assert times.trace_s > 0 and times.compile_s > 0
    counts = trainer.trace_counts()
    assert set(counts.values()) == {1}  # Each distinct function traced exactly once.
    counter = _CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        run_steps(trainer, batch, steps=2)
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.n == 0
    assert trainer.trace_counts() == counts
    assert trainer.compile_times.run_s > 0


def test_first_step_precompiles_and_matches_a_trainer_stepped_lazily(batch):
    blocks = initialised_blocks("one", batch)
    trainer = ReversibleSerialTrainer(*blocks, adam, n_devices=2)
    assert trainer.compile_times is None
    first = run_steps(trainer, batch, steps=2)
    times = trainer.compile_times
    assert times is not None and times.run_s > 0 and times.n_programs >= 4
    assert set(trainer.trace_counts().values()) == {1}
    again = ReversibleSerialTrainer(*initialised_blocks("one", batch), adam, n_devices=2)
    again.precompile(signature(batch))
    np.testing.assert_allclose(run_steps(again, batch, steps=2), first, rtol=1e-6)
    assert again.compile_times.run_s > 0  # Only the first step's own time, measured once.


def test_precompile_rejects_an_indivisible_batch(batch):
    trainer = ReversibleSerialTrainer(*initialised_blocks("one", batch), adam, n_devices=4)
    bad = tuple(jax.ShapeDtypeStruct((6,) + b.shape[1:], b.dtype) for b in batch)
    with pytest.raises(ValueError, match="n_devices=4"):
        trainer.precompile(bad)


def test_the_abstract_store_implements_what_the_executor_reads_and_nothing_else():
    from revtrain.trainers.block.precompile import AbstractStore
    from revtrain.trainers.block.stores import HeldValues, StepValues

    def methods(cls):
        return {name for name in vars(cls) if not name.startswith("_")}
    assert methods(AbstractStore) == methods(StepValues)
    assert not methods(AbstractStore) & methods(HeldValues)


def test_n_equations_counts_the_equations_nested_in_loops():
    def body(c, t):
        return c * t + 1.0, c

    x = np.float32(1.0)
    flat = jax.make_jaxpr(lambda x: x * 2.0 + 1.0)(x).jaxpr
    scanned = jax.make_jaxpr(lambda x: jax.lax.scan(body, x, np.arange(3.0, dtype=np.float32))
                             )(x).jaxpr
    inner = jax.make_jaxpr(body)(x, x).jaxpr
    assert n_equations(flat) == len(flat.eqns) == 2
    assert len(scanned.eqns) == 1  # The scan, and its body's equations.
    assert n_equations(scanned) == 1 + len(inner.eqns) == 3


def test_compile_all_compiles_the_largest_program_first():
    def small(x):
        return x + 1.0

    def large(x):
        for _ in range(20):
            x = jax.numpy.sin(x) * 2.0
        return x

    names = []

    def record(event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            names.append(kwargs.get("fun_name"))
    arg = jax.ShapeDtypeStruct((3,), np.float32)
    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        compile_all([(jax.jit(small), (arg,)), (jax.jit(large), (arg,))], max_workers=1)
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    assert names == ["jit(large)", "jit(small)"]


def test_compile_all_compiles_in_the_calling_thread_while_the_persistent_cache_is_on():
    """Loading cached executables side by side is not shown safe (a crash with two threads
    in ``deserialize_executable`` was put down to it, though the memory-mapping limit is
    the likelier cause): with the cache on (as in this suite, `tests.conftest`) every
    compile request comes from the caller's thread, however many workers are asked for."""
    assert jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
    assert compile_workers(4) == 1
    threads = []

    def record(event, **kwargs):
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            threads.append(threading.get_ident())

    def program(k):
        return jax.jit(lambda x: jax.numpy.cos(x) * k + 1.0)
    arg = jax.ShapeDtypeStruct((5, 3), np.float32)
    jax.monitoring.register_event_listener(record)
    try:
        compile_all([(program(k), (arg,)) for k in range(4)], max_workers=4)
    finally:
        jax.monitoring.unregister_event_listener(record)
    assert threads == [threading.get_ident()] * 4


def test_compile_workers_allows_side_by_side_only_without_the_persistent_cache():
    assert compile_workers(3) == 1  # This suite's cache is on.
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        assert [compile_workers(n) for n in (0, 1, 3)] == [1, 1, 3]
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
    assert compile_workers(3) == 1
