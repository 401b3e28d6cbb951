"""Peak accelerator memory measurement: allocator statistics, or a ledger on CPU.

Every figure here is in **bytes** and every report names the method that produced it:

* ``'memory_stats'`` -- GPU/TPU allocator statistics (``device.memory_stats()``):
  ``peak_bytes_in_use`` is the allocator's high-water mark, the real answer. It counts
  from process start and *cannot be reset*, so a benchmark runs each configuration in a
  fresh process (with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``).
* ``'ledger'`` -- on CPU ``memory_stats()`` is None, so a `MemoryLedger`, added to the
  trainer's observers (``on_dispatch``/``on_phase``), estimates the bytes in use at each
  dispatch: the live arrays on the device (``jax.live_arrays()``) plus the compiled
  function's ``memory_analysis()`` temporaries and non-aliased outputs. It ignores
  allocator fragmentation and XLA-internal buffers outside ``temp``: a lower bound.
* ``'ledger_endpoints'`` -- on CPU without a trainer to observe, only the live bytes at
  the entry and exit of the measured block; the transient peak inside it is not seen.

On CPU "device memory" is host RAM: reports also carry peak and current RSS (psutil).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import resource
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import psutil

METHOD_MEMORY_STATS = "memory_stats"
METHOD_LEDGER = "ledger"
METHOD_LEDGER_ENDPOINTS = "ledger_endpoints"
DEFAULT_MAX_ENTRIES = 10_000

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _resolve_device(device: jax.Device | None) -> jax.Device:
    return jax.local_devices()[0] if device is None else device


def _stat(device: jax.Device | None, key: str) -> int | None:
    stats = _resolve_device(device).memory_stats()
    if not stats or key not in stats:
        return None
    return int(stats[key])


def peak_bytes(device: jax.Device | None = None) -> int | None:
    """Returns the allocator's high-water mark on ``device``, in bytes, or None.

    Args:
        device: a `jax.Device`; default the first local device.

    Returns:
        ``device.memory_stats()['peak_bytes_in_use']`` (since process start; it cannot be
        reset), or None when the backend keeps no statistics (CPU).
    """
    return _stat(device, "peak_bytes_in_use")


def bytes_in_use(device: jax.Device | None = None) -> int | None:
    """Returns the allocator's current bytes in use on ``device``, or None on CPU."""
    return _stat(device, "bytes_in_use")


def _buffer_key(shard_data: jax.Array) -> int:
    try:
        return shard_data.unsafe_buffer_pointer()
    except Exception:  # Backends without raw pointers: count the shard without deduplication.
        return id(shard_data)


def _device_buffers(arrays: Iterable[Any], device: jax.Device) -> dict[int, int]:
    """Maps buffer key -> nbytes of the shards of ``arrays`` held in ``device``'s memory.

    Shards in a non-default memory space (e.g. ``pinned_host``) are host memory and are
    skipped. Keys are buffer addresses, so views of one buffer (``shard.data`` arrays,
    which ``jax.live_arrays()`` also lists) count once.
    """
    default_kind = device.default_memory().kind
    buffers = {}
    for array in arrays:
        if not isinstance(array, jax.Array) or array.is_deleted():
            continue
        memory_kind = getattr(array.sharding, "memory_kind", None)
        if memory_kind not in (None, default_kind):
            continue
        for shard in array.addressable_shards:
            if shard.device == device:
                buffers[_buffer_key(shard.data)] = shard.data.nbytes
    return buffers


def live_device_bytes(device: jax.Device | None = None, exclude: Iterable[Any] = ()) -> int:
    """Returns the bytes of all live jax arrays held on ``device``.

    Each addressable shard on ``device`` counts its ``nbytes`` (a replicated array counts
    one full copy per device; an array sharded over 4 devices counts only the quarter held
    here). A buffer seen through several array objects counts once.

    Args:
        device: a `jax.Device`; default the first local device.
        exclude: arrays (or pytrees of arrays) whose buffers are not counted, e.g. a
            benchmark's own input data.

    Returns:
        Bytes, an int >= 0.
    """
    device = _resolve_device(device)
    buffers = _device_buffers(jax.live_arrays(), device)
    for key in _device_buffers(jax.tree.leaves(exclude), device):
        buffers.pop(key, None)
    return sum(buffers.values())


def peak_rss_bytes() -> int:
    """Returns this process's peak resident set size since start, in bytes.

    ``ru_maxrss`` (KiB on Linux, bytes on macOS); the kernel updates its high-water mark
    lazily, so the result is at least the current RSS.
    """
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    max_rss = max_rss if sys.platform == "darwin" else max_rss * 1024
    return max(int(max_rss), rss_bytes())


def rss_bytes() -> int:
    """Returns this process's current resident set size in bytes (psutil)."""
    return int(psutil.Process().memory_info().rss)


def format_bytes(n: int | None) -> str:
    """Formats a byte count with binary units, e.g. ``format_bytes(12_897_485) == '12.3 MiB'``.

    Counts below 1 KiB print exactly (``'512 B'``); None prints as ``'n/a'``.
    """
    if n is None:
        return "n/a"
    value, unit = float(abs(n)), 0
    while value >= 1024 and unit < len(_BYTE_UNITS) - 1:
        value /= 1024
        unit += 1
    sign = "-" if n < 0 else ""
    if unit == 0:
        return f"{sign}{int(value)} B"
    return f"{sign}{value:.1f} {_BYTE_UNITS[unit]}"


class LedgerEntry(NamedTuple):
    """One ledger measurement, in bytes.

    Attributes:
        label: what was about to run (given by the caller, e.g. ``'fbo layer 3'``).
        live_bytes: live array bytes on the device just before the dispatch.
        fn_bytes: the compiled function's temporaries plus non-aliased outputs (0 when no
            function was given).
    """

    label: str
    live_bytes: int
    fn_bytes: int

    @property
    def total_bytes(self) -> int:
        """Estimated device bytes in use during the dispatch: ``live_bytes + fn_bytes``."""
        return self.live_bytes + self.fn_bytes


def _abstract_leaf(leaf: Any) -> Any:
    """An array becomes a ShapeDtypeStruct (with its sharding); a Python scalar a weak one."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):  # jax/numpy arrays and scalars.
        sharding = leaf.sharding if isinstance(leaf, jax.Array) else None
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding,
                                    weak_type=getattr(leaf, "weak_type", False))
    if isinstance(leaf, bool | int | float | complex):
        return jax.ShapeDtypeStruct((), jnp.result_type(leaf), weak_type=True)
    return leaf


def _signature_key(leaf: Any) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return (leaf.shape, str(leaf.dtype), leaf.sharding, leaf.weak_type)
    try:
        hash(leaf)
    except TypeError:
        return ("unhashable", id(leaf))
    return leaf


def compiled_fn_bytes(fn: Callable[..., Any], args: tuple[Any, ...]) -> int:
    """Returns temp + output - alias bytes of ``fn`` compiled for ``args`` (per device).

    Lowers from abstract arguments (`jax.ShapeDtypeStruct` with the args' shardings), so no
    buffer is copied or kept alive. If that fails (e.g. a static argument), lowers with the
    concrete arguments instead. For an SPMD (sharded) function the sizes are per device.

    Raises:
        TypeError: ``fn`` has no ``.lower`` (it is not a ``jax.jit``-wrapped function).
    """
    if not hasattr(fn, "lower"):
        raise TypeError(f"fn={fn!r} has no .lower(); pass the jax.jit-wrapped function")
    try:
        lowered = fn.lower(*jax.tree.map(_abstract_leaf, tuple(args)))
    except Exception:  # A static or otherwise non-abstractable argument.
        lowered = fn.lower(*args)
    stats = lowered.compile().memory_analysis()
    if stats is None:
        return 0
    alias = getattr(stats, "alias_size_in_bytes", 0)
    return int(stats.temp_size_in_bytes + max(stats.output_size_in_bytes - alias, 0))


class MemoryLedger:
    """Estimates peak device bytes from live arrays and compiled functions' footprints.

    Each `record` call measures ``live_device_bytes(device)`` and, if a jitted ``fn`` is
    given, adds ``compiled_fn_bytes(fn, args)``: temporaries plus outputs not aliased to
    donated inputs. Called just before a dispatch, the sum estimates the bytes in use
    while that function runs. The analysis is cached per (fn, abstract signature of args),
    so repeated dispatches lower and compile once.

    Limits: allocator fragmentation and XLA-internal buffers outside ``temp`` are not
    seen, and arrays freed or created between two records are invisible, so the peak is
    an estimate (a lower bound) sampled at the recorded points. On CPU, device memory is
    host RAM.

    Attributes:
        device: the measured `jax.Device`.
        peak_bytes: the largest ``total_bytes`` recorded so far (0 before any record).
        peak_label: the label of that record (None before any record).
        peak_entry: that `LedgerEntry` (None before any record).
        n_records: the number of `record` calls since construction or `reset`.
    """

    def __init__(self, device: jax.Device | None = None,
                 max_entries: int = DEFAULT_MAX_ENTRIES):
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries} must be >= 1; e.g. use 10_000")
        self.device = _resolve_device(device)
        self._entries = collections.deque(maxlen=max_entries)
        self._fn_bytes_cache = {}
        self.reset()

    def reset(self) -> None:
        """Forgets all records and the peak; keeps the compiled-function cache."""
        self._entries.clear()
        self.peak_entry = None
        self.n_records = 0

    @property
    def peak_bytes(self) -> int:
        return 0 if self.peak_entry is None else self.peak_entry.total_bytes

    @property
    def peak_label(self) -> str | None:
        return None if self.peak_entry is None else self.peak_entry.label

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        """The most recent records (at most ``max_entries``), oldest first."""
        return tuple(self._entries)

    def fn_bytes(self, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> int:
        """Returns `compiled_fn_bytes` for ``fn`` and ``args``, cached by abstract signature."""
        leaves, treedef = jax.tree.flatten(tuple(args))
        key = (fn, treedef, tuple(_signature_key(_abstract_leaf(x)) for x in leaves))
        if key not in self._fn_bytes_cache:
            self._fn_bytes_cache[key] = compiled_fn_bytes(fn, tuple(args))
        return self._fn_bytes_cache[key]

    def record(self, label: str, fn: Callable[..., Any] | None = None,
               args: tuple[Any, ...] = ()) -> LedgerEntry:
        """Measures the device now (and ``fn``'s footprint for ``args``); returns the entry.

        Args:
            label: what is about to run, kept with the entry and reported for the peak.
            fn: a ``jax.jit``-wrapped callable about to be dispatched, or None at a phase
                boundary.
            args: the positional arguments ``fn`` will be called with (arrays, numpy
                arrays, scalars; only their shapes, dtypes and shardings are used).

        Returns:
            The `LedgerEntry`; ``entry.total_bytes`` is the estimate in bytes.
        """
        fn_bytes = 0 if fn is None else self.fn_bytes(fn, args)
        entry = LedgerEntry(label, live_device_bytes(self.device), fn_bytes)
        self._entries.append(entry)
        self.n_records += 1
        if self.peak_entry is None or entry.total_bytes > self.peak_entry.total_bytes:
            self.peak_entry = entry
        return entry

    def on_dispatch(self, label: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Trainer observer hook (`revtrain.trainers.Observer`): `record` ``fn``'s dispatch."""
        self.record(label, fn, args)

    def on_phase(self, label: str) -> None:
        """Trainer observer hook: `record` a phase boundary (no function)."""
        self.record(label)


@dataclasses.dataclass
class MemoryReport:
    """Peak memory of a block of work; all sizes in bytes.

    Attributes:
        peak_bytes: peak device bytes found by ``method``.
        method: ``'memory_stats'``, ``'ledger'`` or ``'ledger_endpoints'`` (module doc).
        peak_rss_bytes: the process's peak RSS since start (``ru_maxrss``), at exit.
        rss_bytes: the process's current RSS at exit (psutil).
        baseline_bytes: device bytes in use at entry (allocator or live arrays).
        peak_label: the ledger label at the peak (None with ``'memory_stats'``).
        device: the measured device, as text.
    """

    peak_bytes: int = 0
    method: str = ""
    peak_rss_bytes: int = 0
    rss_bytes: int = 0
    baseline_bytes: int = 0
    peak_label: str | None = None
    device: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Returns the fields as a JSON-serialisable dict."""
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """One line, e.g. ``'peak 12.3 MiB (ledger at fbo layer 3; baseline 1.0 MiB)...'``."""
        where = f" at {self.peak_label}" if self.peak_label else ""
        return (f"peak {format_bytes(self.peak_bytes)} ({self.method}{where}; baseline "
                f"{format_bytes(self.baseline_bytes)}) on {self.device}; process peak RSS "
                f"{format_bytes(self.peak_rss_bytes)}, RSS {format_bytes(self.rss_bytes)}")


def _choose_method(device: jax.Device, trainer: Any, method: str | None) -> str:
    choices = (METHOD_MEMORY_STATS, METHOD_LEDGER)
    if method is None:
        method = METHOD_MEMORY_STATS if peak_bytes(device) is not None else METHOD_LEDGER
    if method not in choices:
        raise ValueError(f"method={method!r} is not one of {choices}; or pass None (auto)")
    if method == METHOD_MEMORY_STATS and peak_bytes(device) is None:
        raise ValueError(f"method='memory_stats' but {device} has no memory_stats(); "
                         "use method='ledger' or None")
    if method == METHOD_LEDGER and trainer is None:
        return METHOD_LEDGER_ENDPOINTS
    return method


@contextlib.contextmanager
def track_peak(trainer: Any = None, device: jax.Device | None = None,
               method: str | None = None) -> Iterator[MemoryReport]:
    """Measures the peak device bytes of the enclosed block; yields a report filled on exit.

    With ``memory_stats`` (GPU/TPU) the report gives ``peak_bytes_in_use``, which counts
    from process start and cannot be reset: run each configuration in a fresh process.
    Otherwise (CPU) a `MemoryLedger` is added to ``trainer.observers`` for the block
    (removed on exit, also on error) and its peak is reported; without a trainer only the
    live bytes at entry and exit are compared (``'ledger_endpoints'``).

    Args:
        trainer: an object with an ``observers`` list whose members it tells of its
            dispatches (any revtrain trainer), or None.
        device: the `jax.Device` to measure; default the first local device.
        method: ``'memory_stats'``, ``'ledger'`` or None to choose by backend.

    Yields:
        A `MemoryReport`, complete once the block exits.

    Raises:
        ValueError: ``method`` is unknown, or ``'memory_stats'`` on a backend without it.
    """
    device = _resolve_device(device)
    method = _choose_method(device, trainer, method)
    report = MemoryReport(method=method, device=str(device))
    if method == METHOD_MEMORY_STATS:
        report.baseline_bytes = bytes_in_use(device) or 0
        yield report
        report.peak_bytes = peak_bytes(device) or 0
    else:  # The ledger is an observer of the trainer for the block, removed on any exit.
        ledger = MemoryLedger(device)
        ledger.record("enter")
        report.baseline_bytes = ledger.peak_bytes
        if trainer is not None:
            trainer.observers.append(ledger)
        try:
            yield report
        finally:
            if trainer is not None:
                trainer.observers.remove(ledger)
        ledger.record("exit")
        report.peak_bytes, report.peak_label = ledger.peak_bytes, ledger.peak_label
    report.rss_bytes = rss_bytes()
    report.peak_rss_bytes = max(peak_rss_bytes(), report.rss_bytes)
