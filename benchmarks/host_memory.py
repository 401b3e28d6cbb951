"""Peak process RSS (host memory) and step time of the trainers, by depth.

Usage (from the repository root)::

    python benchmarks/host_memory.py                       # depths 16,32, block trainers
    python benchmarks/host_memory.py --depths=32 --env=MALLOC_ARENA_MAX=2
    python benchmarks/host_memory.py --quick               # tiny sizes, seconds

Defaults are Trax's reformer benchmark sizes (batch 8, sequence 256, d_model 256, d_ff
1024, vocab 256, Adam). Each (trainer, depth) runs in a fresh process (see
`benchmarks.harness`), so high-water marks do not carry over. Reported per configuration:

* ``peak_rss_bytes`` -- the process's peak resident set (``ru_maxrss``) after the build,
  ``--warmup`` steps and ``--steps`` measured steps; ``rss_after_build_bytes`` and
  ``rss_end_bytes`` beside it;
* ``phase_rss_bytes`` -- RSS at each phase of the last step (the trainers' ``on_phase``
  labels: ``step_start``, ``loss_start``, ``backward_start``, ``step_end``);
* ``heap_*_bytes`` -- glibc ``mallinfo2()`` at the end (in use, free but kept by malloc,
  mmapped): a large ``heap_free_bytes`` means freed memory the allocator did not return to
  the system (fragmentation), not live data;
* ``median_step_s`` -- median wall time of the measured steps, each until
  ``trainer.block_until_ready()`` returns; ``median_cpu_s``, the process's CPU time per
  step (all threads), which other processes on a shared machine inflate far less.

``--env=NAME=VALUE`` sets environment variables of the worker processes (e.g. glibc's
``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``, or ``LD_PRELOAD`` of another allocator), to
compare allocator settings with one command; any of these leaves the allocator untuned
(`revtrain.host_heap.user_malloc_settings`), and the settings line says which allocator
the workers ran. Writes ``host_memory.json`` and ``.md`` to ``--out_dir``.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # Run as a script: make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import flags  # noqa: E402

from benchmarks import harness, report  # noqa: E402
from revtrain import host_heap  # noqa: E402

flags.adopt_module_key_flags(harness)
flags.DEFINE_list("env", [], "NAME=VALUE environment variables for the worker processes")


@flags.validator("env")
def _check_env(items: list[str]) -> bool:
    """Every item is ``NAME=VALUE``; a ``REVTRAIN_HOST_ALLOCATOR`` value is valid."""
    for item in items:
        name, sep, value = item.partition("=")
        if not (sep and name):
            raise flags.ValidationError(f"--env item {item!r} is not NAME=VALUE, e.g. "
                                        f"MALLOC_ARENA_MAX=2")
        if name == host_heap.HOST_ALLOCATOR_ENV:
            try:
                host_heap.parse_host_allocator(value)
            except ValueError as e:
                raise flags.ValidationError(str(e)) from None
    return True

NAME = "host_memory"
DEFAULTS = {"depths": [16, 32], "seq_len": 256, "trainers": ["reversible", "memory_efficient"]}


# ------------------------------------------------------------------------------------------
# Worker side.

class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap_info() -> dict[str, int]:
    """glibc ``mallinfo2()``: heap bytes in use, free-but-kept and mmapped; {} elsewhere."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return {"heap_in_use_bytes": info.uordblks, "heap_free_bytes": info.fordblks,
            "heap_mmapped_bytes": info.hblkhd}


def rss_bytes() -> int:
    from revtrain import memory
    return memory.rss_bytes()


def peak_rss_bytes() -> int:
    """The process's peak RSS so far, at least the current RSS (`revtrain.memory`)."""
    from revtrain import memory
    return memory.peak_rss_bytes()


class _PhaseRss:
    """A trainer observer that records RSS at every phase of a step."""

    def __init__(self):
        self.records: dict[str, int] = {}

    def on_phase(self, label: str) -> None:
        self.records[label] = rss_bytes()


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """Builds the configured trainer, runs its steps; returns RSS figures and step times."""
    import jax
    trainer, batch = harness.build(config)
    after_build = rss_bytes()
    phases = _PhaseRss()
    trainer.observers.append(phases)
    times, cpu_times = [], []
    for step in range(config["warmup"] + config["steps"]):
        start, cpu_start = time.perf_counter(), time.process_time()
        out = trainer.one_step(batch, jax.random.key(step))
        if hasattr(trainer, "block_until_ready"):
            trainer.block_until_ready()
        else:  # An older checkout: wait for the loss and stats.
            jax.block_until_ready(out)
        if step >= config["warmup"]:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    end = rss_bytes()  # Before the peak, which is then at least this.
    return {"peak_rss_bytes": peak_rss_bytes(), "rss_after_build_bytes": after_build,
            "rss_end_bytes": end, "phase_rss_bytes": phases.records,
            **heap_info(), "median_step_s": statistics.median(times),
            "median_cpu_s": statistics.median(cpu_times),
            "env": {k: os.environ[k] for k in config["env"]}}


# ------------------------------------------------------------------------------------------
# Parent side.

def _describe(r: dict[str, Any]) -> str:
    return (f"peak RSS {report.mib(r['peak_rss_bytes'])} MiB, end "
            f"{report.mib(r['rss_end_bytes'])} MiB, heap free "
            f"{report.mib(r.get('heap_free_bytes'))} MiB, step {r['median_step_s']:.3f} s")


def markdown(payload: dict[str, Any]) -> str:
    rows = [[harness.TRAINERS[r["trainer"]], r["depth"], report.mib(r["peak_rss_bytes"]),
             report.mib(r["rss_after_build_bytes"]), report.mib(r["rss_end_bytes"]),
             report.mib(r.get("heap_free_bytes")), f"{r['median_step_s']:.3f}",
             f"{r['median_cpu_s']:.2f}"]
            for r in payload["results"] if "error" not in r]
    env = " ".join(payload["env"]) or "none"
    lines = [f"Host memory by depth; {report.settings_line(payload['config'])}; worker "
             f"environment: {env}; {payload['machine']['processor']}, "
             f"{payload['machine']['cpu_count']} cores.", "",
             report.markdown_table(["trainer", "depth", "peak RSS (MiB)",
                                     "RSS after build (MiB)", "RSS at end (MiB)",
                                     "malloc free (MiB)", "median step (s)",
                                     "CPU s/step"], rows)]
    lines += [f"- {harness.TRAINERS[r['trainer']]} depth {r['depth']}: {r['error']}"
              for r in payload["results"] if "error" in r]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs every configuration in a worker process; writes JSON and Markdown."""
    args = harness.parse_flags(argv, steps=3, warmup=2)
    for name, value in DEFAULTS.items():  # This script's defaults for unset flags.
        if not flags.FLAGS[name].present and not (args.quick and name != "trainers"):
            setattr(args, name, value)
    env = dict(item.split("=", 1) for item in args.env)
    saved = dict(os.environ)
    os.environ.update(env)  # harness.worker_env copies this process's environment...
    try:
        configs = [c | {"env": sorted(env)} for c in harness.configurations(args)]
        config, machine = harness.model_config(args), harness.machine_info(args.command)
        print(f"{NAME}: {len(configs)} configurations, {report.settings_line(configs[0])}")
        results = harness.run_all(str(Path(__file__).resolve()), configs, args.timeout,
                                  _describe, args.jobs)
    finally:  # ...for the workers only: the caller's (e.g. a test's) is left as it was.
        os.environ.clear()
        os.environ.update(saved)
    config = harness.with_workers_host_allocator(config, results)
    payload = {"benchmark": NAME, "config": config, "env": args.env,
               "machine": machine, "results": results}
    out = Path(args.out_dir)
    report.write_json(out / f"{NAME}.json", payload)
    (out / f"{NAME}.md").write_text(markdown(payload))
    print(markdown(payload))
    return payload


if __name__ == "__main__":
    harness.script_main(main, measure)
