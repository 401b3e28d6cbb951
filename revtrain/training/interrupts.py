"""Graceful stop on SIGINT / SIGTERM / SIGHUP: the loop finishes its step, saves, returns.

Inside `StopOnSignals`, the first SIGINT (Ctrl-C), SIGTERM (e.g. a preemption notice) or
SIGHUP (the terminal or ssh session of the run closed) only records the signal; the
training loop checks `StopOnSignals.requested` after each step, saves a checkpoint and
stops. These three (`STOP_SIGNALS`) are the signals that save. The loop keeps the handlers
installed until that final save has committed (`revtrain.training.loop.Loop.run`), so a
signal during the save cannot kill it half-way. Later SIGTERMs and SIGHUPs are absorbed
with a warning: a preemption sends SIGTERM and, after a grace period, SIGKILL, and a
scheduler may repeat the SIGTERM meanwhile; a closing terminal may send SIGHUP more than
once. A second SIGINT runs the previous handler (normally ``KeyboardInterrupt``), so a user
can still force an exit; orbax's saves are atomic, so the newest committed checkpoint stays
valid, and the run lock is released as the exception unwinds. Handlers can only be
installed in the main thread; elsewhere the context manager does nothing. SIGKILL cannot be
caught: the steps after the newest committed checkpoint are lost, and the next run takes
over the stale lock.
"""

from __future__ import annotations

import logging
import signal
import threading

import numpy as np

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopOnSignals:
    """Context manager that turns SIGINT/SIGTERM/SIGHUP (`STOP_SIGNALS`) into a stop request.

    Attributes:
      signum: the first signal received (an int), or None.
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        del frame
        if self.signum is None:
            self.signum = signum
        else:  # Runs between bytecodes of the main thread: logging's lock is reentrant.
            logger.warning("received %s again: ignored; the run stops once its checkpoint "
                           "is saved%s", signal.Signals(signum).name,
                           "" if signum == signal.SIGINT else
                           " (a second Ctrl-C forces an exit)")
        if signum == signal.SIGINT:  # A second Ctrl-C goes to the previous handler.
            signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT,
                                                            signal.default_int_handler))

    def __enter__(self) -> StopOnSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def requested(self) -> bool:
        """True once a stop signal arrived (in any process, when there are several).

        With several processes the flag is combined across processes (a tiny all-gather
        per call), so every process stops after the same step even when only one of them
        received the signal.
        """
        import jax

        if jax.process_count() == 1:
            return self.signum is not None
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.signum or 0))
        if self.signum is None and np.any(flags):
            self.signum = int(np.max(flags))
        return self.signum is not None
