"""What the workers of ``benchmarks/memory_budget.py`` run, and how its parent starts them.

Split from the script (which defines its flags when run) so that its parts
(`benchmarks.memory_budget_caps`) and its workers import these without importing the
script a second time. A worker builds the model of its configuration twice: abstractly for
`revtrain.planning.estimate` (`abstract_model`), then for real for the measured steps
(`real_model`); the trainer is made the same way both times (``from_model`` with the
options of `trainer_and_options`).
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness

NO_REMAT = "Trainer has no remat option"
SCRIPT = str(Path(__file__).resolve().parent / "memory_budget.py")


# ------------------------------------------------------------------------------------------
# Configurations.

def config_id(config: dict[str, Any]) -> str:
    """``trainer-dDEPTH-LLENGTH-bBATCH-attention``, e.g. ``reversible-d2-L512-b8-default``."""
    return (f"{config['trainer']}-d{config['depth']}-L{config['seq_len']}-"
            f"b{config['batch_size']}-{config['attention']}")


def base_config(model: dict[str, Any], seed: int, cache_dir: str | None) -> dict[str, Any]:
    """What every worker of a part shares: ``model`` (its sizes) and the run settings."""
    return model | {"seed": seed, "mask_bits": 16, "n_devices": 1, "warmup": 1, "steps": 0,
                    "compilation_cache_dir": cache_dir,
                    "host_allocator": harness.host_heap.host_allocator_choice()}


def spec_config(base: dict[str, Any], kind: str, depth: int, length: int, batch: int,
                attention: str) -> dict[str, Any]:
    """One worker's configuration: ``base`` at a trainer kind (`harness.TRAINERS`), depth,
    length, batch and attention kind (``default``, ``blockwise`` or ``lsh``); dropout 0.1
    with the default attention and 0 with the long-context kinds (as
    ``configs/reversible_lm_64k.gin``) unless ``base`` sets it; the FSDP kinds on
    `harness.FSDP_DEVICES` devices."""
    config = {"dropout": 0.1 if attention == "default" else 0.0} | base | {
        "trainer": kind, "depth": depth, "seq_len": length, "batch_size": batch,
        "attention": attention}
    if kind in harness.FSDP_KINDS:
        config["n_devices"] = harness.FSDP_DEVICES
    return config | {"id": config_id(config)}


# ------------------------------------------------------------------------------------------
# Worker side: the model, the estimate, the measured steps.

def optimizer_fn() -> Any:
    """Adam, its learning rate a hyperparameter (as the other benchmarks')."""
    import optax
    return optax.inject_hyperparams(optax.adam)(learning_rate=1e-4)


def model_and_loss(config: dict[str, Any]) -> tuple[Any, Any, tuple]:
    """An uninitialised `harness.model` of ``config`` with its attention kind (blockwise and
    LSH as ``sequence_length.py`` builds them, with feed-forward chunks of
    ``ff_chunk_size`` positions), the loss layer (the fused head in chunks of
    ``loss_chunk`` positions) and the batch signature ``(inputs, targets, weights)``, each
    ``[batch, length]``.

    Raises:
      ValueError: for an attention kind that is not ``default``, ``blockwise`` or ``lsh``.
    """
    import functools

    import jax
    import numpy as np

    from revtrain import layers as tl

    length, attention = config["seq_len"], config["attention"]
    overrides: dict[str, Any] = {}
    if attention == "lsh":
        overrides["attention_type"] = functools.partial(
            tl.LSHCausalAttention, chunk_len=config["chunk_len"], n_hashes=config["n_hashes"])
    elif attention == "blockwise":
        overrides["attention_type"] = functools.partial(
            tl.CausalAttention, implementation="blockwise", block_size=config["block_size"])
    elif attention != "default":
        raise ValueError(f"attention={attention!r} is not one of default, blockwise, lsh")
    if attention != "default":
        overrides["ff_chunk_size"] = min(config["ff_chunk_size"], length)
    model = harness.model(config, **overrides)
    loss = tl.CrossEntropyLoss(n_chunks=max(1, length // config["loss_chunk"]))
    shape = (config["batch_size"], length)
    signature = (jax.ShapeDtypeStruct(shape, np.int32), jax.ShapeDtypeStruct(shape, np.int32),
                 jax.ShapeDtypeStruct(shape, np.float32))
    return model, loss, signature


def abstract_model(config: dict[str, Any]) -> tuple[Any, Any, tuple]:
    """`model_and_loss` with the model's weights and state as shapes (``jax.eval_shape``
    of the init of a fresh model, so no layer of the returned one holds a tracer)."""
    import jax
    model, loss, signature = model_and_loss(config)
    model.weights, model.state = jax.eval_shape(
        lambda rng: model_and_loss(config)[0].init(signature[0], rng=rng),
        jax.random.key(config["seed"]))
    loss.init((model.output_signature(signature[0]), *signature[1:]))
    return model, loss, signature


def real_model(config: dict[str, Any]) -> tuple[Any, Any, tuple]:
    """`model_and_loss` initialised for real on the host CPU device, its values copied to
    host memory and the layers' init keys dropped: afterwards only the trainer puts values
    on the accelerator (as `harness.build`)."""
    import jax
    import numpy as np
    model, loss, signature = model_and_loss(config)
    with jax.default_device(jax.devices("cpu")[0]):
        model.init(signature[0], rng=jax.random.key(config["seed"]))
        loss.init((model.output_signature(signature[0]), *signature[1:]))
    for layer in (model, loss):  # Copies (np.array): a CPU view would keep the buffer alive.
        layer.weights = jax.tree.map(np.array, layer.weights)
        layer.state = jax.tree.map(np.array, layer.state)
    pending = [model, loss]
    while pending:
        layer = pending.pop()
        layer.rng = None
        pending.extend(layer.sublayers)
    return model, loss, signature


def trainer_and_options(kind: str, n_devices: int | None = None) -> tuple[type, dict]:
    """The trainer class of ``kind`` (a key of `harness.TRAINERS`) and its options:
    ``remat='layer'`` for ``trainer_remat``, ``fsdp=True`` for the FSDP kinds, and
    ``n_devices`` where given."""
    from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
    base = harness.FSDP_KINDS.get(kind, kind)
    classes = {"trainer": Trainer, "trainer_remat": Trainer,
               "reversible": ReversibleSerialTrainer, "memory_efficient": MemoryEfficientTrainer}
    options: dict[str, Any] = {"remat": "layer"} if base == "trainer_remat" else {}
    if kind in harness.FSDP_KINDS:
        options["fsdp"] = True
    if n_devices is not None:
        options["n_devices"] = n_devices
    return classes[base], options


def refused_remat(options: dict[str, Any], error: Exception) -> bool:
    """Whether ``error`` is the trainer refusing the ``remat`` option it was given."""
    return "remat" in options and "remat" in str(error)


def predict(config: dict[str, Any]) -> dict[str, Any]:
    """The estimate of ``config``'s step as result fields, in bytes and seconds
    (``skipped`` where `Trainer` refuses ``remat``)."""
    from revtrain.memory import rss_bytes
    from revtrain.planning import estimate
    cls, options = trainer_and_options(config["trainer"], config["n_devices"])
    rss_before = rss_bytes()
    model, loss, signature = abstract_model(config)
    try:
        e = estimate(model, loss, signature, optimizer_fn, cls, **options)
    except (TypeError, ValueError) as error:
        if refused_remat(options, error):
            return {"skipped": NO_REMAT, "refusal": str(error)}
        raise
    return {"predicted_peak_bytes": e.peak_bytes, "predicted_weights_bytes": e.weights_bytes,
            "predicted_slots_bytes": e.slots_bytes, "predicted_state_bytes": e.state_bytes,
            "predicted_activation_bytes": e.activation_bytes,
            "predicted_temp_bytes": e.temp_bytes, "predicted_peak_program": e.peak_program,
            "predicted_all_values_bytes": e.all_values_bytes,
            "predicted_host_values_bytes": e.host_values_bytes,
            "predicted_host_bytes": e.host_bytes, "n_programs": e.n_programs,
            "n_dispatches": e.n_dispatches, "estimate_s": e.seconds,
            "rss_before_estimate_bytes": rss_before,
            "rss_after_estimate_bytes": e.planner_rss_bytes}


def run_steps(config: dict[str, Any]) -> dict[str, Any]:
    """Builds the real trainer, runs ``warmup`` steps, times ``steps`` more (their median
    wall time gives tokens/s; the process's CPU time per step is beside it, less sensitive
    to a shared machine's load), then measures one step's peak with
    `revtrain.memory.track_peak` (apart, so the ledger's bookkeeping is not timed)."""
    import jax

    from revtrain import memory
    start = time.perf_counter()
    cls, options = trainer_and_options(config["trainer"], config["n_devices"])
    model, loss, _ = real_model(config)
    trainer = cls.from_model(model, loss, optimizer_fn, **options)
    batch = harness.make_batch(config)
    build_s = time.perf_counter() - start

    def step(k: int) -> float:
        value, _ = trainer.one_step(batch, jax.random.key(k), step=k)
        trainer.block_until_ready()
        return float(value)

    start = time.perf_counter()
    for k in range(config["warmup"]):
        step(k)
    warmup_s, times, cpu_times = time.perf_counter() - start, [], []
    for k in range(config["warmup"], config["warmup"] + config["steps"]):
        begin, cpu_begin = time.perf_counter(), time.process_time()
        step(k)
        times.append(time.perf_counter() - begin)
        cpu_times.append(time.process_time() - cpu_begin)
    with memory.track_peak(trainer) as peak:
        last_loss = step(config["warmup"] + config["steps"])
    out = {"method": peak.method, "peak_bytes": peak.peak_bytes, "peak_label": peak.peak_label,
           "baseline_bytes": peak.baseline_bytes, "peak_rss_bytes": peak.peak_rss_bytes,
           "build_s": build_s, "warmup_s": warmup_s, "loss": last_loss}
    if times:
        median = statistics.median(times)
        out |= {"step_times_s": times, "median_step_s": median,
                "step_cpu_s": cpu_times, "median_step_cpu_s": statistics.median(cpu_times),
                "tokens_per_s": config["batch_size"] * config["seq_len"] / median}
    return out


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """A worker's work: the caps part's planning (``part == 'plan'``:
    `benchmarks.memory_budget_caps.plan_worker`), or the estimate (unless ``estimate`` is
    False) followed by the measured steps (unless ``predict_only``) and ``ratio``, the
    predicted peak over the measured one."""
    import jax
    if config["part"] == "plan":
        from benchmarks import memory_budget_caps
        return memory_budget_caps.plan_worker(config)
    if jax.device_count() < config["n_devices"]:
        return {"skipped": f"needs {config['n_devices']} devices; the {jax.default_backend()} "
                           f"backend has {jax.device_count()}"}
    result = predict(config) if config.get("estimate", True) else {}
    if "skipped" in result or config.get("predict_only"):
        return result
    result |= run_steps(config)
    if "predicted_peak_bytes" in result:
        result["ratio"] = result["predicted_peak_bytes"] / result["peak_bytes"]
    return result


# ------------------------------------------------------------------------------------------
# Parent side.

def outcome(result: dict[str, Any], describe: Callable[[dict], str]) -> str:
    """A result in one line: its error, why it was skipped, or ``describe(result)``."""
    if "error" in result:
        return f"ERROR {result['error']}"
    return f"skipped: {result['skipped']}" if "skipped" in result else describe(result)


def run_configs(configs: Sequence[dict[str, Any]], describe: Callable[[dict], str],
                timeout: float, jobs: int = 1) -> list[dict[str, Any]]:
    """Runs each configuration in a fresh worker of ``memory_budget.py`` (``jobs`` at a
    time) with the machine's 1, 5 and 15-minute load averages before and after it
    (``load_before``, ``load_after``); prints progress; returns the results in order."""
    def run(k_config: tuple[int, dict[str, Any]]) -> dict[str, Any]:
        k, config = k_config
        before = os.getloadavg()
        result = harness.run_worker(SCRIPT, config, timeout)
        result |= {"load_before": list(before), "load_after": list(os.getloadavg())}
        print(f"[{k}/{len(configs)}] {config.get('id', config['trainer'])}: "
              f"{outcome(result, describe)}", flush=True)
        return result

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(run, enumerate(configs, 1)))
