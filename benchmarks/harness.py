"""What the benchmarks share: flags, the model, the trainers, worker processes.

Their JSON, Markdown and plots are written by `benchmarks.report`.

Every configuration (one trainer at one depth) runs in a fresh Python process started with
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` and JAX's persistent compilation cache off, so
neither memory high-water marks nor compiled executables carry over between
configurations. The parent process only starts workers and writes JSON, Markdown and PNG.

The model is always the reversible Transformer LM
(`revtrain.models.ReversibleTransformerLM`, depth = its ``n_layers``, i.e. attention +
feed-forward block pairs) followed by ``CrossEntropyLoss``, trained with Adam; only the
trainer differs:

* ``trainer`` -- `Trainer` on ``Serial(*flat_layers)`` (all activations stored);
* ``trainer_remat`` -- the same, with every ``ReversibleHalfResidual`` wrapped in
  `revtrain.layers.Remat` (``jax.checkpoint``), the baseline a JAX user reaches for;
* ``reversible`` -- `ReversibleSerialTrainer` on the extracted blocks;
* ``memory_efficient`` -- `MemoryEfficientTrainer` on the same blocks;
* ``trainer_fsdp``, ``reversible_fsdp``, ``memory_efficient_fsdp`` -- the trainer with
  ``fsdp=True`` on `FSDP_DEVICES` devices (forced host devices on CPU): weights and slots
  sharded, the batch split over the devices; memory is that of one device.

Every other configuration runs on ``--n_devices`` devices (default 1).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from absl import flags

from benchmarks.provenance import command_line as command_line  # Re-exported.
from benchmarks.provenance import machine_info as machine_info
from revtrain import host_heap

TRAINERS = {
    "trainer": "Trainer",
    "trainer_remat": "Trainer + remat",
    "reversible": "ReversibleSerialTrainer",
    "memory_efficient": "MemoryEfficientTrainer",
    "trainer_fsdp": "Trainer + FSDP",
    "reversible_fsdp": "ReversibleSerialTrainer + FSDP",
    "memory_efficient_fsdp": "MemoryEfficientTrainer + FSDP",
}
FSDP_KINDS = {"trainer_fsdp": "trainer", "reversible_fsdp": "reversible",
              "memory_efficient_fsdp": "memory_efficient"}
FSDP_DEVICES = 4
DEFAULT_TRAINERS = [kind for kind in TRAINERS if kind not in FSDP_KINDS]
MODEL_DEFAULTS = {"depths": "2,4,8,16,32", "d_model": 256, "d_ff": 1024, "n_heads": 4,
                  "seq_len": 512, "batch_size": 8, "vocab_size": 256, "dropout": 0.1}
QUICK = {"depths": "2,4", "d_model": 32, "d_ff": 64, "seq_len": 32, "batch_size": 4}
RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUICK_RESULTS_DIR = RESULTS_DIR / "tmp"
WORKER_FLAG = "--_worker"
RESULT_MARKER = "BENCHMARK_RESULT "
MIB = 2 ** 20
FLAGS = flags.FLAGS


# ------------------------------------------------------------------------------------------
# Flags and configurations (parent process).

def positive_ints(values: list[str]) -> bool:
    return bool(values) and all(v.strip().isdigit() and int(v) >= 1 for v in values)


flags.DEFINE_boolean("quick", False, f"tiny sizes for tests/CI: {QUICK}; output in "
                     f"{QUICK_RESULTS_DIR}")
flags.DEFINE_list("depths", None, f"comma-separated n_layers values (default "
                  f"{MODEL_DEFAULTS['depths']}, or {QUICK['depths']} with --quick)")
flags.DEFINE_list("trainers", DEFAULT_TRAINERS, f"comma-separated subset of "
                  f"{','.join(TRAINERS)} (the *_fsdp ones run on {FSDP_DEVICES} devices)")
flags.DEFINE_integer("n_devices", 1, "devices the batch is split over (forced host devices "
                     "on CPU) for the trainers without FSDP; memory is per device",
                     lower_bound=1)
for _name in ("d_model", "d_ff", "n_heads", "seq_len", "batch_size", "vocab_size"):
    flags.DEFINE_integer(_name, None, f"model/batch size (default {MODEL_DEFAULTS[_name]}"
                         f"{f', or {QUICK[_name]} with --quick' if _name in QUICK else ''})",
                         lower_bound=1)
flags.DEFINE_float("dropout", None, f"dropout rate (default {MODEL_DEFAULTS['dropout']})",
                   lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_enum("mask_bits", "16", ["8", "16"], "random bits per dropout-mask element "
                  "(the models' dropout_mask_bits): 16, or 8 (rate 0.1 becomes 0.1016)")
flags.DEFINE_integer("steps", None, "measured steps per config (default: the script's)",
                     lower_bound=1)
flags.DEFINE_integer("warmup", None, "steps run before measuring; the first one compiles "
                     "(default: the script's)", lower_bound=1)
flags.DEFINE_integer("seed", 0, "seed of the weights and the batch")
flags.DEFINE_integer("keep_every", None, "block trainers keep an exact copy of the stack "
                     "every this many reversible layers (bounds bf16 reconstruction drift; "
                     "costs depth / keep_every stack copies)", lower_bound=1)
flags.DEFINE_boolean("scan_layers", True, "ReversibleSerialTrainer runs each run of equal "
                     "reversible layers as one forward and one reverse-and-fbo scan program "
                     "(--noscan_layers: one program per layer)")
flags.DEFINE_integer("scan_window", None, "MemoryEfficientTrainer runs each run of equal "
                     "reversible layers in scanned windows of this many repetitions (default: "
                     "one program per layer)", lower_bound=2)
flags.DEFINE_float("timeout", 3600.0, "seconds before a worker process is killed",
                   lower_bound=0.0)
flags.DEFINE_integer("jobs", 1, "workers run at once; >1 only for quick checks (they share "
                     "the CPU, which distorts step times), or for quality.py, whose bits per "
                     "byte do not depend on it (its workers are pinned to their own CPUs)",
                     lower_bound=1)
flags.DEFINE_string("compilation_cache_dir", None, "for tests: let workers share JAX's "
                    "persistent compilation cache (first-step times then exclude most "
                    "compilation)")
flags.DEFINE_boolean("render_only", False, "only rewrite the Markdown and PNG from the JSON "
                     "in --out_dir")
flags.DEFINE_string("out_dir", None, f"where outputs go (default {RESULTS_DIR}, or "
                    f"{QUICK_RESULTS_DIR} with --quick)")
flags.register_validator("depths", lambda v: v is None or positive_ints(v),
                         "--depths must be positive integers, e.g. 2,4,8")
flags.register_validator("trainers", lambda v: bool(v) and set(v) <= set(TRAINERS),
                         f"--trainers must be a subset of {','.join(TRAINERS)}")


def parse_flags(argv: Sequence[str] | None, steps: int, warmup: int) -> SimpleNamespace:
    """The run's settings from absl flags; unset ones take the (quick) defaults.

    Args:
      argv: flags without the program name (as tests pass them); None reads the flags
        ``absl.app.run`` has already parsed from the command line.
      steps: the script's default for ``--steps`` (measured steps per configuration).
      warmup: the script's default for ``--warmup``.

    Returns:
      Every flag's value as an attribute; ``depths`` as a list of ints, ``trainers`` as a
      list of names, ``out_dir`` as a Path, and ``command``, the command line
      (`command_line`).

    Raises:
      flags.Error: for an unknown flag or a value a validator rejects (``--jobs=0``,
        ``--trainers=adam``).
    """
    if argv is not None:
        FLAGS.unparse_flags()  # A fresh parse: an earlier in-process call left values.
        FLAGS([sys.argv[0], *argv])
    args = SimpleNamespace(**FLAGS.flag_values_dict())
    defaults = {**MODEL_DEFAULTS, **(QUICK if args.quick else {}),
                "steps": steps, "warmup": warmup}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.out_dir = Path(args.out_dir or (QUICK_RESULTS_DIR if args.quick else RESULTS_DIR))
    args.command = command_line(argv)
    depths = args.depths.split(",") if isinstance(args.depths, str) else args.depths
    args.depths = [int(d) for d in depths]
    return args


def cache_setting(args: SimpleNamespace) -> dict[str, str]:
    """``{"compilation_cache_dir": ...}`` where ``--compilation_cache_dir`` was given (tests:
    workers share the suite's cache), else ``{}``: a results file's config then carries no
    key that a later ``--update`` run would differ on."""
    cache_dir = getattr(args, "compilation_cache_dir", None)
    return {"compilation_cache_dir": cache_dir} if cache_dir else {}


def model_config(args: SimpleNamespace) -> dict[str, Any]:
    """The model and run settings shared by every configuration (JSON-serialisable)."""
    names = ("d_model", "d_ff", "n_heads", "seq_len", "batch_size", "vocab_size", "dropout",
             "steps", "warmup", "seed", "keep_every", "scan_layers", "scan_window")
    return {name: getattr(args, name) for name in names} | {
        "mask_bits": int(getattr(args, "mask_bits", 16) or 16),
        "n_devices": args.n_devices, "compilation_cache_dir": args.compilation_cache_dir,
        "host_allocator": host_heap.host_allocator_choice()}


def with_workers_host_allocator(config: dict[str, Any], results: list[dict[str, Any]]
                                ) -> dict[str, Any]:
    """``config`` with ``host_allocator`` as the workers' results report it.

    The parent's `host_heap.host_allocator_choice` is what the workers were asked to do;
    each worker returns what `host_heap.configure_host_allocator` did (``system`` where
    ``mallopt`` refused the settings, or a worker environment opted out). A result from
    before workers reported it counts as ``system``; failed workers count for nothing;
    differing workers give e.g. ``'system, tuned'``.
    """
    done = sorted({r.get("host_allocator", "system") for r in results if "error" not in r})
    return (config | {"host_allocator": ", ".join(done)}) if done else config


def configurations(args: SimpleNamespace, rounds: int = 1) -> list[dict[str, Any]]:
    """One config per (depth, round, trainer), in that order.

    Depth-major, so a partial run covers the small depths; at each depth the trainers run
    back to back, ``rounds`` times, so a drift in machine speed hits them alike.
    """
    base = model_config(args)
    return [base | {"trainer": t, "depth": d, "round": r}
            | ({"n_devices": FSDP_DEVICES} if t in FSDP_KINDS else {})
            for d in args.depths for r in range(rounds) for t in args.trainers]


def available_trainers() -> list[str]:
    """`DEFAULT_TRAINERS` plus the FSDP kinds (every trainer takes ``fsdp``)."""
    return DEFAULT_TRAINERS + list(FSDP_KINDS)


# ------------------------------------------------------------------------------------------
# Worker processes.

def worker_env(n_devices: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    if n_devices > 1:  # CPU: that many host devices (no effect on GPU/TPU devices).
        # Forced host devices run their collectives as threads that meet at a rendezvous;
        # on a small, busy machine one can wait long, and XLA aborts the process after
        # 40 s by default (`import revtrain` also raises it, and sizes the client's
        # threads: `revtrain.parallel.cpu_collectives`).
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={n_devices}"
                            " --xla_cpu_collective_call_terminate_timeout_seconds=1800"
                            ).strip()
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def pinned(command: list[str], cpus: Sequence[int] | None) -> list[str]:
    """``command`` restricted to the CPU numbers ``cpus`` (util-linux's ``taskset``, so
    that the process's runtime sizes its thread pools to them from the start); unchanged
    for None or where ``taskset`` is missing."""
    taskset = shutil.which("taskset") if cpus else None
    return [taskset, "-c", ",".join(map(str, cpus)), *command] if taskset else command


def run_worker(script: str, config: dict[str, Any], timeout: float,
               cpus: Sequence[int] | None = None) -> dict[str, Any]:
    """Runs ``script --_worker <config>`` in a fresh process (on the CPUs ``cpus`` only,
    when given: `pinned`); returns its result dict.

    A worker that fails, times out or prints no result gives ``{"error": ...}`` with the
    tail of its stderr, so one bad configuration does not stop the benchmark.
    """
    command = pinned([sys.executable, script, WORKER_FLAG, json.dumps(config)], cpus)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=worker_env(config.get("n_devices", 1)))
    except subprocess.TimeoutExpired:
        return config | {"error": f"timed out after {timeout:.0f} s (raise --timeout)"}
    wall = time.perf_counter() - start
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return config | json.loads(line[len(RESULT_MARKER):]) | {"worker_wall_s": wall}
    tail = "\n".join(done.stderr.strip().splitlines()[-15:])
    return config | {"error": f"worker exited with code {done.returncode}: {tail}",
                     "worker_wall_s": wall}


def cpu_slots(jobs: int) -> list[list[int]] | None:
    """The CPUs this process may use, dealt into ``jobs`` disjoint sets, one per
    concurrent worker (`run_each`'s ``slots``); None for one job (the worker gets every
    CPU).

    Raises:
      ValueError: when there are fewer CPUs than ``jobs``.
    """
    if jobs == 1:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < jobs:
        raise ValueError(f"--jobs={jobs}: this process may use {len(cpus)} CPUs; pass "
                         f"--jobs={len(cpus)} or fewer")
    return [cpus[k::jobs] for k in range(jobs)]


def run_each(run: Callable[[dict[str, Any], Sequence[int] | None], dict[str, Any]],
             configs: list[dict[str, Any]],
             line: Callable[[dict[str, Any], dict[str, Any]], str], jobs: int = 1,
             slots: list[list[int]] | None = None) -> list[dict[str, Any]]:
    """Calls ``run(config, cpus)`` for every configuration, ``jobs`` at a time, printing
    ``[k/n] line(config, result)`` as each one ends.

    With ``slots`` (`cpu_slots`), each call holds one of the CPU sets while it runs, so
    concurrent workers never share a CPU; without, ``cpus`` is None.

    Returns:
      The results in the order of ``configs``.
    """
    free: queue.SimpleQueue = queue.SimpleQueue()
    for slot in slots or [None] * jobs:
        free.put(slot)

    def one(k_config: tuple[int, dict[str, Any]]) -> dict[str, Any]:
        k, config = k_config
        slot = free.get()
        try:
            result = run(config, slot)
        finally:
            free.put(slot)
        print(f"[{k}/{len(configs)}] {line(config, result)}", flush=True)
        return result

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, enumerate(configs, 1)))


def run_all(script: str, configs: list[dict[str, Any]], timeout: float,
            describe: Callable[[dict[str, Any]], str], jobs: int = 1) -> list[dict[str, Any]]:
    """Runs every (trainer, depth) configuration in its own process (``jobs`` at a time,
    `run_each`), printing its trainer, depth and ``describe(result)``.

    Returns the results in the order of ``configs``.
    """
    def line(config: dict[str, Any], result: dict[str, Any]) -> str:
        outcome = f"ERROR {result['error']}" if "error" in result else describe(result)
        round_text = f", round {config['round'] + 1}" if config.get("round") else ""
        return f"{TRAINERS[config['trainer']]}, depth {config['depth']}{round_text}: {outcome}"

    return run_each(lambda config, cpus: run_worker(script, config, timeout, cpus), configs,
                    line, jobs)


def script_main(main: Callable[[], Any],
                measure: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """A benchmark script's ``__main__``: a worker process when called with `WORKER_FLAG`
    (``measure`` runs one configuration), else ``main()`` under ``absl.app.run``, which
    parses the flags and refuses positional arguments with a usage error."""
    if measure is not None and len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        worker_main(sys.argv[1:], measure)
        return
    try:  # As the revtrain-* commands: one line, not every worker's traceback.
        host_heap.host_allocator_choice()
    except ValueError as e:
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        sys.exit(2)
    from absl import app

    def app_main(argv: list[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
        main()
    app.run(app_main)


def worker_main(argv: Sequence[str], measure: Callable[[dict[str, Any]], dict[str, Any]]
                ) -> None:
    """Entry point of a worker: ``argv == ['--_worker', json_config]``; prints the result."""
    config = json.loads(argv[1])
    # As the revtrain-* commands do, before any JAX computation (the runtime's threads
    # pick their heap once); REVTRAIN_HOST_ALLOCATOR=system or a MALLOC_* setting opts out.
    tuned = host_heap.configure_host_allocator()
    import jax
    cache_dir = config.get("compilation_cache_dir")
    jax.config.update("jax_enable_compilation_cache", bool(cache_dir))
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    result = measure(config)
    result["host_allocator"] = "tuned" if tuned else "system"
    result["device"] = f"{jax.default_backend()}: {jax.local_devices()[0].device_kind}"
    print(RESULT_MARKER + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------
# The model and trainers (worker processes).

def make_batch(config: dict[str, Any]) -> tuple:
    """Random token ids ``(inputs, targets, weights)``, host numpy, ``[batch, seq_len]``."""
    import numpy as np
    rs = np.random.RandomState(config["seed"])
    shape = (config["batch_size"], config["seq_len"] + 1)
    tokens = rs.randint(0, config["vocab_size"], shape).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:], np.ones(tokens[:, 1:].shape, np.float32)


def model(config: dict[str, Any], **overrides: Any) -> Any:
    """The benchmarks' training-mode `ReversibleTransformerLM` for ``config`` (depth =
    ``config["depth"]`` layers; ``overrides`` are passed on, e.g. ``compute_dtype``)."""
    from revtrain.models import ReversibleTransformerLM
    return ReversibleTransformerLM(
        vocab_size=config["vocab_size"], d_model=config["d_model"], d_ff=config["d_ff"],
        n_layers=config["depth"], n_heads=config["n_heads"], max_len=config["seq_len"],
        dropout=config["dropout"], mode="train",
        dropout_mask_bits=config.get("mask_bits", 16), **overrides)


def build(config: dict[str, Any]) -> tuple[Any, tuple]:
    """Builds the initialised model, and the configured trainer on it; returns it and a batch.

    Weights and state are copied to host memory and the layers' init keys dropped before
    the trainer is built, so the only device buffers afterwards are the trainer's own.
    """
    import jax
    import numpy as np
    import optax

    from revtrain import layers as tl
    from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer

    blocks, loss = tl.extract_reversible_blocks([model(config), tl.CrossEntropyLoss()])
    batch = make_batch(config)
    signature = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in batch)
    tl.init_reversible_blocks(blocks, loss, signature, jax.random.key(config["seed"]))
    flat = tl.blocks_to_layers(blocks, loss)
    for layer in flat:  # Copies (np.array): a CPU view would keep the device buffer alive.
        layer.weights = jax.tree.map(np.array, layer.weights)
        layer.state = jax.tree.map(np.array, layer.state)
    pending = list(flat)
    while pending:  # The layers' own init keys are device arrays too; trainers never use them.
        layer = pending.pop()
        layer.rng = None
        pending.extend(layer.sublayers)

    def optimizer_fn():
        return optax.inject_hyperparams(optax.adam)(learning_rate=1e-4)

    kind, n_devices = config["trainer"], config["n_devices"]
    fsdp = {"fsdp": True} if kind in FSDP_KINDS else {}
    kind = FSDP_KINDS.get(kind, kind)
    if kind == "trainer":
        whole = tl.fuse_loss_heads(tl.Serial(flat))
        return Trainer(whole, optimizer_fn, n_devices=n_devices, **fsdp), batch
    if kind == "trainer_remat":
        remat = [tl.Remat(layer) if isinstance(layer, tl.ReversibleHalfResidual) else layer
                 for layer in flat]
        whole = tl.fuse_loss_heads(tl.Serial(remat))
        return Trainer(whole, optimizer_fn, n_devices=n_devices), batch
    keep_every = config.get("keep_every")
    if kind == "reversible":
        scan = ({} if config.get("scan_layers", True)
                else {"scan_layers": False})  # An older checkout has no such argument.
        return ReversibleSerialTrainer(blocks, loss, optimizer_fn, n_devices=n_devices,
                                       keep_every=keep_every, **fsdp, **scan), batch
    if kind == "memory_efficient":
        window = config.get("scan_window")
        scan = {} if window is None else {"scan_window": window}  # Older: no argument.
        return MemoryEfficientTrainer(blocks, loss, optimizer_fn, n_devices=n_devices,
                                      keep_every=keep_every, **fsdp, **scan), batch
    raise ValueError(f"trainer={kind!r} is not one of {list(TRAINERS)}")


def host_bytes(tree: Any) -> int:
    """Sum of ``nbytes`` over the array leaves of ``tree``."""
    import jax
    return sum(int(getattr(leaf, "nbytes", 0)) for leaf in jax.tree.leaves(tree))
