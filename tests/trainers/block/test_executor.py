"""Tests for revtrain.trainers.block.executor: `run_step` against a fake store and a recording
dispatcher, with symbolic values (strings), so the order of a step's ops, store calls and
program calls is written down here in one place."""
import dataclasses
from types import SimpleNamespace

import pytest

from revtrain.trainers.block import contract, executor
from revtrain.trainers.block.executor import (
    HANDLERS,
    BlockStep,
    StepCarry,
    StepInputs,
    run_step,
)
from revtrain.trainers.block.finishers import NORM
from revtrain.trainers.block.plan import OpKind, build_plan, build_schedule


def _layers(block_sizes, loss_n_in=4):
    """Fake flat layers: a standard layer (inputs -> two items) opening each block,
    reversible layers of two items, and a loss layer taking the whole final stack (two
    items, the targets and, by default, the weights)."""
    layers = []
    for n_rev in block_sizes:
        layers.append(SimpleNamespace(name=f"std{len(layers)}",
                                      n_in=1 if not layers else 2, n_out=2))
        layers += [SimpleNamespace(name=f"rev{len(layers) + k}", n_in=2, n_out=2)
                   for k in range(n_rev)]
    layers.append(SimpleNamespace(name="loss", n_in=loss_n_in, n_out=1))
    return layers


class _Fake:
    """A fake program that donates nothing (names have no buffers)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, args, values, shared):
        return self.fn(args, values, shared)

    def donated(self, args, values, shared):
        return ()


def _program(op, layer):
    """A fake program: typed outputs computed by name from the op's arguments."""
    i = op.layer

    def program(args, values, shared):
        if op.kind == OpKind.FORWARD:
            return contract.ForwardOut((f"y{i}a", f"y{i}b"), f"state{i}'")
        if op.kind == OpKind.LOSS:
            ct = tuple(f"ct_final{k}" for k in range(layer.n_in))
            if op.finisher == NORM:
                return contract.NormOut(None, ct, f"sq{i}")
            return contract.LossOut("loss", ct, ("new", values), f"state{i}'", f"stats{i}")
        x = (f"x{i}a", f"x{i}b") if layer.n_in == 2 else f"x{i}"
        ct_x = tuple(f"ct_x{i}{s}" for s in "ab") if layer.n_in == 2 else f"ct_x{i}"
        if op.finisher == NORM:
            return contract.NormOut(None if op.run.from_stash else x, ct_x, f"sq{i}")
        if op.run.from_stash:
            return contract.FboOut(ct_x, ("new", values), f"stats{i}")
        return contract.ReverseOut(x, ct_x, ("new", values), f"stats{i}")
    return _Fake(program)


class FakeStore:
    """A `StepValues` of names, keyed by each op's run (named by its first layer here);
    records every call that changes something."""

    def __init__(self):
        self.log = []

    def begin_step(self):
        self.log.append("begin_step")

    def prepare(self, position):
        pass

    def weights(self, run):
        return f"w{run.start}"

    def params(self, run):
        return f"params{run.start}"

    def keep_params(self, run, params):
        self.log.append(("keep_params", run.start, params))

    def state(self, run):
        return f"state{run.start}"

    def new_state(self, run):
        return f"state{run.start}'"

    def keep_state(self, run, new_state):
        self.log.append(("keep_state", run.start, new_state))

    def stash(self, stack):
        self.log.append(("stash", stack))
        return ("stashed", stack)

    def unstash(self, kept):
        assert kept[0] in ("stashed", "final"), kept
        return kept[1]

    def end_forward(self, stack):
        self.log.append(("end_forward", stack))
        return ("final", stack)

    def finish_step(self):
        self.log.append("finish_step")


class RecordingDispatcher:
    def __init__(self):
        self.calls, self.phases, self.helpers = [], [], []

    def dispatch(self, label, program, *args):
        self.calls.append((label, type(args[0]).__name__, args[-1].clip))
        return program(*args)

    def call(self, fn, *args):
        self.helpers.append(args)
        return fn(*args)

    def phase(self, label):
        self.phases.append((label, len(self.calls)))

    def release(self, tree):
        raise AssertionError("free_transients is off")


def _step(block_sizes, **schedule_args):
    layers = _layers(block_sizes)
    schedule = build_schedule(block_sizes, **schedule_args)
    return BlockStep(
        plan=build_plan(layers, schedule, _program),
        indices=tuple(range(len(layers))), max_norm="max_norm", free_transients=False,
        summarize=lambda stats: (stats, "gradients_l2", "weights_l2"),
        sqrt_of_sum=lambda squares: f"sqrt(sum{squares})")


def test_the_op_order_of_one_step():
    store, dispatcher = FakeStore(), RecordingDispatcher()
    batch = ("inputs", "targets", "weights")
    result = run_step(_step([2]), store, dispatcher, StepInputs(batch, "rngs", None))
    assert [(label, kind) for label, kind, _ in dispatcher.calls] == [
        ("forward/layer0", "ForwardArgs"),   # Block 0's standard layer: batch -> 2 items.
        ("forward/layer1", "ForwardArgs"),
        ("forward/layer2", "ForwardArgs"),
        ("loss/layer3", "LossArgs"),
        ("backward/layer2", "ReverseArgs"),  # Reversible layers reconstruct their input,
        ("backward/layer1", "ReverseArgs"),
        ("backward/layer0", "FboArgs"),      # the standard one recomputes from its stash.
    ]
    assert dispatcher.phases == [("step_start", 0), ("loss_start", 3), ("backward_start", 4)]
    assert store.log == [
        "begin_step",
        ("stash", "weights"),                # The batch weights wait for the loss op.
        ("stash", batch),                    # The block input, for its standard layer.
        ("keep_state", 0, "state0'"), ("keep_state", 1, "state1'"),
        ("keep_state", 2, "state2'"),
        ("end_forward", ("y2a", "y2b", "targets", "weights")),
        ("keep_params", 3, ("new", "params3")), ("keep_state", 3, "state3'"),
        ("keep_params", 2, ("new", "params2")), ("keep_params", 1, ("new", "params1")),
        ("keep_params", 0, ("new", "params0")),
        "finish_step",
    ]
    stats, gradients_l2, weights_l2 = dispatcher.helpers[-1][0], *result[2:]
    assert stats == ("stats0", "stats1", "stats2", "stats3")  # Flat-layer order.
    assert result.loss == "loss" and (gradients_l2, weights_l2) == ("gradients_l2",
                                                                     "weights_l2")


def test_a_reversed_layer_hands_its_reconstructed_input_and_cotangent_down():
    seen = []

    def program(op, layer):
        inner = _program(op, layer)

        def wrapped(args, values, shared):
            seen.append((op.label, args))
            return inner(args, values, shared)
        return _Fake(wrapped)
    layers, schedule = _layers([2], loss_n_in=3), build_schedule([2])
    step = dataclasses.replace(_step([2]), plan=build_plan(layers, schedule, program))
    run_step(step, FakeStore(), RecordingDispatcher(),
             StepInputs(("inputs", "targets"), "rngs", None))
    by_label = dict(seen)
    assert by_label["backward/layer1"].y == ("x2a", "x2b")        # Layer 2's input.
    assert by_label["backward/layer1"].ct_y == ("ct_x2a", "ct_x2b")
    assert by_label["backward/layer0"].x == "inputs"  # From the stashed batch.
    assert by_label["backward/layer0"].ct_y == ("ct_x1a", "ct_x1b")
    assert by_label["backward/layer2"].ct_y == ("ct_final0", "ct_final1")
    assert by_label["loss/layer3"].batch_weights is None          # A batch without weights.


def test_clipping_runs_a_norm_pass_whose_norm_scales_every_update():
    store, dispatcher = FakeStore(), RecordingDispatcher()
    run_step(_step([1], clip_global_norm=True), store, dispatcher,
             StepInputs(("inputs", "targets", "weights"), "rngs", "lr"))
    labels = [label for label, _, _ in dispatcher.calls]
    assert labels == ["forward/layer0", "forward/layer1", "norm/loss/layer2",
                      "norm/backward/layer1", "norm/backward/layer0", "loss/layer2",
                      "backward/layer1", "backward/layer0"]
    clip = ("sqrt(sum('sq2', 'sq1', 'sq0'))", "max_norm")
    assert [c for _, _, c in dispatcher.calls] == [None] * 5 + [clip] * 3
    # The norm-only pass updates nothing; the update pass updates each layer once.
    assert [e[1] for e in store.log if e[0] == "keep_params"] == [2, 1, 0]


def test_a_final_stack_the_loss_layer_does_not_take_is_refused_before_any_update():
    layers = _layers([1], loss_n_in=3)
    step = dataclasses.replace(_step([1]), plan=build_plan(layers, build_schedule([1]), _program))
    store = FakeStore()
    with pytest.raises(ValueError, match="takes 3 stack items but the model leaves 4"):
        run_step(step, store, RecordingDispatcher(),
                 StepInputs(("inputs", "targets", "weights"), "rngs", None))
    assert not any(e[0] == "keep_params" for e in store.log if isinstance(e, tuple))


def test_every_op_kind_has_one_handler():
    assert set(HANDLERS) == set(OpKind) and len(OpKind) == 3  # Forward, loss, backward.


def test_the_carry_says_what_a_donating_call_must_leave_alone():
    c = StepCarry("batch", ("a", "b", "below"), ct=("ct_a", "ct_b", "ct_below"),
                  kept={0: "stash"}, kept_weights="w", reread="final")
    below, ct_below, kept, kept_weights, batch, reread = c.leave_alone(2, 1)
    assert below == ("below",) and ct_below == ("ct_b", "ct_below")
    assert (kept, kept_weights, batch, reread) == ({0: "stash"}, "w", "batch", "final")
    assert StepCarry("batch", "x").leave_alone(1, 0)[:2] == ((), ())  # No cotangents yet.


def test_only_the_norm_pass_leaves_the_final_activations_alone(monkeypatch):
    """The norm pass's ops must not donate the final stack (the update pass reads it
    again); the update pass's may."""
    carries, seen = [], []

    class Spy(StepCarry):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            carries.append(self)

    class Watching(RecordingDispatcher):
        def dispatch(self, label, program, *args):
            seen.append((label, carries[0].reread))
            return super().dispatch(label, program, *args)

    monkeypatch.setattr(executor, "StepCarry", Spy)
    run_step(_step([1], clip_global_norm=True), FakeStore(), Watching(),
             StepInputs(("inputs", "targets", "weights"), "rngs", None))
    final = ("final", ("y1a", "y1b", "targets", "weights"))
    assert seen == [("forward/layer0", None), ("forward/layer1", None),
                    ("norm/loss/layer2", final), ("norm/backward/layer1", final),
                    ("norm/backward/layer0", final), ("loss/layer2", None),
                    ("backward/layer1", None), ("backward/layer0", None)]
