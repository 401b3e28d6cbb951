"""Tests of revtrain/training/interrupts.py.

Signals are sent with ``signal.raise_signal``, which runs the Python handler before it
returns; ``os.kill(os.getpid(), ...)`` only queues it for a later bytecode boundary (or,
with JAX's threads about, another thread), which made these tests flaky under load.
"""
import signal

import numpy as np
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


def test_a_repeated_sigterm_is_absorbed_with_a_warning(caplog):
    import logging

    with caplog.at_level(logging.WARNING), StopOnSignals() as stop:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
    assert stop.signum == signal.SIGTERM
    assert "received SIGTERM again: ignored; the run stops once its checkpoint is saved" \
        in caplog.text


def test_sighup_is_a_stop_request_like_sigterm(caplog):
    """A closed terminal or ssh session sends SIGHUP: recorded as a stop request (not
    Python's default, which ends the process unsaved), repeats absorbed with the same
    warning as SIGTERM's, and the handler restored."""
    import logging

    before = signal.getsignal(signal.SIGHUP)
    with caplog.at_level(logging.WARNING), StopOnSignals() as stop:
        assert signal.getsignal(signal.SIGHUP) == stop._handle
        signal.raise_signal(signal.SIGHUP)
        assert stop.requested() and stop.signum == signal.SIGHUP
        signal.raise_signal(signal.SIGHUP)
    assert stop.signum == signal.SIGHUP
    assert ("received SIGHUP again: ignored; the run stops once its checkpoint is saved "
            "(a second Ctrl-C forces an exit)") in caplog.text
    assert signal.getsignal(signal.SIGHUP) is before


# ------------------------------------------------------------------------------------------
# Signals during a Loop's saves: the save completes, and the run resumes bit-exact.

def _loop(output_dir, every=2, async_save=False):
    from revtrain.data import CopyTask
    from revtrain.training import CheckpointConfig, EvalConfig, LogConfig, RunConfig, build_loop
    from tests.training.tiny_models import tiny_reversible_lm

    run = RunConfig(model=tiny_reversible_lm, schedule=3e-3,
                    inputs=CopyTask(vocab_size=16, length=4, batch_size=4, seed=1))
    return build_loop(run, EvalConfig(every=0, steps=1),
                      CheckpointConfig(every=every, async_save=async_save),
                      LogConfig(progress=False), output_dir)


def _state(loop):
    import jax

    return jax.tree.map(np.asarray, (loop.trainer.train_state, loop.step,
                                     jax.random.key_data(loop._rng)))


def _assert_exact(actual, expected):
    import jax

    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, e)


@pytest.fixture(scope="module")
def straight_8(tmp_path_factory):
    with _loop(str(tmp_path_factory.mktemp("straight"))) as loop:
        loop.run(8)
    return _state(loop)


@pytest.fixture
def outer_sigterm():
    """SIGTERMs that reach the handler outside the loop's (the test's, not the default
    one, which would end the test process)."""
    reached = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: reached.append(signum))
    yield reached
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def outer_sighup():
    """SIGHUPs that reach the handler outside the loop's (Python's default one would end
    the test process)."""
    reached = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: reached.append(signum))
    yield reached
    signal.signal(signal.SIGHUP, previous)


def _signal_inside(monkeypatch, owner, name, times=2, when=lambda *args: True,
                   signum=signal.SIGTERM):
    """Makes ``owner.name`` raise ``signum`` ``times`` times (each call ``when`` allows)
    first."""
    real = getattr(owner, name)
    raised = []

    def wrapper(*args, **kwargs):
        if len(raised) < times and when(*args):
            for _ in range(times):
                raised.append(signum)
                signal.raise_signal(signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return raised


def _resume_to_8(output_dir, straight_8, restored):
    with _loop(output_dir) as resumed:
        assert resumed.step == restored
        resumed.run(8)
    _assert_exact(_state(resumed), straight_8)


def test_sigterm_twice_during_the_final_save_of_a_finished_run(tmp_path, monkeypatch,
                                                               outer_sigterm, straight_8):
    from revtrain.training import Checkpointer
    from revtrain.training.checkpoints import retention

    out = str(tmp_path)
    loop = _loop(out, every=4)
    # record_promise runs inside Checkpointer.save, before orbax writes the step.
    raised = _signal_inside(monkeypatch, retention, "record_promise",
                            when=lambda directory, promises, period, interval, step: step == 7)
    with loop:
        loop.run(7)
    monkeypatch.undo()
    assert raised and outer_sigterm == []  # Both absorbed by the loop's handler.
    assert loop.interrupted_by == signal.SIGTERM
    assert Checkpointer(str(tmp_path / "checkpoints")).all_steps() == [4, 7]
    _resume_to_8(out, straight_8, 7)


def test_sigterm_during_an_async_save_lets_it_commit(tmp_path, monkeypatch, outer_sigterm,
                                                     straight_8):
    from revtrain.training import Checkpointer

    out = str(tmp_path)
    loop = _loop(out, async_save=True)
    # Waiting for the final save: the signals arrive while its write is in flight.
    raised = _signal_inside(monkeypatch, Checkpointer, "wait_until_finished")
    with loop:
        loop.run(7)
    monkeypatch.undo()
    assert raised and outer_sigterm == []
    assert loop.interrupted_by == signal.SIGTERM
    assert Checkpointer(str(tmp_path / "checkpoints")).all_steps() == [4, 6, 7]
    _resume_to_8(out, straight_8, 7)


def test_sighup_mid_run_saves_then_stops_and_the_run_resumes_bit_exact(
        tmp_path, monkeypatch, outer_sighup, straight_8):
    """SIGHUP (the terminal closed) during step 3 is handled as SIGTERM: the run finishes
    the step, saves it and stops; nothing reaches the handler outside the loop."""
    from revtrain.training import Checkpointer

    out = str(tmp_path)
    loop = _loop(out, every=4)
    real = loop.trainer.one_step

    def one_step(batch, rng, step=0, learning_rate=None):
        if step == 2:  # The third step: the loop's step counter is 2 while it runs.
            signal.raise_signal(signal.SIGHUP)
        return real(batch, rng, step=step, learning_rate=learning_rate)

    monkeypatch.setattr(loop.trainer, "one_step", one_step)
    with loop:
        loop.run(7)
    monkeypatch.undo()
    assert outer_sighup == []
    assert loop.interrupted_by == signal.SIGHUP and loop.step == 3
    assert Checkpointer(str(tmp_path / "checkpoints")).all_steps() == [3]
    _resume_to_8(out, straight_8, 3)
