"""Tests of revtrain/training/interrupts.py."""
import os
import signal

import pytest

from revtrain.training import StopOnSignals


def test_first_ctrl_c_requests_a_stop_second_interrupts():
    before = signal.getsignal(signal.SIGINT)
    with StopOnSignals() as stop:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested() and stop.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_sigterm_is_recorded_and_handler_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # Repeated SIGTERM keeps asking to stop.
        assert stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
