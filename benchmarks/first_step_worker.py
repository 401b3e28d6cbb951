"""The worker side of `benchmarks.first_step`: one configuration in a fresh process.

Two measurements:

* `time_to_first_step` -- builds the model, initialises it, builds the trainer, and runs
  its first step and a second one, timing each phase and booking JAX's compile-time
  events (`jax.monitoring`) to the phase they happened in (`CompileLog`). The model is the
  benchmarks' reversible LM (`benchmarks.harness.model`) or, for the deep-Serial part, a
  plain ``Serial`` of ``Dense(2)`` layers (`dense_serial`);
* `interleaved_steps` -- `Trainer` with ``scan_layers=True`` and ``False`` on one
  initialised LM, stepped in alternation, so a change of machine speed hits both.

The set-up follows `revtrain.training.build_model` and `revtrain.training.build_trainer`
(what ``revtrain-train`` does): ``model.init`` from the batch's signature, the loss layer
initialised on the model's output, then ``trainer_class.from_model``; the persistent
compilation cache is set with `revtrain.training.use_compilation_cache`, as
`revtrain.training.build_loop` sets it.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator
from typing import Any

from benchmarks import harness
from benchmarks.step_time import COMPILE_EVENTS, summarise, timed_step

KINDS = {"trainer": "Trainer", "trainer_unrolled": "Trainer, scan_layers=False",
         "reversible": "ReversibleSerialTrainer", "memory_efficient": "MemoryEfficientTrainer"}
"""Trainer kind -> label; ``trainer_unrolled`` is `Trainer` with ``scan_layers=False``."""
PHASES = ("model", "init", "trainer", "first_step", "second_step")
"""The timed phases of `time_to_first_step`, in order."""
CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits",
                "/jax/compilation_cache/cache_misses": "cache_misses"}


class CompileLog:
    """JAX's compile-time events, booked to the phase in progress (a context manager that
    registers and removes its `jax.monitoring` listeners).

    Attributes:
      seconds: per phase, seconds of tracing, lowering to MLIR and XLA compiling (or loading
        from the persistent cache), summed over threads: with the persistent cache off a
        block trainer compiles its programs side by side, so this can exceed the phase's
        wall time; with it on (the cold and warm rows) they compile one after another
        (`revtrain.trainers.block.compiling.compile_workers`).
      n_compiles: per phase, XLA compile requests (a compile or a cache load).
      cache: persistent cache ``cache_hits`` and ``cache_misses`` over all phases.
    """

    def __init__(self):
        self.current: str | None = None
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.n_compiles: collections.Counter = collections.Counter()
        self.cache: collections.Counter = collections.Counter()

    def _on_duration(self, event: str, duration: float, **_: Any) -> None:
        if event in COMPILE_EVENTS:
            self.seconds[self.current] += duration
            self.n_compiles[self.current] += event == COMPILE_EVENTS[-1]

    def _on_event(self, event: str, **_: Any) -> None:
        if event in CACHE_EVENTS:
            self.cache[CACHE_EVENTS[event]] += 1

    def __enter__(self) -> CompileLog:
        import jax
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc: Any) -> None:
        import jax
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)

    @contextlib.contextmanager
    def phase(self, name: str, wall: dict[str, float]) -> Iterator[None]:
        """Books compile events to ``name`` meanwhile and sets ``wall[name]`` (seconds)."""
        self.current, start = name, time.perf_counter()
        try:
            yield
        finally:
            wall[name] = time.perf_counter() - start
            self.current = None


def dense_serial(n_layers: int) -> Any:
    """``Serial(Dense(2) x n_layers, LogSoftmax, CrossEntropyLoss)``: google/trax#1697's
    deep plain model, a [batch, 2] float32 input and [batch] int32 class targets."""
    from revtrain import layers as tl
    return tl.Serial(*[tl.Dense(2) for _ in range(n_layers)], tl.LogSoftmax(),
                     tl.CrossEntropyLoss())


def dense_batch(config: dict[str, Any]) -> tuple:
    """``(x [batch, 2] float32, targets [batch] int32 in {0, 1}, weights [batch])``."""
    import numpy as np
    rs = np.random.RandomState(config["seed"])
    n = config["batch_size"]
    return (rs.randn(n, 2).astype(np.float32), rs.randint(0, 2, (n,)).astype(np.int32),
            np.ones((n,), np.float32))


def _optimizer_fn() -> Any:
    import optax
    return optax.inject_hyperparams(optax.adam)(learning_rate=1e-4)


def _construct(config: dict[str, Any]) -> tuple[Any, Any]:
    """``(model, loss)``; for the deep Serial the model holds its loss and ``loss`` is None."""
    if config["model"] == "dense_serial":
        return dense_serial(config["depth"]), None
    from revtrain import layers as tl
    return harness.model(config), tl.CrossEntropyLoss()


def _initialise(model: Any, loss: Any, signature: tuple, seed: int) -> None:
    """As `revtrain.training.build_model`: the model from the inputs' signature, the loss
    from the model's output, everything ready on the device."""
    import jax
    init_rng, _ = jax.random.split(jax.random.key(seed))
    if loss is None:
        model.init(signature, rng=init_rng)
    else:
        model.init(signature[0], rng=init_rng)
        loss.init((model.output_signature(signature[0]), *signature[1:]))
    jax.block_until_ready((model.weights, model.state) + (
        () if loss is None else (loss.weights, loss.state)))


def _trainer(kind: str, model: Any, loss: Any, n_devices: int) -> Any:
    from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
    cls, options = {"trainer": (Trainer, {}), "trainer_unrolled": (Trainer, {
        "scan_layers": False}), "reversible": (ReversibleSerialTrainer, {}),
        "memory_efficient": (MemoryEfficientTrainer, {})}[kind]
    if loss is None:  # The deep Serial: the model is Trainer's model_with_loss as it is.
        return cls(model, _optimizer_fn, n_devices=n_devices, **options)
    return cls.from_model(model, loss, _optimizer_fn, n_devices=n_devices, **options)


def time_to_first_step(config: dict[str, Any]) -> dict[str, Any]:
    """Times model construction, init, trainer construction and the first two steps.

    ``config``: the shared model settings (`benchmarks.harness.model_config`) with
    ``trainer`` (a `KINDS` key), ``depth``, ``model`` (``'lm'`` or ``'dense_serial'``)
    and ``cache_dir`` (the persistent compilation cache's directory; None: off).

    Returns:
      ``<phase>_s`` wall seconds per `PHASES` entry (a step: until every update landed),
      ``total_s`` (model + init + trainer + first step), ``compile_s`` and
      ``n_compiles`` per phase (`CompileLog`), ``compile_total_s`` (the phases of the
      total; the second step's stays apart: it compiles nothing unless something recompiles),
      ``cache_hits`` / ``cache_misses``, the block trainers' ``compile_times``
      (`revtrain.trainers.block.CompileTimes` as a dict: the first step's wall-clock
      split into tracing, compiling and running; None for `Trainer`), ``n_layers`` (the
      trainer's flat layers, or the Serial's sublayers) and the two ``losses``.
    """
    import jax

    from revtrain import layers as tl
    from revtrain.training import CompilationCacheConfig, use_compilation_cache
    cache = config.get("cache_dir")
    use_compilation_cache(CompilationCacheConfig(directory=cache, enabled=cache is not None))
    wall: dict[str, float] = {}
    with CompileLog() as log:
        with log.phase("model", wall):
            model, loss = _construct(config)
        batch = (dense_batch(config) if loss is None else harness.make_batch(config))
        signature = tl.signature_of(batch)
        with log.phase("init", wall):
            _initialise(model, loss, signature, config["seed"])
        with log.phase("trainer", wall):
            trainer = _trainer(config["trainer"], model, loss, config["n_devices"])
        with log.phase("first_step", wall):
            first = timed_step(trainer, batch, 0)
        with log.phase("second_step", wall):
            second = timed_step(trainer, batch, 1)
    times = getattr(trainer, "compile_times", None)
    n_layers = len(model.sublayers) if loss is None else len(
        tl.blocks_to_layers(*tl.extract_reversible_blocks([model, loss])))
    result = {f"{p}_s": wall[p] for p in PHASES}
    result |= {"first_step_s": first["wall_s"], "second_step_s": second["wall_s"],
               "total_s": sum(wall[p] for p in PHASES[:3]) + first["wall_s"],
               "compile_s": {p: log.seconds.get(p, 0.0) for p in PHASES},
               "n_compiles": {p: log.n_compiles.get(p, 0) for p in PHASES},
               "compile_total_s": sum(log.seconds.get(p, 0.0) for p in PHASES[:4]),
               "cache_hits": log.cache["cache_hits"],
               "cache_misses": log.cache["cache_misses"],
               "compile_times": None if times is None else times._asdict(),
               "n_layers": n_layers, "losses": [first["loss"], second["loss"]],
               "cache_enabled": bool(jax.config.jax_enable_compilation_cache)}
    return result


def interleaved_steps(config: dict[str, Any]) -> dict[str, Any]:
    """`Trainer` with ``scan_layers=True`` and ``False`` on one LM, steps alternating.

    Both trainers take ``config["warmup"]`` steps, then ``config["rounds"]`` rounds of
    ``config["steps"]`` steps each, the order alternating per round (scanned first in
    even rounds), so a drift in machine speed hits both alike.

    Returns:
      ``{kind: {step_times_s, cpu_times_s, others_cpu_times_s, losses} plus the medians
      of `benchmarks.step_time.summarise`}`` for ``trainer`` and ``trainer_unrolled``.
    """
    from revtrain.layers import signature_of
    model, loss = _construct(config | {"model": "lm"})
    batch = harness.make_batch(config)
    _initialise(model, loss, signature_of(batch), config["seed"])
    kinds = ("trainer", "trainer_unrolled")
    trainers = {kind: _trainer(kind, model, loss, config["n_devices"]) for kind in kinds}
    steps = {kind: collections.defaultdict(list) for kind in kinds}
    for kind in kinds:
        for step in range(config["warmup"]):
            timed_step(trainers[kind], batch, step)
    for r in range(config["rounds"]):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            for k in range(config["steps"]):
                t = timed_step(trainers[kind], batch, config["warmup"] + r * config["steps"] + k)
                for key, name in (("wall_s", "step_times_s"), ("cpu_s", "cpu_times_s"),
                                  ("others_cpu_s", "others_cpu_times_s"), ("loss", "losses")):
                    steps[kind][name].append(t[key])
    return {kind: dict(s) | summarise(s, config) for kind, s in steps.items()}


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """A worker's measurement: `interleaved_steps` for ``config["part"] == 'scan'``, else
    `time_to_first_step`."""
    if config["part"] == "scan":
        return {"kinds": interleaved_steps(config)}
    return time_to_first_step(config)
