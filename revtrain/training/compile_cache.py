"""JAX's persistent compilation cache, on by default for revtrain's programs.

``revtrain-train``, ``revtrain-eval``, ``revtrain-decode`` and
`revtrain.training.build_loop` call `use_compilation_cache`, so a restarted run, an
evaluation of a run and every decode after the first load their compiled programs from
disk instead of compiling them again. The cache is JAX's own (``jax_compilation_cache_dir``;
see JAX's "Persistent compilation cache" guide): its key is JAX's hash of the lowered
program, the compile options, the XLA flags, the devices and the jax/jaxlib versions, so a
changed model, batch shape, device count or JAX version misses instead of loading a stale
program, and one directory is safe to share between runs and versions. revtrain keeps no
key or cache of its own on disk.

Where it goes, first match wins:

1. ``CompilationCacheConfig.enabled = False`` (``--nocompilation_cache``): no cache.
2. ``CompilationCacheConfig.directory`` (``--compilation_cache_dir``): that directory.
3. The user's own JAX setting: ``jax_compilation_cache_dir`` (``jax.config.update`` or the
   ``JAX_COMPILATION_CACHE_DIR`` environment variable) is kept, and
   ``jax_enable_compilation_cache = False`` (``JAX_ENABLE_COMPILATION_CACHE=false``) keeps
   the cache off.
4. The default, `default_directory`: ``$XDG_CACHE_HOME/revtrain/jax``, or
   ``~/.cache/revtrain/jax`` without ``XDG_CACHE_HOME``.

Every program is cached: JAX writes only programs that took at least
``jax_persistent_cache_min_compile_time_secs`` (default 1 s) to compile, which leaves out
nearly all of a CPU run's (tens of milliseconds each, but hundreds of them), so that
threshold is lowered to 0 unless the user changed it. ``jax_persistent_cache_min_entry_size_bytes``
is left at JAX's default 0, which already caches entries of every size. The cache is not
bounded (JAX's ``jax_compilation_cache_max_size`` bounds it, with the ``filelock``
package); delete the directory at any time to reclaim the space.

JAX trusts what it loads from the cache: keep the directory private (the default one is
in the user's home), never one others can write to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

logger = logging.getLogger(__name__)

# JAX's default compile-time threshold, below which a program is not written.
_JAX_DEFAULT_MIN_COMPILE_SECS = 1.0
# The JAX settings `use_compilation_cache` may change (and `restoring_jax_settings` restores).
_SETTINGS = ("jax_compilation_cache_dir", "jax_enable_compilation_cache",
             "jax_persistent_cache_min_compile_time_secs")


@dataclasses.dataclass(frozen=True)
class CompilationCacheConfig:
    """Where JAX's persistent compilation cache goes; the tools' flags beat it.

    Order: ``enabled=False``, then ``directory``, then the user's own JAX setting
    (``jax_compilation_cache_dir`` / ``JAX_COMPILATION_CACHE_DIR``, or
    ``jax_enable_compilation_cache=False``), then ``~/.cache/revtrain/jax``
    (``$XDG_CACHE_HOME/revtrain/jax``).

    Args:
      directory: the cache directory (``~`` expanded); None: the user's own
        ``jax_compilation_cache_dir`` if set, else `default_directory`.
      enabled: False turns the persistent cache off (``--nocompilation_cache``).

    Raises:
      ValueError: for a ``directory`` that is not a non-empty string, or an ``enabled``
        that is not a bool, naming the binding.
    """

    directory: str | None = None
    enabled: bool = True

    def __post_init__(self):
        if self.directory is not None and (not isinstance(self.directory, str)
                                           or not self.directory.strip()):
            raise ValueError(f"CompilationCacheConfig.directory={self.directory!r} is not a "
                             f"directory; give a path, or None for the default")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"CompilationCacheConfig.enabled={self.enabled!r} is not a "
                             f"bool; give True or False")


def default_directory(environ: Mapping[str, str] | None = None) -> str:
    """``$XDG_CACHE_HOME/revtrain/jax``, or ``~/.cache/revtrain/jax`` when
    ``XDG_CACHE_HOME`` is unset, empty or relative (the XDG base directory spec ignores a
    relative one)."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "revtrain", "jax")


def unwritable_reason(directory: str) -> str | None:
    """Why the cache could not be written under ``directory``, or None when it can.

    Nothing is created: the nearest existing ancestor must be a directory the process may
    write into (``os.access``, which also reports a read-only file system).
    """
    path = os.path.abspath(directory)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return f"{path} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable"
    return None


def use_compilation_cache(config: CompilationCacheConfig | None = None,
                          source: str = "CompilationCacheConfig") -> str | None:
    """Turns JAX's persistent compilation cache on (or off) for this process.

    Call it before the first program compiles. JAX's settings are process-wide, so this is
    too: a second call with the default config keeps what the first one set.

    Args:
      config: where the cache goes; default ``CompilationCacheConfig()``.
      source: how the user sets ``config``, for the warning (e.g. the command's flags).

    Returns:
      The cache directory in use, or None when the cache is off. An unwritable directory
      is logged as one warning and the run goes on without the persistent cache; the
      directory chosen is logged at DEBUG level (``--verbosity=1``), so a bad input
      after it is still the command's only line.
    """
    config = config or CompilationCacheConfig()
    if not config.enabled:
        if _update(None, enabled=False):
            logger.debug("compilation cache: off")
        return None
    if config.directory is not None:
        directory = os.path.abspath(os.path.expanduser(config.directory))
    elif not jax.config.jax_enable_compilation_cache:
        return None  # The user turned JAX's cache off.
    else:
        directory = jax.config.jax_compilation_cache_dir or default_directory()
    reason = unwritable_reason(directory)
    if reason is not None:
        logger.warning("the compilation cache %s cannot be written (%s): running without "
                       "it; give a writable directory (%s) or turn it off", directory,
                       reason, source)
        _update(None, enabled=False)
        return None
    if _update(directory, enabled=True):
        logger.debug("compilation cache: %s", directory)
    if jax.config.jax_persistent_cache_min_compile_time_secs == _JAX_DEFAULT_MIN_COMPILE_SECS:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


def _update(directory: str | None, enabled: bool) -> bool:
    """Sets JAX's cache directory (unless None) and switch; returns whether either changed.
    JAX opens its cache once per process, so it is reset on a change."""
    changed = jax.config.jax_enable_compilation_cache != enabled
    jax.config.update("jax_enable_compilation_cache", enabled)
    if directory is not None and jax.config.jax_compilation_cache_dir != directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        changed = True
    if changed:
        jax_cache.reset_cache()
    return changed


@contextlib.contextmanager
def restoring_jax_settings() -> Iterator[None]:
    """Restores JAX's cache settings on exit, so that a command called in-process (a test)
    leaves them as it found them."""
    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    try:
        yield
    finally:
        changed = {name: value for name, value in before.items()
                   if getattr(jax.config, name) != value}
        for name, value in changed.items():
            jax.config.update(name, value)
        if changed:
            jax_cache.reset_cache()
