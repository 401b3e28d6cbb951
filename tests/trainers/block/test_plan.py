"""Tests for revtrain.trainers.block.plan: the ops of one step."""
import pytest

from revtrain.trainers import build_schedule


def test_forward_then_loss_then_backward_in_reverse():
    ops = build_schedule([2, 0, 1])
    assert [(op.kind, op.layer) for op in ops] == [
        ("forward", 0), ("forward", 1), ("forward", 2), ("forward", 3), ("forward", 4),
        ("forward", 5), ("loss", 6), ("backward", 5), ("backward", 4), ("backward", 3),
        ("backward", 2), ("backward", 1), ("backward", 0)]
    # Every op runs a run of one repetition; a block's input is kept for its standard layer.
    assert all(op.run[1:4] == (1, 1, 0) for op in ops)
    assert [op.layer for op in ops if op.kind == "forward" and op.run.from_stash] == [0, 3, 4]
    assert [op.block for op in ops if op.run.from_stash and op.kind == "backward"] == [2, 1, 0]
    assert ops[6].label == "loss/layer6" and ops[7].label == "backward/layer5"


def test_every_layer_has_one_forward_and_one_update():
    ops = build_schedule([3, 1])
    n_layers = 3 + 1 + 1 + 1 + 1
    updates = sorted(op.layer for op in ops if op.kind != "forward")
    assert updates == list(range(n_layers))
    assert sorted(op.layer for op in ops if op.kind == "forward") == list(range(n_layers - 1))


def test_keep_every_turns_every_kth_reversal_into_a_recompute_from_a_kept_copy():
    ops = build_schedule([5, 2], keep_every=2)
    kept = [op.layer for op in ops if op.kind == "forward" and op.run.from_stash]
    assert kept == [0, 3, 5, 6]  # Block inputs, and reversible layers 2 and 4 of block 0.
    backward = [(op.layer, op.run.from_stash) for op in ops[ops.index(
        next(op for op in ops if op.kind == "loss")) + 1:]]
    assert backward == [(8, False), (7, False), (6, True), (5, True), (4, False), (3, True),
                        (2, False), (1, False), (0, True)]
    assert build_schedule([5, 2], keep_every=8) == build_schedule([5, 2])


def test_clip_global_norm_runs_the_backward_ops_twice_first_with_the_norm_finisher():
    from revtrain.trainers.block.finishers import NORM, UPDATE
    plain = build_schedule([2, 1])
    ops = build_schedule([2, 1], clip_global_norm=True)
    n_forward = sum(op.kind == "forward" for op in plain)
    update = plain[n_forward:]
    assert ops[:n_forward] == plain[:n_forward] and ops[-len(update):] == update
    norm = ops[n_forward:-len(update)]
    assert [(op.kind, op.layer) for op in norm] == [(op.kind, op.layer) for op in update]
    assert all(op.finisher == NORM and op.label.startswith("norm/") for op in norm)
    assert all(op.finisher == UPDATE for op in ops[:n_forward] + update)


def test_keep_every_below_one_is_rejected():
    with pytest.raises(ValueError, match="keep_every=0"):
        build_schedule([2], keep_every=0)


def test_a_run_is_one_scan_op_each_way_with_its_kept_offsets():
    from revtrain.trainers.block.plan import Run, runs_of
    run = Run(start=2, period=2, repeats=2, n_items=2)  # Reversible layers 1..4 of block 0.
    ops = build_schedule([5, 1], keep_every=2, runs=[run])
    assert [(op.kind, op.layer, op.label) for op in ops] == [
        ("forward", 0, "forward/layer0"), ("forward", 1, "forward/layer1"),
        ("forward", 2, "forward/layers2-5"), ("forward", 6, "forward/layer6"),
        ("forward", 7, "forward/layer7"), ("loss", 8, "loss/layer8"),
        ("backward", 7, "backward/layer7"), ("backward", 6, "backward/layer6"),
        ("backward", 2, "backward/layers2-5"), ("backward", 1, "backward/layer1"),
        ("backward", 0, "backward/layer0")]
    # Block positions 2 and 4 (flat 3 and 5) are kept: offsets 1 and 3 of the run, whose
    # copies it keeps itself (no stash of the whole stack).
    assert runs_of(ops) == (run._replace(kept=(1, 3)),)
    assert ops[2].run == ops[8].run and not ops[2].run.from_stash
    assert [op.layer for op in ops if op.run.from_stash] == [0, 6, 6, 0]


def test_runs_outside_one_blocks_reversible_layers_are_rejected():
    from revtrain.trainers.block.plan import Run
    with pytest.raises(ValueError, match="inside one block"):
        build_schedule([3, 2], runs=[Run(start=2, period=1, repeats=3, n_items=2)])
    with pytest.raises(ValueError, match="overlaps"):
        build_schedule([6], runs=[Run(1, 2, 2, 2), Run(3, 1, 2, 2)])
