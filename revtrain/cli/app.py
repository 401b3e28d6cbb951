"""The console scripts (``setup.cfg``): each tool's ``*_main`` under ``absl.app.run``."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence

from absl import app, flags

from revtrain import host_heap
from revtrain.cli.decode import decode_main
from revtrain.cli.evaluate import eval_main
from revtrain.cli.plan import plan_main
from revtrain.cli.tokenizer import tokenizer_main
from revtrain.cli.train import train_main


def _app_run(main: Callable[[Sequence[str]], int], tool: str) -> None:
    """Runs ``main(sys.argv)`` under ``absl.app.run``; exits with its status.

    The host allocator is tuned first (`revtrain.host_heap.configure_host_allocator`;
    ``REVTRAIN_HOST_ALLOCATOR=system`` opts out). ``main`` parses its own flag set (which
    holds absl's logging flags), so ``absl.app`` only needs ``FLAGS`` marked parsed; INFO
    lines are shown without absl's prefix. A bad ``REVTRAIN_HOST_ALLOCATOR`` is a one-line
    ``<tool>: error:`` with exit status 2 (``tool`` names the command also under
    ``python -m revtrain``, whose ``argv[0]`` is ``__main__.py``).
    """
    flags.FLAGS.set_default("showprefixforinfo", False)
    try:  # Before any JAX computation: the runtime's threads pick their heap once.
        host_heap.configure_host_allocator()
    except ValueError as e:
        print(f"{tool}: error: ValueError: {e}", file=sys.stderr)
        sys.exit(2)

    def parse(argv: list[str]) -> list[str]:
        flags.FLAGS.mark_as_parsed()
        return argv

    def run_main(argv: list[str]) -> int:
        status = main(argv)
        _nothing_after_the_last_line(status)
        return status

    app.run(run_main, flags_parser=parse)


def _nothing_after_the_last_line(status: int) -> None:
    """Keeps the command's last line last while the interpreter shuts down.

    Once ``main`` has returned, its work is done (checkpoints committed, the lock
    released), so a Ctrl-C now exits at once with status 130 instead of raising
    ``KeyboardInterrupt`` inside an ``atexit`` handler. After a failure reported in one
    line (status not 0; ``--traceback`` raises instead of returning), what the failure left
    behind -- orbax's and tensorstore's threads, asyncio's "Event loop is closed", C++
    logs -- is not shown: Python's reports of it are dropped and stderr goes to
    ``/dev/null``.
    """
    import signal
    import threading
    import warnings

    def exit_now(signum: int, frame: object) -> None:
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, exit_now)
    if status == 0:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    sys.unraisablehook = lambda unraisable: None
    threading.excepthook = lambda args: None
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stderr.fileno())
    os.close(devnull)


def run_train() -> None:
    """Console script ``revtrain-train`` (also ``python -m revtrain``)."""
    _app_run(train_main, "revtrain-train")


def run_eval() -> None:
    """Console script ``revtrain-eval``."""
    _app_run(eval_main, "revtrain-eval")


def run_decode() -> None:
    """Console script ``revtrain-decode``."""
    _app_run(decode_main, "revtrain-decode")


def run_tokenizer() -> None:
    """Console script ``revtrain-tokenizer``."""
    _app_run(tokenizer_main, "revtrain-tokenizer")


def run_plan() -> None:
    """Console script ``revtrain-plan``."""
    _app_run(plan_main, "revtrain-plan")


__all__ = ["run_decode", "run_eval", "run_plan", "run_tokenizer", "run_train"]
