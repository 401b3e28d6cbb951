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
``JAX_PROCESS_ID``) call ``jax.distributed.initialize`` before anything else (on CPU, JAX
uses its default gloo collectives).

Conventions: the console scripts run under ``absl.app.run`` and log through
``absl.logging``, so absl's logging flags work (``--verbosity=1`` for debug lines,
``--log_dir`` with ``--alsologtostderr``); the ``revtrain.*`` loggers' INFO lines (progress,
checkpoints, memory) show on stderr. ``--gin_file`` is an alias of ``--config_file``, as in
other gin-configured JAX tools, and a config name without a directory (``copy_task.gin``)
is found among the configs shipped in the package (``revtrain/configs``). The operative
config also goes to TensorBoard as text (``tensorboard/config``).

Errors a user can fix (bad flags, unknown gin parameters, missing files, a NaN loss, a
checkpoint of another model) are printed as one line, ``<tool>: error: <message>``, with
exit status 2 for usage errors and 1 otherwise; ``--traceback`` shows the full traceback.
Each ``*_main(argv)`` builds its own flag set, so the tools can be called in-process.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence

import gin
from absl import app, flags
from absl import logging as absl_logging

import revtrain

CONFIG_FILE = "config.gin"
TENSORBOARD_CONFIG_DIR = os.path.join("tensorboard", "config")
# The shipped configs are package data (a regular directory in every pip install).
_CONFIGS_DIR = str(importlib.resources.files("revtrain") / "configs")
# absl's logging flags (--verbosity, --log_dir, ...), shared with each tool's flag set.
_ABSL_FLAG_MODULES = ("absl.logging",)
# Libraries' loggers that show only warnings unless --verbosity is given.
_QUIET_LOGGERS = ("absl", "jax", "orbax")


class UsageError(Exception):
    """A command-line mistake: reported in one line with exit status 2."""


# --------------------------------------------------------------------------------------
# Flags.

def _common_flags(output_dir_help: str) -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("output_dir", None, output_dir_help, flag_values=fv)
    flags.DEFINE_multi_string("config_file", [], "A gin config file, or the name of one "
                              "shipped in revtrain/configs; repeat for several (later files "
                              "override earlier ones).", flag_values=fv)
    flags.DEFINE_alias("gin_file", "config_file", flag_values=fv)
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
    flags.DEFINE_boolean("version", False, "Print the revtrain version and exit.",
                         flag_values=fv)
    for module in _ABSL_FLAG_MODULES:
        for flag in flags.FLAGS.get_flags_for_module(module):
            flag.unparse()  # Defaults again: an earlier in-process call may have set it.
            fv[flag.name] = flag  # The same Flag object: absl reads what we parse.
            fv.register_flag_by_module(module, flag)  # Listed under it in --help.
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
    flags.FLAGS.mark_as_parsed()  # absl.logging's flags were parsed through ``fv``.
    if fv.version:
        print(f"revtrain {revtrain.__version__}")
        return False
    return True


# --------------------------------------------------------------------------------------
# Shared set-up: logging, distributed runtime, gin.

@contextlib.contextmanager
def _absl_logging(prog: str, fv: flags.FlagValues) -> Iterator[None]:
    """Routes Python logging (the ``revtrain.*`` loggers included) through absl's handler.

    Without ``--verbosity``, INFO lines show (revtrain's progress, checkpoints, memory)
    except those of the libraries' own loggers (absl's, which orbax uses, and jax's), which
    show warnings only; ``--verbosity=0`` shows every library's INFO lines, ``--verbosity=1``
    DEBUG lines too, ``--verbosity=-1`` warnings only. Lines go to the current
    ``sys.stderr``, or to ``<log_dir>/<prog>.INFO`` (etc.) with ``--log_dir``, copied to
    stderr with ``--alsologtostderr``. Handlers and levels are restored on exit, so
    in-process calls (tests) leave logging as they found it.
    """
    root = logging.getLogger()
    old_handlers, old_level = list(root.handlers), root.level
    quiet = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    old_quiet_levels = [logger.level for logger in quiet]
    absl_logging.use_absl_handler()  # Adds absl's handler and applies --verbosity.
    if not fv["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.INFO)
        for logger in quiet:
            logger.setLevel(logging.WARNING)
    handler = absl_logging.get_absl_handler()
    old_stream = handler.python_handler.setStream(sys.stderr)
    if fv.log_dir:
        os.makedirs(fv.log_dir, exist_ok=True)  # absl only writes into an existing one.
        handler.use_absl_log_file(program_name=prog, log_dir=fv.log_dir)
    try:
        yield
    finally:
        handler.flush()
        if fv.log_dir:
            handler.python_handler.stream.close()
        handler.python_handler.setStream(old_stream or sys.stderr)
        root.handlers[:] = old_handlers
        root.setLevel(old_level)
        for logger, level in zip(quiet, old_quiet_levels, strict=True):
            logger.setLevel(level)


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
    """``path`` if it exists, else the same name among the configs shipped in the package.

    Args:
      path: a gin file's path, or the name of a shipped config such as ``copy_task.gin``
        (see ``revtrain/configs``).

    Returns:
      The path of an existing file.

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
    # `include 'x.gin'` finds files next to the including config or in the shipped configs;
    # shipped configs include each other as 'revtrain/configs/x.gin', which gin resolves
    # through the package wherever it is installed.
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
    with _absl_logging(prog, fv):
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
    """A `Loop` callback writing gin's operative config to ``config.gin`` and TensorBoard."""
    def write(loop) -> None:
        if _is_chief():
            from tensorboardX import SummaryWriter  # Lazy: it imports protobuf.

            from revtrain.training.run_config import write_run_config

            config = gin.operative_config_str()
            write_run_config(output_dir, config)
            with SummaryWriter(logdir=os.path.join(output_dir, TENSORBOARD_CONFIG_DIR)) as w:
                w.add_text("gin/operative_config", gin.config.markdown(config),
                           global_step=loop.step)
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

def _app_run(main: Callable[[Sequence[str]], int]) -> None:
    """Runs ``main(sys.argv)`` under ``absl.app.run``; exits with its status.

    ``main`` parses its own flag set (which holds absl's logging flags), so ``absl.app``
    only needs ``FLAGS`` marked parsed; INFO lines are shown without absl's prefix.
    """
    flags.FLAGS.set_default("showprefixforinfo", False)

    def parse(argv: list[str]) -> list[str]:
        flags.FLAGS.mark_as_parsed()
        return argv

    app.run(main, flags_parser=parse)


def run_train() -> None:
    """Console script ``revtrain-train`` (also ``python -m revtrain``)."""
    _app_run(train_main)


def run_eval() -> None:
    """Console script ``revtrain-eval``."""
    _app_run(eval_main)


def run_decode() -> None:
    """Console script ``revtrain-decode``."""
    _app_run(decode_main)
