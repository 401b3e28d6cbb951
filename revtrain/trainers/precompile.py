"""Compiling a block trainer's per-layer programs ahead of the first step, concurrently.

A block trainer's first step traces and compiles each distinct per-layer function (one per
kind and layer structure, `revtrain.trainers.fbo.FnCache`) the first time the schedule
reaches it, one after another. `BlockTrainer.precompile` instead walks the schedule once
*abstractly* -- every op on `jax.ShapeDtypeStruct` values carrying the shardings the real
values have, through `AbstractStore` and ``jax.eval_shape`` -- which traces each function
once and gives the exact abstract arguments of every call; then it lowers and compiles the
distinct ``(function, arguments)`` pairs in a thread pool (XLA compiles without holding
the GIL, so the programs compile side by side on the host's cores). ``jit(...).lower(
...).compile()`` fills the same in-process caches a call fills, so the step that follows
calls the already compiled executables: nothing is traced or compiled again (the trainers'
``trace_counts`` and a "no compile in the first step" test check it).

JAX's persistent compilation cache serves these compilations too: enable it before
building the trainer, e.g.::

    jax.config.update("jax_compilation_cache_dir", "/path/to/cache")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

and a second process with the same model, batch shape and device count loads the
executables from disk instead of compiling them.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from revtrain.trainers import devices
from revtrain.trainers.protocols import DeviceFootprint, Params, TrainState


class CompileTimes(NamedTuple):
    """Where the time of a first step went, in seconds (wall clock).

    Attributes:
      trace_s: tracing every distinct per-layer function (the abstract walk).
      compile_s: lowering and compiling them all, side by side in a thread pool.
      run_s: running the first step itself once everything was compiled (until its
        loss was ready); NaN until a step ran.
      n_programs: how many distinct programs were compiled.
    """

    trace_s: float
    compile_s: float
    run_s: float
    n_programs: int


def _sds(tree: Any, sharding: Any, lead: tuple[int, ...] = ()) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(lead + tuple(np.shape(a)),
                                                       a.dtype, sharding=sharding), tree)


class AbstractStore:
    """A `revtrain.trainers.protocols.ParamStore` of abstract values (no buffers).

    Weights and slots are `jax.ShapeDtypeStruct` trees in the stores' sharding
    (`revtrain.trainers.devices.value_shardings`: replicated, or FSDP-sharded), states
    per device (``[devices of the mesh, ...]``), as the real stores hand them to the
    compiled functions; new states are kept so that reverse ops see them; updates are
    dropped (their shapes do not change). Stashing is the identity.

    Args:
      mesh: the trainer's mesh.
      signature: the trainer's `TrainState` of shapes and dtypes (one entry per layer).
      fsdp: whether the trainer shards weights and slots (its ``fsdp``).
    """

    def __init__(self, mesh: Mesh, signature: TrainState, fsdp: bool = False):
        def placed(tree):
            shardings = devices.value_shardings(tree, mesh, fsdp)
            return jax.tree.map(lambda a, sharding: jax.ShapeDtypeStruct(
                np.shape(a), a.dtype, sharding=sharding), tree, shardings)

        self._weights = [placed(w) for w in signature.weights]
        self._slots = [placed(s) for s in signature.slots]
        rows = (mesh.devices.size,)
        self._states = [_sds(s, devices.per_device(mesh), rows) for s in signature.state]
        self._new_states: list[Any] = [None] * len(self._states)

    def begin_step(self) -> None:
        pass

    def prepare(self, position: int) -> None:
        pass

    def weights(self, i: int) -> Any:
        return self._weights[i]

    def params(self, i: int) -> Params:
        return Params(self._weights[i], self._slots[i])

    def keep_params(self, i: int, params: Params) -> None:
        pass

    def state(self, i: int) -> Any:
        return self._states[i]

    def new_state(self, i: int) -> Any:
        return self._new_states[i]

    def keep_state(self, i: int, new_state: Any) -> None:
        self._new_states[i] = new_state

    def stash(self, stack: Any) -> Any:
        return stack

    def unstash(self, kept: Any) -> Any:
        return kept

    def end_forward(self, stack: Any) -> Any:
        return stack

    def finish_step(self) -> None:
        pass

    def host_values(self, part: str) -> tuple:
        raise TypeError("an AbstractStore holds no values")

    def restore(self, train_state: TrainState) -> None:
        raise TypeError("an AbstractStore holds no values")

    def device_footprint(self) -> DeviceFootprint:
        return DeviceFootprint(0, 0, 0)


def abstract_batch(batch_signature: Sequence[Any], mesh: Mesh, n_devices: int) -> tuple:
    """The abstract per-device batch ``[devices of the mesh, batch // n_devices, ...]``
    (``batch`` is this process's; ``n_devices`` its devices).

    Raises:
      ValueError: when the batch size is not divisible by ``n_devices``.
    """
    per_device = devices.per_device(mesh)
    out = []
    for item in batch_signature:
        shape = tuple(np.shape(item))
        if not shape or shape[0] % n_devices:
            raise ValueError(f"batch item of shape {shape} cannot be split over n_devices="
                             f"{n_devices}; use a global batch that is a multiple of "
                             f"{n_devices}")
        out.append(jax.ShapeDtypeStruct((mesh.devices.size, shape[0] // n_devices) + shape[1:],
                                        np.dtype(item.dtype), sharding=per_device))
    return tuple(out)


def abstract_step_inputs(mesh: Mesh, n_devices: int, batch_signature: Sequence[Any],
                         rng_data: np.ndarray, learning_rate: np.ndarray | None
                         ) -> tuple[tuple, dict, Any]:
    """Abstract ``(stack, common, learning rate)`` of a block trainer's step.

    Args:
      mesh, n_devices: the trainer's.
      batch_signature: the global batch's arrays or `jax.ShapeDtypeStruct`s.
      rng_data: any step's per-device, per-layer key data of this process (its shape
        and dtype are used).
      learning_rate: the step's learning-rate argument (a float32 scalar) or None.
    """
    per_device, rows = devices.per_device(mesh), mesh.devices.size
    common = {"rngs": jax.ShapeDtypeStruct((rows,) + rng_data.shape[1:], rng_data.dtype,
                                           sharding=per_device),
              "weight_total": jax.ShapeDtypeStruct((rows,), np.float32,
                                                   sharding=per_device)}
    lr = None if learning_rate is None else jax.ShapeDtypeStruct(
        (), np.float32, sharding=devices.replicated(mesh))
    return abstract_batch(batch_signature, mesh, n_devices), common, lr


class CallRecorder:
    """Stands in for dispatching: records each call and returns ``jax.eval_shape`` of it.

    ``jax.eval_shape`` gives outputs without shardings; the real outputs of the per-layer
    functions have those of their ``out_specs``, so each abstract argument without one
    gets the sharding of its argument group, as `revtrain.trainers.fbo`'s functions
    declare them: per device for the first group (``dev``), replicated for the others.

    Args:
      mesh: the trainer's mesh.
    """

    def __init__(self, mesh: Mesh):
        self.calls: dict[Any, tuple[Callable, tuple]] = {}
        self._per_device = devices.per_device(mesh)
        self._replicated = devices.replicated(mesh)

    def __call__(self, fn: Callable, *args: Any, grouped: bool = True) -> Any:
        """Records ``fn(*args)``; ``grouped`` False: every argument is replicated."""
        args = tuple(_with_sharding(arg, self._per_device if grouped and k == 0
                                    else self._replicated) for k, arg in enumerate(args))
        leaves, treedef = jax.tree.flatten(args)
        key = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                    if isinstance(a, jax.Array) else a for a in leaves)
        self.calls.setdefault((id(fn), treedef, key), (fn, args))
        return jax.eval_shape(fn, *args)


def _with_sharding(tree: Any, sharding: Any) -> Any:
    def put(a):
        if isinstance(a, jax.ShapeDtypeStruct) and a.sharding is None:
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding,
                                        weak_type=a.weak_type)
        return a
    return jax.tree.map(put, tree)


def compile_all(calls: Sequence[tuple[Callable, tuple]],
                max_workers: int | None = None) -> None:
    """Lowers and compiles every ``(jitted function, abstract args)`` in a thread pool.

    Raises:
      Exception: the first error of any compilation (the others still finish).
    """
    workers = max_workers or min(len(calls), os.cpu_count() or 1) or 1
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(lambda f, a: f.lower(*a).compile(), fn, args)
                   for fn, args in calls]
        for future in futures:
            future.result()


def timed(fn: Callable, *args: Any) -> tuple[Any, float]:
    """``(fn(*args), wall seconds)``."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


__all__ = ["AbstractStore", "CallRecorder", "CompileTimes", "abstract_batch",
           "abstract_step_inputs", "compile_all"]
