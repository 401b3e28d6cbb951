"""Tests for revtrain.memory: live-array accounting, the ledger, track_peak, formatting."""

import gc
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from revtrain import memory

MIB = 1024 * 1024


class CountingJit:
    """A jitted function that counts how often it is lowered."""

    def __init__(self, fn, **jit_kwargs):
        self.jitted = jax.jit(fn, **jit_kwargs)
        self.n_lowerings = 0

    def __call__(self, *args):
        return self.jitted(*args)

    def lower(self, *args):
        self.n_lowerings += 1
        return self.jitted.lower(*args)


def _outer_sort(x):
    # A sort cannot fuse with the outer product, so the [n, n] matrix is a real temporary
    # (a bare jnp.sum(jnp.outer(x, x)) fuses on CPU and needs no temporary at all).
    return jnp.sum(jnp.sort(jnp.outer(x, x), axis=0))


def _put(shape, device, dtype=np.float32):
    return jax.device_put(np.ones(shape, dtype), device)


def test_live_device_bytes_counts_new_array_exactly_and_drops_after_delete():
    device = jax.devices()[0]
    _put((3,), device).delete()  # Warm up device_put.
    before, other_before = (memory.live_device_bytes(d) for d in jax.devices()[:2])
    array = _put((1000,), device)
    assert memory.live_device_bytes(device) - before == 4000
    assert memory.live_device_bytes(jax.devices()[1]) == other_before
    array.delete()
    assert memory.live_device_bytes(device) == before


def test_live_device_bytes_counts_only_the_local_shard_once():
    devices = jax.devices()[:4]
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
    before = [memory.live_device_bytes(d) for d in devices]
    array = jax.device_put(np.ones((8, 256), np.float32), NamedSharding(mesh, P("batch")))
    views = [shard.data for shard in array.addressable_shards]  # Also in jax.live_arrays().
    after = [memory.live_device_bytes(d) for d in devices]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2 * 256 * 4] * 4
    del views
    array.delete()
    assert [memory.live_device_bytes(d) for d in devices] == before


def test_live_device_bytes_counts_a_replicated_copy_per_device():
    devices = jax.devices()[:4]
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
    before = memory.live_device_bytes(devices[2])
    array = jax.device_put(np.ones((64,), np.float32), NamedSharding(mesh, P()))
    assert memory.live_device_bytes(devices[2]) - before == 256
    array.delete()


def test_live_device_bytes_exclude_skips_those_buffers():
    device = jax.devices()[0]
    before = memory.live_device_bytes(device)
    kept, skipped = _put((100,), device), _put((50,), device)
    assert memory.live_device_bytes(device, exclude={"data": skipped}) - before == 400
    kept.delete()
    skipped.delete()


def test_allocator_stats_are_none_on_cpu():
    assert memory.peak_bytes() is None
    assert memory.bytes_in_use(jax.devices()[1]) is None


def test_ledger_peak_includes_compiled_temporary():
    # Arrays an earlier test left in reference cycles would be freed when lowering below
    # triggers the garbage collector, between the two measurements: free them first.
    gc.collect()
    ledger = memory.MemoryLedger(jax.devices()[0])
    x = _put((1024,), jax.devices()[0])
    live = memory.live_device_bytes(jax.devices()[0])
    entry = ledger.record("outer", jax.jit(_outer_sort), (x,))
    assert entry.fn_bytes >= 4 * MIB  # float32[1024, 1024] temporary.
    assert entry.live_bytes == live
    ledger.record("after")
    assert ledger.peak_bytes == entry.total_bytes >= 4 * MIB + 4096
    assert ledger.peak_label == "outer"
    assert [e.label for e in ledger.entries] == ["outer", "after"]


def test_ledger_fn_bytes_of_a_sharded_function_are_per_device():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("batch",))
    x = jax.device_put(np.ones((8, 128), np.float32), NamedSharding(mesh, P("batch")))
    pairwise = jax.jit(jax.shard_map(
        lambda a: jnp.sort(a[:, :, None] * a[:, None, :], axis=1).sum(1),
        mesh=mesh, in_specs=P("batch"), out_specs=P("batch")))
    fn_bytes = memory.MemoryLedger().fn_bytes(pairwise, (x,))
    per_device_temp = 2 * 128 * 128 * 4  # float32[2, 128, 128] on each of 4 devices.
    assert per_device_temp <= fn_bytes < 2 * per_device_temp


def test_ledger_lowers_once_per_signature():
    fn = CountingJit(_outer_sort)
    ledger = memory.MemoryLedger()
    x = jnp.ones(256)
    for _ in range(5):
        ledger.record("step", fn, (x,))
    assert fn.n_lowerings == 1
    ledger.record("step", fn, (jnp.ones(128),))
    assert fn.n_lowerings == 2
    assert ledger.n_records == 6


def test_ledger_abstracts_python_scalars_and_handles_static_args():
    scaled = CountingJit(lambda x, s: x * s)
    ledger = memory.MemoryLedger()
    x = jnp.ones(16)
    ledger.record("a", scaled, (x, 0.1))
    ledger.record("b", scaled, (x, 0.2))
    assert scaled.n_lowerings == 1
    static = jax.jit(lambda x, n: jnp.tile(x, n), static_argnums=1)
    assert ledger.record("static", static, (x, 3)).fn_bytes == 3 * 16 * 4


def test_ledger_does_not_count_outputs_aliased_to_donated_inputs():
    ledger = memory.MemoryLedger()
    x = jnp.ones(1024)
    plain = jax.jit(lambda a: a * 2)
    donating = jax.jit(lambda a: a * 2, donate_argnums=0)
    assert ledger.fn_bytes(plain, (x,)) == 4096
    assert ledger.fn_bytes(donating, (x,)) == 0


def test_ledger_keeps_bounded_history_and_resets():
    ledger = memory.MemoryLedger(max_entries=3)
    big = _put((2048,), ledger.device)
    ledger.record("big")
    big.delete()
    for i in range(5):
        ledger.record(f"small{i}")
    assert [e.label for e in ledger.entries] == ["small2", "small3", "small4"]
    assert ledger.peak_label == "big"
    ledger.reset()
    assert (ledger.peak_bytes, ledger.peak_label, ledger.entries) == (0, None, ())
    with pytest.raises(ValueError, match="max_entries=0"):
        memory.MemoryLedger(max_entries=0)


def test_ledger_rejects_a_function_without_lower():
    with pytest.raises(TypeError, match="jax.jit"):
        memory.MemoryLedger().record("x", lambda a: a, (jnp.ones(2),))


class FakeTrainer:
    """Mimics a trainer's observer list: tells each observer of each dispatch."""

    def __init__(self):
        self.observers = []
        self.fn = jax.jit(_outer_sort)

    def one_step(self, x):
        for observer in self.observers:
            observer.on_dispatch("outer_sort", self.fn, (x,))
        return self.fn(x)


def test_track_peak_adds_and_removes_its_ledger_on_cpu():
    trainer = FakeTrainer()
    other = memory.MemoryLedger()
    trainer.observers.append(other)
    x = jnp.ones(1024)
    with memory.track_peak(trainer) as report:
        assert len(trainer.observers) == 2
        assert isinstance(trainer.observers[1], memory.MemoryLedger)
        float(trainer.one_step(x))
    assert trainer.observers == [other]
    assert report.method == "ledger"
    assert report.peak_bytes >= 4 * MIB
    assert report.peak_label == "outer_sort"
    assert report.peak_rss_bytes >= report.rss_bytes > 0
    assert report.baseline_bytes >= x.nbytes
    assert json.loads(json.dumps(report.to_dict()))["method"] == "ledger"
    assert "outer_sort" in report.summary()


def test_track_peak_removes_its_ledger_after_error():
    trainer = FakeTrainer()
    with pytest.raises(RuntimeError), memory.track_peak(trainer):
        raise RuntimeError("boom")
    assert trainer.observers == []


def test_track_peak_without_trainer_measures_endpoints():
    device = jax.devices()[3]
    with memory.track_peak(device=device) as report:
        kept = _put((4096,), device)
    assert report.method == "ledger_endpoints"
    assert report.peak_bytes - report.baseline_bytes == 4096 * 4
    assert report.peak_label == "exit"
    assert report.device == str(device)
    kept.delete()


def test_track_peak_rejects_unavailable_method():
    with pytest.raises(ValueError, match="memory_stats"), memory.track_peak(
            method="memory_stats"):
        pass
    with pytest.raises(ValueError, match="'bogus'"), memory.track_peak(method="bogus"):
        pass


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
    (int(12.3 * MIB), "12.3 MiB"), (3 * 1024**3, "3.0 GiB"), (-2048, "-2.0 KiB"),
    (None, "n/a"),
])
def test_format_bytes(n, text):
    assert memory.format_bytes(n) == text
