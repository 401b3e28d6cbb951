"""Tests of revtrain/training/interrupts.py.

Signals are sent with ``signal.raise_signal``, which runs the Python handler before it
returns; ``os.kill(os.getpid(), ...)`` only queues it for a later bytecode boundary (or,
with JAX's threads about, another thread), which made these tests flaky under load.
"""
import signal

import pytest

from revtrain.training import StopOnSignals


def test_first_ctrl_c_requests_a_stop_second_interrupts():
    # The handler before is Python's own, whatever an earlier test in this worker left.
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopOnSignals() as stop:
            assert not stop.requested()
            signal.raise_signal(signal.SIGINT)
            assert stop.requested() and stop.signum == signal.SIGINT
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


def test_sigterm_is_recorded_and_handler_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignals() as stop:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # Repeated SIGTERM keeps asking to stop.
        assert stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
