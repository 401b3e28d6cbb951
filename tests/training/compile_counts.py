"""Runs one revtrain tool in this process and writes what JAX compiled (not a test file).

``python -m tests.training.compile_counts OUT.json train|eval|decode [flags...]`` counts,
with `jax.monitoring` listeners, every XLA compile request
(``/jax/core/compile/backend_compile_duration``: a compile or a persistent-cache load) and
the persistent cache's hits and misses, and writes them with the tool's exit status.
"""
import collections
import json
import sys

import jax

COMPILE = "/jax/core/compile/backend_compile_duration"
HITS = "/jax/compilation_cache/cache_hits"
MISSES = "/jax/compilation_cache/cache_misses"


def main(out: str, tool: str, *argv: str) -> None:
    counts: collections.Counter = collections.Counter()
    jax.monitoring.register_event_listener(lambda event, **_: counts.update([event]))
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: counts.update([event]))
    from revtrain import cli

    main_of = {"train": cli.train_main, "eval": cli.eval_main, "decode": cli.decode_main}
    status = main_of[tool]([f"revtrain-{tool}", *argv])
    with open(out, "w") as f:
        json.dump({"status": status, "compiles": counts[COMPILE], "hits": counts[HITS],
                   "misses": counts[MISSES]}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
