"""Tests of revtrain.planning.cost: the work counted on a program's jaxpr."""
import jax
import jax.numpy as jnp
import pytest

from revtrain.planning.cost import DeviceRates, Work, program_work


def test_a_scan_counts_its_body_times_its_length_where_xla_counts_it_once():
    def f(w, x):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, w)[0].sum()
    args = (jax.ShapeDtypeStruct((8, 64, 64), jnp.float32),
            jax.ShapeDtypeStruct((16, 64), jnp.float32))
    work = program_work(jax.jit(f), args)
    assert work.dot_flops == 8 * 2 * 16 * 64 * 64
    xla = jax.jit(f).lower(*args).compile().cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    assert xla["flops"] < work.dot_flops / 4  # Why the jaxpr is counted instead.


def test_an_update_written_in_place_counts_the_update_not_the_buffer():
    def fill(n, k=256):
        def body(s, i):
            return jax.lax.dynamic_update_slice(s, jnp.full((1, k), i, jnp.float32),
                                                (i, 0)), None
        f = jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(n))[0])
        return program_work(f, (jax.ShapeDtypeStruct((n, k), jnp.float32),)).elements
    # Linear in the depth (the full-size count grew with its square).
    assert fill(64) == pytest.approx(2 * fill(32), rel=0.05)


def test_each_trainer_pays_its_own_dispatch_cost():
    rates = DeviceRates(flops_per_s=1e9, elements_per_s=1e9, dispatch_s=1e-5,
                        host_bytes_per_s=1e9, device="test", block_dispatch_s=1e-3,
                        host_dispatch_s=2e-3)
    work = Work(1e9, 0.0)
    assert rates.step_seconds(work, 10) == pytest.approx(1.0 + 1e-4)
    assert rates.step_seconds(work, 10, trainer="ReversibleSerialTrainer") == \
        pytest.approx(1.01)
    assert rates.step_seconds(work, 10, 10**9, "MemoryEfficientTrainer") == \
        pytest.approx(2.02)
