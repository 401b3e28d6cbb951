"""End-to-end tests of revtrain-plan and revtrain-train --memory_budget on the tiny copy
task: the table and the pick, one line for what cannot be planned, nothing written before
the plan is made, and a resumed run keeps its pick."""
import os

import pytest

from revtrain import cli
from tests.cli_helpers import COPY_TASK, TINY, _steps, _train


def _plan(*flags_):
    argv = ["revtrain-plan", f"--config_file={COPY_TASK}"]
    return cli.plan_main(argv + [f"--gin_bindings={b}" for b in TINY] + list(flags_))


def test_plan_prints_every_candidate_the_pick_and_its_bindings(capsys):
    assert _plan("--memory_budget=1GiB") == 0
    out = capsys.readouterr().out
    for name in ("| Trainer |", "| Trainer + remat |", "| ReversibleSerialTrainer |",
                 "| MemoryEfficientTrainer |"):
        assert name in out
    assert "pick: " in out and "RunConfig.trainer_class = @" in out
    assert "RunConfig.accumulate_steps = 1" in out
    assert "on this CPU host device memory is RAM: expected process RSS about" in out


@pytest.mark.parametrize("budget", ["12 GB", "-1", "0", "12"])
def test_a_malformed_budget_is_one_line_and_exit_2(capsys, budget):
    assert _plan(f"--memory_budget={budget}") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--memory_budget=12GiB" in err


def test_a_budget_nothing_fits_exits_1_naming_the_smallest_peak(capsys):
    assert _plan("--memory_budget=4KiB") == 1
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith("revtrain-plan: nothing fits")]
    assert len(line) == 1 and "smallest predicted peak" in line[0]


def test_train_with_a_budget_applies_and_records_the_pick_and_resumes_with_it(tmp_path,
                                                                                capsys):
    out = str(tmp_path / "run")
    assert _train(out, "train.steps=2", "CheckpointConfig.every=2",
                  extra_flags=["--memory_budget=1GiB"]) == 0
    captured = capsys.readouterr()
    assert "first step: predicted peak" in captured.err
    with open(os.path.join(out, "plan.gin")) as f:
        recorded = f.read()
    with open(os.path.join(out, "config.gin")) as f:
        config = f.read()
    for line in recorded.splitlines()[1:]:
        assert line in config  # The pick's bindings are the run's.
    assert _train(out, "train.steps=4", "CheckpointConfig.every=2",
                  extra_flags=["--memory_budget=1KiB"]) == 0  # Reapplied, not replanned.
    assert "resuming with the plan recorded in" in capsys.readouterr().err
    assert _steps(out) == [2, 4]


@pytest.mark.parametrize("budget, message", [
    ("4KiB", "nothing fits in 4.0 KiB"), ("12 GB", "is not a budget"),
])
def test_train_writes_nothing_when_the_budget_cannot_be_planned(tmp_path, capsys, budget,
                                                                message):
    out = str(tmp_path / "run")
    assert _train(out, "train.steps=2", extra_flags=[f"--memory_budget={budget}"]) == 2
    err = capsys.readouterr().err
    assert message in err and not os.path.exists(out)


def test_a_run_started_without_a_plan_is_not_replanned(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert _train(out, "train.steps=2", "CheckpointConfig.every=2") == 0
    assert _train(out, "train.steps=4", extra_flags=["--memory_budget=1GiB"]) == 2
    assert "was started without a plan" in capsys.readouterr().err
    assert _steps(out) == [2]
