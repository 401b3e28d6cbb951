"""A step-time model: the work of a step's programs, counted on their jaxprs, over rates
measured on the device.

XLA's own ``cost_analysis`` counts a ``while`` loop's body once whatever its trip count
(checked: a scan of 8 matmuls reports the FLOPs of one), and revtrain scans its repeated
layers, so the work is counted here on each program's jaxpr instead (`program_work`):

* ``dot_flops``: ``2 * |output| * |contracted dims|`` of every ``dot_general`` (and the
  same for convolutions), a ``scan`` body counted ``length`` times, a ``cond`` by its
  largest branch, a ``while`` once (its trip count is not static);
* ``elements``: the output elements of every other equation (element-wise work, which on
  a CPU and in small widths is a large share of a step); an update written in place
  (``dynamic_update_slice``, scatters) counts its update, not the buffer.

Both are per device: a program's ``shard_map`` body has per-device shapes. `DeviceRates`
measures the device's matmul FLOP/s, element rate and host transfer rate with small
programs, and the cost of one dispatch: a bare program's, and per program of a tiny
`ReversibleSerialTrainer` and `MemoryEfficientTrainer` step (their executor's and store's
host work; a few seconds in all), and `step_seconds` combines them::

    seconds = dot_flops / flops_per_s + elements / elements_per_s
              + dispatches * (the trainer's dispatch cost) + host_bytes / host_bytes_per_s

A model, not a measurement: ``benchmarks/memory_budget.py`` reports how far it is from
measured step times, and the planner uses it only to rank candidates that fit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

_DOTS = ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general")
# Updates written in place, by the position of the update operand: counted by its size,
# not the whole buffer's (a scan filling a stacked buffer would otherwise count depth^2).
_IN_PLACE = {"dynamic_update_slice": 1, "scatter": 2, "scatter-add": 2, "scatter_add": 2,
             "scatter-mul": 2, "scatter_mul": 2, "scatter-min": 2, "scatter-max": 2}


class Work(NamedTuple):
    """Per-device work of one program call."""

    dot_flops: float = 0.0
    elements: float = 0.0

    def __add__(self, other: Work) -> Work:  # type: ignore[override]
        return Work(self.dot_flops + other.dot_flops, self.elements + other.elements)

    def scaled(self, factor: float) -> Work:
        return Work(self.dot_flops * factor, self.elements * factor)


def _size(aval: Any) -> float:
    return float(math.prod(getattr(aval, "shape", ())))


def _dot_flops(eqn: Any) -> float:
    out = _size(eqn.outvars[0].aval)
    if eqn.primitive.name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        spec = eqn.params["dimension_numbers"].rhs_spec
        return 2.0 * out * math.prod(rhs) / max(rhs[spec[0]], 1)
    if eqn.primitive.name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * out * math.prod(lhs[d] for d in contract)
    return 2.0 * out * eqn.invars[0].aval.shape[-1]  # ragged dots: an estimate.


def _sub_jaxprs(params: dict[str, Any]) -> list[Any]:
    found = []
    for value in params.values():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, jax.extend.core.Jaxpr):
                found.append(v)
    return found


def jaxpr_work(jaxpr: Any) -> Work:
    """The `Work` of a jaxpr (``jax.extend.core.Jaxpr`` or ``ClosedJaxpr``), sub-jaxprs
    included as the module docstring says."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = Work()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = _sub_jaxprs(eqn.params)
        if name in _DOTS:
            total += Work(_dot_flops(eqn), 0.0)
        elif name == "scan":
            total += jaxpr_work(eqn.params["jaxpr"]).scaled(eqn.params["length"])
        elif name == "cond":
            branches = [jaxpr_work(b) for b in eqn.params["branches"]]
            total += max(branches, key=lambda w: (w.dot_flops, w.elements))
        elif subs:
            for sub in subs:
                total += jaxpr_work(sub)
        elif name in _IN_PLACE:  # XLA writes the update into the buffer in place.
            total += Work(0.0, _size(eqn.invars[_IN_PLACE[name]].aval))
        else:
            total += Work(0.0, sum(_size(v.aval) for v in eqn.outvars))
    return total


def program_work(fn: Callable, args: tuple) -> Work:
    """The per-device `Work` of one call of ``fn`` (a jitted function) on abstract
    ``args`` (traced with ``jax.make_jaxpr``; nothing is compiled or run)."""
    return jaxpr_work(jax.make_jaxpr(fn)(*args))


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    """Measured rates of one device (`measure_rates`).

    Attributes:
      flops_per_s: float32 matmul FLOP/s at the given width.
      elements_per_s: output elements per second of a fused element-wise program.
      dispatch_s: seconds of one dispatch of a tiny program, waited for.
      block_dispatch_s: seconds per dispatch of a tiny `ReversibleSerialTrainer` step:
        the block executor's host work per program (arguments, donation, the store).
      host_dispatch_s: the same for a tiny `MemoryEfficientTrainer` step (with each
        op's values going to the device and back).
      host_bytes_per_s: host-to-device bytes per second (``jax.device_put``); on a CPU
        backend, a copy in host memory.
      device: the device, as text.
    """

    flops_per_s: float
    elements_per_s: float
    dispatch_s: float
    host_bytes_per_s: float
    device: str
    block_dispatch_s: float = 0.0
    host_dispatch_s: float = 0.0

    def step_seconds(self, work: Work, dispatches: int, host_bytes: int = 0,
                     trainer: str = "Trainer") -> float:
        """The modelled seconds of a step of ``trainer`` (a class name; module
        docstring): the dispatch cost is the trainer's own, measured."""
        per_dispatch = {"ReversibleSerialTrainer": self.block_dispatch_s,
                        "MemoryEfficientTrainer": self.host_dispatch_s}.get(trainer, 0.0)
        return (work.dot_flops / self.flops_per_s + work.elements / self.elements_per_s
                + dispatches * max(per_dispatch, self.dispatch_s)
                + host_bytes / self.host_bytes_per_s)


def _best_of(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())  # Compiles.
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def measure_rates(width: int = 256, device: jax.Device | None = None) -> DeviceRates:
    """Measures `DeviceRates` on ``device`` (default the first local one) with programs of
    a few MiB (best of 5 each; cached per width and device for the process).

    Args:
      width: the model width the matmul is measured at (``[4 * width, width] @ [width,
        4 * width]``; clipped to 64..2048).
    """
    device = jax.local_devices()[0] if device is None else device
    width = int(min(max(width, 64), 2048))
    key = jax.random.key(0)
    a = jax.device_put(jax.random.normal(key, (4 * width, width), jnp.float32), device)
    b = jax.device_put(jax.random.normal(key, (width, 4 * width), jnp.float32), device)
    matmul = jax.jit(lambda x, y: x @ y)
    flops = 2.0 * (4 * width) * width * (4 * width)
    flops_per_s = flops / _best_of(lambda: matmul(a, b), 5)
    x = jax.device_put(jnp.ones((1 << 20,), jnp.float32), device)
    elementwise = jax.jit(lambda v: jnp.tanh(v * 1.5 + 0.5) * v)
    elements_per_s = float(x.size) / _best_of(lambda: elementwise(x), 5)
    tiny = jax.device_put(jnp.ones((8,), jnp.float32), device)
    add = jax.jit(lambda v: v + 1.0)
    dispatch_s = _best_of(lambda: add(tiny), 20)
    host = np.ones((4 << 20,), np.float32)
    host_bytes_per_s = host.nbytes / _best_of(lambda: jax.device_put(host, device), 5)
    return DeviceRates(flops_per_s, elements_per_s, dispatch_s, host_bytes_per_s,
                       str(device), *(_block_dispatch_s(kind, device)
                                      for kind in ("reversible", "memory_efficient")))


def _block_dispatch_s(kind: str, device: jax.Device) -> float:
    """Seconds per dispatch of a tiny block-trainer step on ``device`` (best of 5 steps
    after one that compiles): the executor's and the store's host work per program."""
    import optax

    from revtrain import layers as tl
    from revtrain.models import ReversibleTransformerLM
    from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer

    model = ReversibleTransformerLM(vocab_size=16, d_model=8, d_ff=16, n_layers=2,
                                    n_heads=1, max_len=8, dropout=0.0, mode="train")
    blocks, loss = tl.extract_reversible_blocks([model, tl.CrossEntropyLoss()])
    tokens = np.arange(4 * 9, dtype=np.int32).reshape(4, 9) % 16
    batch = (tokens[:, :-1], tokens[:, 1:], np.ones((4, 8), np.float32))
    tl.init_reversible_blocks(blocks, loss, batch, jax.random.key(0))
    trainer_class = ReversibleSerialTrainer if kind == "reversible" else MemoryEfficientTrainer
    trainer = trainer_class(blocks, loss, lambda: optax.adam(1e-3),
                            mesh=Mesh(np.array([device]), ("batch",)))
    counter = _Counter()
    trainer.observers.append(counter)

    def step():
        trainer.one_step(batch, jax.random.key(1))
        trainer.block_until_ready()
    step()
    counter.n = 0
    seconds = _best_of(lambda: step(), 5)
    return seconds / max(counter.n / 6, 1)


class _Counter:
    """A trainer observer counting dispatches."""

    n = 0

    def on_dispatch(self, label: str, fn: Any, args: tuple) -> None:
        self.n += 1

    def on_phase(self, label: str) -> None:
        pass


__all__ = ["DeviceRates", "Work", "jaxpr_work", "measure_rates", "program_work"]
