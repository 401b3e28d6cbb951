"""`LiveDispatcher`: observers hear of each dispatch before it runs and of each phase, an
observer added later is told too, and `release` deletes the step's transient buffers."""
import jax
import jax.numpy as jnp
import pytest

from revtrain.parallel.inflight import InflightLimit
from revtrain.parallel.placement import Placement
from revtrain.trainers.common.dispatch import LiveDispatcher


class Recorder:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def on_dispatch(self, label, program, args):
        self.log.append((self.name, "dispatch", label, len(args)))

    def on_phase(self, label):
        self.log.append((self.name, "phase", label))


class PhaseOnly:
    def __init__(self, log):
        self.log = log

    def on_phase(self, label):
        self.log.append(("phase-only", "phase", label))


def _dispatcher(observers):
    return LiveDispatcher(lambda: observers, InflightLimit(Placement.resolve(n_devices=1)))


def test_observers_hear_of_a_dispatch_before_the_program_runs():
    log, observers = [], []
    observers.append(Recorder(log, "a"))
    dispatcher = _dispatcher(observers)

    def program(x, y):
        log.append(("program",))
        return x + y

    out = dispatcher.dispatch("forward/layer0", jax.jit(program), jnp.ones(3), jnp.ones(3))
    assert log == [("a", "dispatch", "forward/layer0", 2), ("program",)]
    assert out.tolist() == [2.0, 2.0, 2.0]


def test_an_observer_appended_later_is_told_and_partial_observers_are_allowed():
    log = []
    observers = [Recorder(log, "a")]
    dispatcher = _dispatcher(observers)
    dispatcher.phase("step_start")
    observers.extend([Recorder(log, "b"), PhaseOnly(log)])
    dispatcher.phase("step_end")
    dispatcher.dispatch("train_step", jax.jit(lambda x: x), jnp.zeros(()))
    assert log == [("a", "phase", "step_start"),
                   ("a", "phase", "step_end"), ("b", "phase", "step_end"),
                   ("phase-only", "phase", "step_end"),
                   ("a", "dispatch", "train_step", 1), ("b", "dispatch", "train_step", 1)]


def test_call_runs_a_helper_without_telling_observers():
    log = []
    dispatcher = _dispatcher([Recorder(log, "a")])
    assert dispatcher.call(lambda x: x * 2, 3) == 6
    assert log == []


def test_release_deletes_the_arrays_of_a_tree():
    dispatcher = _dispatcher([])
    tree = {"a": jnp.ones(4), "b": (jnp.zeros(2),)}
    dispatcher.release(tree)
    assert tree["a"].is_deleted() and tree["b"][0].is_deleted()
    with pytest.raises(RuntimeError):
        tree["a"] + 1
