"""Command-line tools: ``revtrain-train``, ``revtrain-eval``, ``revtrain-decode``.

``revtrain-train --config_file=configs/reversible_lm.gin [--config_file=...]
--gin_bindings='train.steps=20' [--gin_bindings=...] --output_dir=runs/lm`` parses the gin
files and bindings (later ones win), calls the gin-configured `train` (see
`revtrain.training.train_lib`), writes the operative config to ``output_dir/config.gin``
once the run is set up, and prints the final eval metrics. Running it again on the same
``output_dir`` resumes from the newest checkpoint. The first Ctrl-C or SIGTERM saves a
checkpoint after the current step and exits with status ``128 + signal``.

``revtrain-eval --output_dir=...`` rebuilds the run from ``output_dir/config.gin``, restores
the newest checkpoint and prints eval metrics; ``revtrain-decode --output_dir=...
--prompt='def '`` continues a prompt with a byte-level LM.

Multi-host: ``--coordinator_address=host:port --num_processes=N --process_id=i`` (or the
environment variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
``JAX_PROCESS_ID``) call ``jax.distributed.initialize`` before anything else; on CPU the
gloo collectives are selected.

Errors a user can fix (bad flags, unknown gin parameters, missing files, a NaN loss, a
checkpoint of another model) are printed as one line, ``<tool>: error: <message>``, with
exit status 2 for usage errors and 1 otherwise; ``--traceback`` shows the full traceback.
Each ``*_main(argv)`` builds its own flag set, so the tools can be called in-process.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence

import gin
from absl import flags

CONFIG_FILE = "config.gin"
_CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "configs")


class UsageError(Exception):
    """A command-line mistake: reported in one line with exit status 2."""


# --------------------------------------------------------------------------------------
# Flags.

def _common_flags(output_dir_help: str) -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("output_dir", None, output_dir_help, flag_values=fv)
    flags.DEFINE_multi_string("config_file", [], "A gin config file; repeat for several "
                              "(later files override earlier ones).", flag_values=fv)
    flags.DEFINE_multi_string("gin_bindings", [], "A gin binding such as 'train.steps=20'; "
                              "repeat for several; applied after the config files.",
                              flag_values=fv)
    flags.DEFINE_string("coordinator_address", None, "host:port of the JAX distributed "
                        "coordinator (process 0) for multi-host runs.", flag_values=fv)
    flags.DEFINE_integer("num_processes", None, "Number of processes of a multi-host run.",
                         flag_values=fv)
    flags.DEFINE_integer("process_id", None, "This process's index in a multi-host run.",
                         flag_values=fv)
    flags.DEFINE_boolean("traceback", False, "Show the full traceback of an error.",
                         flag_values=fv)
    return fv


def _parse_flags(fv: flags.FlagValues, argv: Sequence[str]) -> bool:
    """Parses ``argv`` (argv[0] is the program); returns False when help was printed.

    Raises:
      flags.Error: for an unknown flag or a bad value.
      UsageError: for positional arguments.
    """
    if any(arg in ("-h", "--help", "--helpshort", "--helpfull") for arg in argv[1:]):
        print(f"usage: {os.path.basename(argv[0])} [flags]\n\n{fv.get_help()}")
        return False
    rest = fv(list(argv))
    if len(rest) > 1:
        raise UsageError(f"unexpected arguments {rest[1:]}; every option is a --flag")
    return True


# --------------------------------------------------------------------------------------
# Shared set-up: logging, distributed runtime, gin.

@contextlib.contextmanager
def _log_to_stderr() -> Iterator[None]:
    """Shows revtrain's INFO log lines on stderr while the tool runs."""
    logger = logging.getLogger("revtrain")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    old_level, old_propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # Root handlers (e.g. absl's) would print each line twice.
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate


def _initialize_distributed(fv: flags.FlagValues) -> None:
    """Calls ``jax.distributed.initialize`` when flags or environment ask for it."""
    address = fv.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = fv.num_processes or _env_int("JAX_NUM_PROCESSES")
    process_id = fv.process_id if fv.process_id is not None else _env_int("JAX_PROCESS_ID")
    if not address and num_processes is None:
        return
    if not address or num_processes is None or process_id is None:
        raise UsageError("a multi-host run needs --coordinator_address, --num_processes and "
                         "--process_id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                         "JAX_PROCESS_ID)")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=num_processes,
                               process_id=process_id)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError as e:
        raise UsageError(f"environment variable {name}={value!r} is not an integer") from e


def resolve_config_file(path: str) -> str:
    """``path`` if it exists, else the same name in the repository's ``configs/``.

    Raises:
      UsageError: when neither exists.
    """
    if os.path.isfile(path):
        return path
    candidate = os.path.join(_CONFIGS_DIR, path)
    if os.path.isfile(candidate):
        return candidate
    raise UsageError(f"config file {path!r} not found (also looked in {_CONFIGS_DIR})")


def _parse_gin(config_files: Sequence[str], bindings: Sequence[str]) -> None:
    """Clears gin and parses files then bindings; gin errors become one-line ValueErrors."""
    from revtrain import configurables  # noqa: F401  (registers the gin configurables)

    files = [resolve_config_file(path) for path in config_files]
    gin.clear_config()
    # `include 'x.gin'` finds files next to the including config or in configs/.
    for directory in dict.fromkeys([os.path.dirname(os.path.abspath(f)) for f in files]
                                   + [_CONFIGS_DIR]):
        known = getattr(gin.config, "_LOCATION_PREFIXES", ())  # Avoid repeats in-process.
        if os.path.isdir(directory) and directory not in known:
            gin.add_config_file_search_path(directory)
    try:
        gin.parse_config_files_and_bindings(files, list(bindings), finalize_config=False)
    except (ValueError, KeyError, SyntaxError, TypeError, OSError) as e:
        raise UsageError(f"gin config: {_one_line(e)}") from e


def _one_line(error: BaseException) -> str:
    """The error message on one line, without gin's "In call to configurable" notes."""
    lines = [line.strip() for line in str(error).splitlines()]
    text = " ".join(line for line in lines
                    if line and not line.startswith("In call to configurable"))
    return text or type(error).__name__


def _is_chief() -> bool:
    import jax

    return jax.process_index() == 0


def _print_metrics(prefix: str, metrics: dict[str, float]) -> None:
    if _is_chief():
        text = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        print(f"{prefix}: {text}", flush=True)


def _run(prog: str, fv: flags.FlagValues, argv: Sequence[str] | None,
         body: Callable[[flags.FlagValues], int]) -> int:
    """Parses flags and runs ``body``, turning errors into one line and an exit status."""
    argv = list(sys.argv if argv is None else argv)
    try:
        if not _parse_flags(fv, argv):
            return 0
    except (flags.Error, UsageError) as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    with _log_to_stderr():
        try:
            return body(fv)
        except UsageError as e:
            if fv.traceback:
                raise
            print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return 128 + signal.SIGINT
        except Exception as e:  # One line for users; --traceback for developers.
            if fv.traceback:
                raise
            print(f"{prog}: error: {type(e).__name__}: {_one_line(e)} (rerun with "
                  f"--traceback for details)", file=sys.stderr)
            return 1


# --------------------------------------------------------------------------------------
# revtrain-train.

def _write_operative_config(output_dir: str) -> Callable:
    def write(loop) -> None:
        del loop
        if _is_chief():
            from revtrain.training.run_config import write_run_config

            write_run_config(output_dir, gin.operative_config_str())
    return write


def _train(fv: flags.FlagValues) -> int:
    if not fv.output_dir:
        raise UsageError("--output_dir is required (checkpoints, metrics and config.gin go "
                         "there)")
    if not fv.config_file:
        raise UsageError("give at least one --config_file, e.g. "
                         "--config_file=configs/reversible_lm.gin")
    _initialize_distributed(fv)
    _parse_gin(fv.config_file, fv.gin_bindings)
    from revtrain import configurables

    output_dir = os.path.abspath(fv.output_dir)
    loop = configurables.train(output_dir=output_dir,
                               callbacks=[_write_operative_config(output_dir)])
    if loop.interrupted_by is not None:
        name = signal.Signals(loop.interrupted_by).name
        if _is_chief():
            print(f"stopped by {name} after step {loop.step}; the checkpoint is saved in "
                  f"{output_dir}; run the same command to resume", file=sys.stderr)
        return 128 + loop.interrupted_by
    if loop.last_eval_metrics:
        _print_metrics(f"final eval at step {loop.step}", loop.last_eval_metrics)
    return 0


def train_main(argv: Sequence[str] | None = None) -> int:
    """``revtrain-train``; returns the exit status (``argv[0]`` is the program name)."""
    fv = _common_flags("Directory for checkpoints, metrics.jsonl, TensorBoard files and "
                       "config.gin; an existing run there is resumed.")
    return _run("revtrain-train", fv, argv, _train)


# --------------------------------------------------------------------------------------
# revtrain-eval and revtrain-decode: rebuild the run from output_dir/config.gin.

def _restored_loop(fv: flags.FlagValues, **overrides):
    """The run's `Loop` from its config.gin (plus flags), with the newest checkpoint."""
    if not fv.output_dir:
        raise UsageError("--output_dir is required (the directory revtrain-train wrote)")
    output_dir = os.path.abspath(fv.output_dir)
    config = os.path.join(output_dir, CONFIG_FILE)
    if not os.path.isfile(config):
        raise UsageError(f"{config} not found; is {output_dir} a revtrain-train output_dir?")
    _initialize_distributed(fv)
    _parse_gin([config, *fv.config_file], fv.gin_bindings)
    from revtrain.training import train_lib

    kwargs = train_lib.loop_arguments(gin.get_bindings("train"))
    kwargs.update(output_dir=output_dir, progress=False, **overrides)
    loop = train_lib.make_loop(**kwargs)
    if loop.restored_step is None:
        loop.close()
        raise UsageError(f"no checkpoint in {output_dir}/checkpoints to load")
    return loop


def _eval(fv: flags.FlagValues) -> int:
    overrides = {} if fv.eval_steps is None else {"eval_steps": fv.eval_steps}
    loop = _restored_loop(fv, **overrides)
    try:
        metrics = loop.evaluate(write=False)
    finally:
        loop.close()
    _print_metrics(f"eval at step {loop.step}", metrics)
    return 0


def eval_main(argv: Sequence[str] | None = None) -> int:
    """``revtrain-eval``: prints eval metrics of the newest checkpoint of ``--output_dir``."""
    fv = _common_flags("The output_dir of a revtrain-train run.")
    flags.DEFINE_integer("eval_steps", None, "Eval batches (default: the run's eval_steps).",
                         flag_values=fv)
    return _run("revtrain-eval", fv, argv, _eval)


def _decode(fv: flags.FlagValues) -> int:
    from revtrain.training.decoding import Decoder, decode_text

    if fv.max_new_bytes < 0 or not math.isfinite(fv.temperature) or fv.temperature < 0:
        raise UsageError("--max_new_bytes must be >= 0 and --temperature >= 0")
    loop = _restored_loop(fv)
    try:
        if getattr(loop.inputs, "vocab_size", None) != 256:
            raise UsageError(f"revtrain-decode needs a byte-level LM (vocab_size 256); this "
                             f"run's inputs have vocab_size "
                             f"{getattr(loop.inputs, 'vocab_size', None)}")
        length = loop.batch_signature[0].shape[-1]
        text = decode_text(Decoder(loop.eval_model(), length), fv.prompt, fv.max_new_bytes,
                           fv.temperature, fv.seed)
    finally:
        loop.close()
    if _is_chief():
        print(fv.prompt + text, flush=True)
    return 0


def decode_main(argv: Sequence[str] | None = None) -> int:
    """``revtrain-decode``: continues ``--prompt`` with the newest checkpoint's byte LM."""
    fv = _common_flags("The output_dir of a revtrain-train run of a byte-level LM.")
    flags.DEFINE_string("prompt", "\n", "Text to continue.", flag_values=fv)
    flags.DEFINE_integer("max_new_bytes", 200, "Bytes to generate.", flag_values=fv)
    flags.DEFINE_float("temperature", 0.0, "0 for greedy decoding, else the sampling "
                       "temperature.", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Seed for sampling.", flag_values=fv)
    return _run("revtrain-decode", fv, argv, _decode)


# --------------------------------------------------------------------------------------
# Console-script entry points (setup.cfg).

def run_train() -> None:
    sys.exit(train_main())


def run_eval() -> None:
    sys.exit(eval_main())


def run_decode() -> None:
    sys.exit(decode_main())
