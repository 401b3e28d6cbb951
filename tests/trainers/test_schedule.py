"""Tests for revtrain.trainers.schedule: the ops of one step."""
from revtrain.trainers import build_schedule


def test_forward_then_loss_then_backward_in_reverse():
    ops = build_schedule([2, 0, 1])
    assert [(op.kind, op.layer) for op in ops] == [
        ("forward", 0), ("forward", 1), ("forward", 2), ("forward", 3), ("forward", 4),
        ("forward", 5), ("loss", 6), ("reverse", 5), ("fbo", 4), ("fbo", 3),
        ("reverse", 2), ("reverse", 1), ("fbo", 0)]
    assert [op.layer for op in ops if op.starts_block] == [0, 3, 4]
    assert [op.block for op in ops if op.kind == "fbo"] == [2, 1, 0]
    assert ops[6].label == "loss/layer6" and ops[7].label == "backward/layer5"


def test_every_layer_has_one_forward_and_one_update():
    ops = build_schedule([3, 1])
    n_layers = 3 + 1 + 1 + 1 + 1
    updates = sorted(op.layer for op in ops if op.kind != "forward")
    assert updates == list(range(n_layers))
    assert sorted(op.layer for op in ops if op.kind == "forward") == list(range(n_layers - 1))
