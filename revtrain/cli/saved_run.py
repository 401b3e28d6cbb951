"""A trained run read back from its directory, for ``revtrain-eval`` and ``revtrain-decode``.

Both programs rebuild the run from the ``config.gin`` that ``revtrain-train`` wrote into
``output_dir`` (plus their own ``--config_file`` / ``--gin_bindings``) and the tokenizer
the run recorded. A ``config.gin`` that is missing, empty, does not parse or binds no model
is refused in one line that names the file, what it lacks and the run's newest kept
config to copy over it (`revtrain.training.config_history`).
"""

from __future__ import annotations

import os
import time

import gin
from absl import flags

from revtrain.cli.cache_flags import use_flagged_cache
from revtrain.cli.common import (
    GinFileError,
    UsageError,
    initialize_distributed,
    parse_gin,
    use_run_tokenizer,
)
from revtrain.training.run_directory import CONFIG_FILE, HISTORY_DIR, broken_link_error


def read_run(fv: flags.FlagValues) -> tuple[str, dict, int]:
    """``(output_dir, run configs, train.steps)`` from the run's config.gin (plus flags).

    JAX's persistent compilation cache is turned on (or off) as the flags and the run's
    gin say, once gin is parsed and before anything compiles.

    Raises:
      UsageError: in one line, for a missing ``--output_dir`` or ``config.gin``, an
        ``--output_dir`` that is a symbolic link to a missing target, and for a
        ``config.gin`` that is empty, does not parse or binds no ``RunConfig.model`` /
        ``RunConfig.inputs``.
    """
    if not fv.output_dir:
        raise UsageError("--output_dir is required (the directory revtrain-train wrote)")
    broken = broken_link_error("--output_dir", fv.output_dir)
    if broken:
        raise UsageError(broken)
    output_dir = os.path.abspath(fv.output_dir)
    config = os.path.join(output_dir, CONFIG_FILE)
    if getattr(fv, "wait", False):  # revtrain-eval --wait may start before the training.
        while not os.path.isfile(config):
            time.sleep(min(fv.poll_seconds, 600.0))
    if not os.path.isfile(config):
        raise UsageError(f"{config} not found; is {output_dir} a revtrain-train output_dir?")
    initialize_distributed(fv)
    try:
        parse_gin([config, *fv.config_file], fv.gin_bindings)
    except GinFileError as e:
        if e.path != config:
            raise
        raise _damaged_config(output_dir, f"it does not parse ({e.reason})") from e
    # Before anything compiles (building the configs evaluates the schedule's first steps):
    # the flags and the run's CompilationCacheConfig are known once gin is parsed.
    use_flagged_cache(fv)
    use_run_tokenizer(output_dir)
    from revtrain import configurables

    bindings = gin.get_bindings("train")
    configs = configurables.run_configs()
    missing = [f"RunConfig.{name}" for name in ("model", "inputs")
               if getattr(configs["run"], name) is None]
    if missing:  # Not the operative config revtrain-train writes (emptied, cut, replaced).
        raise _damaged_config(output_dir, "it is empty" if not _gin_statements(config) else
                              f"it binds no {' and no '.join(missing)}")
    return output_dir, configs, int(bindings.get("steps", 1000))


def _gin_statements(path: str) -> list[str]:
    """The lines of a gin file that are neither blank nor comments."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line for line in f if line.strip() and not line.lstrip().startswith("#")]


def _damaged_config(output_dir: str, what: str) -> UsageError:
    """The one-line error for a run's ``config.gin`` that is not a run's configuration:
    the file, ``what`` is wrong, and the fix: copy back the newest config the run kept
    (`revtrain.training.config_history`)."""
    history = os.path.join(output_dir, HISTORY_DIR)
    kept = sorted(n for n in os.listdir(history) if n.endswith(".gin")) if os.path.isdir(
        history) else []
    fix = (f"copy the run's newest kept config, {os.path.join(history, kept[-1])}, over it"
           if kept else "replace it with the gin config the run was trained with")
    return UsageError(f"{os.path.join(output_dir, CONFIG_FILE)} is not a run's "
                      f"configuration: {what}; {fix}")
