"""The compilation-cache flags of ``revtrain-train``, ``revtrain-eval`` and ``revtrain-decode``.

``--compilation_cache_dir=DIR`` moves JAX's persistent compilation cache and
``--nocompilation_cache`` turns it off; either beats the run's gin setting
(``CompilationCacheConfig.directory`` / ``.enabled``), which beats the user's own JAX
setting, which beats the default directory (`revtrain.training.compile_cache`).
"""

from __future__ import annotations

import dataclasses

from absl import flags

from revtrain.cli.common import UsageError

_SOURCE = "--compilation_cache_dir or CompilationCacheConfig.directory"


def define_cache_flags(fv: flags.FlagValues) -> None:
    """Adds ``--compilation_cache_dir`` and ``--[no]compilation_cache`` to ``fv``."""
    flags.DEFINE_string("compilation_cache_dir", None, "Directory of JAX's persistent "
                        "compilation cache (default: CompilationCacheConfig.directory, "
                        "else JAX's own jax_compilation_cache_dir, else "
                        "$XDG_CACHE_HOME/revtrain/jax or ~/.cache/revtrain/jax).",
                        flag_values=fv)
    flags.DEFINE_boolean("compilation_cache", None, "Load and save compiled programs in "
                         "the persistent compilation cache (default: "
                         "CompilationCacheConfig.enabled, True); --nocompilation_cache "
                         "compiles everything afresh.", flag_values=fv)


def use_flagged_cache(fv: flags.FlagValues) -> str | None:
    """Turns on the cache the gin config (parsed already) and the flags ask for; call it
    before anything compiles. Returns the directory in use, or None.

    Raises:
      UsageError: for an empty ``--compilation_cache_dir``, or one given with
        ``--nocompilation_cache``.
    """
    from revtrain import configurables
    from revtrain.training.compile_cache import use_compilation_cache

    directory, enabled = fv.compilation_cache_dir, fv.compilation_cache
    if directory is not None and not directory.strip():
        raise UsageError("--compilation_cache_dir is empty; give a directory, or "
                         "--nocompilation_cache to turn the cache off")
    if directory is not None and enabled is False:
        raise UsageError("--compilation_cache_dir and --nocompilation_cache are both "
                         "given; give one of them")
    config = configurables.compilation_cache_config()
    if directory is not None:
        config = dataclasses.replace(config, directory=directory, enabled=True)
    if enabled is not None:
        config = dataclasses.replace(config, enabled=enabled)
    return use_compilation_cache(config, source=_SOURCE)
