"""Compiling a set of traced programs: largest first, side by side where that is safe.

`compile_all` compiles a block trainer's distinct per-layer programs before its first
step (`revtrain.trainers.block.precompile`); `compile_workers` is the one rule for how
many programs may compile at once, which the planner's candidate search
(`revtrain.planning.plan`) follows too; `n_equations` is the size measure that orders
them.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr


def compile_workers(wanted: int) -> int:
    """How many programs may compile at once: ``wanted`` (at least 1), or 1 while JAX's
    persistent compilation cache is on (``jax_enable_compilation_cache`` and a
    ``jax_compilation_cache_dir``).

    With the cache on, a compile may be a load from disk. A segmentation fault in the test
    suite's block trainers, with both threads in ``deserialize_executable``, was first put
    down to two loads at once; the same crash in one thread was later traced to the
    process's memory-mapping limit (docs/troubleshooting.md), the likelier cause of both.
    Loading side by side is still not shown safe, and one at a time costs little: a load
    takes milliseconds, and XLA already spreads one
    CPU compile over several threads (side by side, `BlockTrainer.precompile` of the
    depth-8 LM on 2 cores compiled ``ReversibleSerialTrainer``'s 8 programs in 5.3 s
    against 5.65 s one at a time, and ``MemoryEfficientTrainer``'s 11 in no less time).
    """
    cache_on = (jax.config.jax_enable_compilation_cache
                and bool(jax.config.jax_compilation_cache_dir))
    return 1 if cache_on else max(1, wanted)


def compile_all(calls: Sequence[tuple[Callable, tuple]],
                max_workers: int | None = None) -> None:
    """Lowers and compiles every ``(jitted function, abstract args)``, largest first (by
    `n_equations`): in the calling thread when `compile_workers` allows one at a time,
    else in a thread pool of ``max_workers`` (default: one per core, at most one per
    program).

    Side by side, a step's compile time is that of its largest program (a scanned
    reverse-and-fbo) once the others compile beside it: started last, it would begin only
    after the pool's other workers finished their earlier programs (the
    longest-processing-time-first rule). The functions were traced already (the abstract
    walk), so ``trace`` is a cache hit.

    Raises:
      Exception: the first error of any compilation (in a pool, the others still finish).
    """
    traced = sorted((fn.trace(*args) for fn, args in calls),
                    key=lambda t: n_equations(t.jaxpr.jaxpr), reverse=True)
    workers = compile_workers(min(max_workers or os.cpu_count() or 1, len(traced)))
    if workers == 1:
        for t in traced:
            t.lower().compile()
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(lambda t: t.lower().compile(), t) for t in traced]
        for future in futures:
            future.result()


def n_equations(jaxpr: Any) -> int:
    """Equations of ``jaxpr`` and of every jaxpr nested in them (loop bodies, branches,
    calls): a cheap measure of what XLA has to compile."""
    return sum(1 + sum(n_equations(sub) for sub in _nested_jaxprs(eqn.params))
               for eqn in jaxpr.eqns)


def _nested_jaxprs(params: dict[str, Any]) -> list[Any]:
    """The jaxprs among an equation's parameters (a scan's body, a cond's branches, a
    custom_vjp's functions), open ones: the walk works on every JAX `setup.cfg` allows."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, Jaxpr):
                found.append(item)
    return found


def timed(fn: Callable, *args: Any) -> tuple[Any, float]:
    """``(fn(*args), wall seconds)``."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


__all__ = ["compile_all", "compile_workers", "n_equations", "timed"]
