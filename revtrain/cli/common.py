"""Shared set-up of the command-line tools: flags, logging, distributed runtime, gin.

`revtrain.cli` defines the tools; this module holds what they share: the common flag set
(`common_flags`), absl logging (`logging_through_absl`), ``jax.distributed`` start-up, gin parsing
with the shipped configs on the search path (`parse_gin`), and `run`, which turns errors
into one line and an exit status. See `revtrain.cli` for the conventions.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import logging
import os
import signal
import sys
import tokenize
from collections.abc import Callable, Iterator, Sequence

import gin
from absl import flags
from absl import logging as absl_logging

import revtrain

# The shipped configs are package data (a regular directory in every pip install).
_CONFIGS_DIR = str(importlib.resources.files("revtrain") / "configs")
# absl's logging flags (--verbosity, --log_dir, ...), shared with each tool's flag set.
_ABSL_FLAG_MODULES = ("absl.logging",)
# Libraries' loggers that show only warnings unless --verbosity is given.
_QUIET_LOGGERS = ("absl", "jax", "orbax")


class UsageError(Exception):
    """A command-line mistake: reported in one line with exit status 2."""


class GinFileError(UsageError):
    """A gin file that does not parse or names an unknown configurable; ``path`` names it."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"gin config {path}: {reason}")
        self.path, self.reason = path, reason


# --------------------------------------------------------------------------------------
# Flags.

def common_flags(output_dir_help: str) -> flags.FlagValues:
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
                         flag_values=fv, lower_bound=1)
    flags.DEFINE_integer("process_id", None, "This process's index in a multi-host run.",
                         flag_values=fv, lower_bound=0)
    add_tool_flags(fv)
    return fv


def add_tool_flags(fv: flags.FlagValues) -> None:
    """Adds what every tool has: ``--traceback``, ``--version`` and absl's logging flags."""
    flags.DEFINE_boolean("traceback", False, "Show the full traceback of an error.",
                         flag_values=fv)
    flags.DEFINE_boolean("version", False, "Print the revtrain version and exit.",
                         flag_values=fv)
    for module in _ABSL_FLAG_MODULES:
        for flag in flags.FLAGS.get_flags_for_module(module):
            flag.unparse()  # Defaults again: an earlier in-process call may have set it.
            fv[flag.name] = flag  # The same Flag object: absl reads what we parse.
            fv.register_flag_by_module(module, flag)  # Listed under it in --help.


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
def logging_through_absl(prog: str, fv: flags.FlagValues) -> Iterator[None]:
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


def initialize_distributed(fv: flags.FlagValues) -> None:
    """Calls ``jax.distributed.initialize`` when flags or environment ask for it."""
    address = fv.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = fv.num_processes or _env_int("JAX_NUM_PROCESSES", 1)
    process_id = (fv.process_id if fv.process_id is not None else
                  _env_int("JAX_PROCESS_ID", 0))
    if not address and num_processes is None:
        return
    if not address or num_processes is None or process_id is None:
        raise UsageError("a multi-host run needs --coordinator_address, --num_processes and "
                         "--process_id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                         "JAX_PROCESS_ID)")
    import jax

    jax.distributed.initialize(coordinator_address=address, num_processes=num_processes,
                               process_id=process_id)


def _env_int(name: str, low: int) -> int | None:
    """The integer environment variable ``name`` (None when unset), at least ``low``, as
    the flag it stands for."""
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError as e:
        raise UsageError(f"environment variable {name}={value!r} is not an integer") from e
    if number < low:
        raise UsageError(f"environment variable {name}={value!r} must be >= {low}")
    return number


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


def parse_gin(config_files: Sequence[str], bindings: Sequence[str]) -> None:
    """Clears gin and parses files then bindings.

    Raises:
      GinFileError: a file does not parse (its path, gin's reason, in one line).
      UsageError: a binding does not parse, or an unknown configurable or parameter.
    """
    from revtrain import configurables  # registers the gin configurables

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
    # tokenize's error of an unclosed bracket is no SyntaxError.
    errors = (ValueError, KeyError, SyntaxError, TypeError, OSError, tokenize.TokenError)
    for path in files:  # One by one, as gin does, so that an error names its file.
        try:
            gin.parse_config_file(path)
        except errors as e:
            raise GinFileError(os.path.abspath(path), _reason(e)) from e
    try:
        gin.parse_config(list(bindings))
        configurables.check_bindings()
    except errors as e:
        raise UsageError(f"gin config: {_one_line(e)}") from e


def _reason(error: BaseException) -> str:
    """``<type>: <message>`` on one line (tokenize's error is a tuple: its text only)."""
    text = error.args[0] if isinstance(error, tokenize.TokenError) else _one_line(error)
    return f"{type(error).__name__}: {text}"


def _one_line(error: BaseException) -> str:
    """The error message on one line, without gin's "In call to configurable" notes."""
    lines = [line.strip() for line in str(error).splitlines()]
    text = " ".join(line for line in lines
                    if line and not line.startswith("In call to configurable"))
    return text or type(error).__name__


def is_chief() -> bool:
    import jax

    return jax.process_index() == 0


def print_metrics(prefix: str, metrics: dict[str, float]) -> None:
    if is_chief():
        text = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        print(f"{prefix}: {text}", flush=True)


def _orbax_thread_report(record: logging.LogRecord) -> bool:
    """False for orbax's report, with a traceback, of a failure in one of its threads: the
    failure reaches the main thread (the save or the wait raises it) and is reported there
    in one line."""
    return not (record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname)


@contextlib.contextmanager
def _without_thread_reports(traceback: bool) -> Iterator[None]:
    """Drops `_orbax_thread_report` records unless ``--traceback`` asks for everything."""
    absl = logging.getLogger("absl")
    if not traceback:
        absl.addFilter(_orbax_thread_report)
    try:
        yield
    finally:
        absl.removeFilter(_orbax_thread_report)


def _make_log_dir(log_dir: str | None) -> None:
    """Creates ``--log_dir`` (absl only writes into an existing one).

    Raises:
      UsageError: it cannot be created (a full disk, no permission), in one line.
    """
    try:
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create --log_dir={log_dir}: {e.strerror or e}; choose a "
                         f"writable directory") from e


def run(prog: str, fv: flags.FlagValues, argv: Sequence[str] | None,
         body: Callable[[flags.FlagValues], int]) -> int:
    """Parses flags and runs ``body``, turning errors into one line and an exit status."""
    argv = list(sys.argv if argv is None else argv)
    try:
        if not _parse_flags(fv, argv):
            return 0
        from revtrain.training.run_directory import broken_link_error

        broken = fv.log_dir and broken_link_error("--log_dir", fv.log_dir)
        if broken:  # Before logging opens its files there.
            raise UsageError(broken)
        _make_log_dir(fv.log_dir)
    except (flags.Error, UsageError) as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    from revtrain.training.compile_cache import restoring_jax_settings

    with (logging_through_absl(prog, fv), _without_thread_reports(fv.traceback),
          restoring_jax_settings()):
        try:
            return body(fv)
        except UsageError as e:
            if fv.traceback:
                raise
            print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            kept = ("; checkpoints are saved atomically, so the newest complete one is "
                    "intact and the steps after it are lost" if prog == "revtrain-train"
                    else "")
            print(f"{prog}: interrupted{kept}", file=sys.stderr)
            return 128 + signal.SIGINT
        except Exception as e:  # One line for users; --traceback for developers.
            if fv.traceback:
                raise
            print(f"{prog}: error: {type(e).__name__}: {_one_line(e)} (rerun with "
                  f"--traceback for details)", file=sys.stderr)
            return 1


# The inputs that take a tokenizer; `use_run_tokenizer` rebinds theirs.
_TOKENIZED_INPUTS = ("TextFiles", "TFDS")


def use_run_tokenizer(output_dir: str) -> None:
    """Binds the run's recorded subword tokenizer (its copy in ``output_dir``) wherever the
    config binds a tokenizer, so evaluation and decoding need neither the original model
    file nor a retraining; a byte-level run needs nothing."""
    from revtrain.training.run_tokenizer import read_run_tokenizer

    tokenizer = read_run_tokenizer(output_dir)
    if tokenizer is None or tokenizer.byte_level:
        return
    for name in _TOKENIZED_INPUTS:
        try:
            gin.query_parameter(f"{name}.tokenizer")
        except ValueError:  # Not bound: this input is not used with a tokenizer.
            continue
        gin.bind_parameter(f"{name}.tokenizer", tokenizer)
