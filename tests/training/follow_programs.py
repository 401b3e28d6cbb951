"""revtrain-train and revtrain-eval in step with each other, for the follow test (not a test).

``python -m tests.training.follow_programs {train|eval} EVENTS FLAGS...`` runs the real
program with two waits added, so that one checkpoint is saved while an evaluation runs by
construction, not by timing:

* the evaluator's first evaluation, once started, waits until a checkpoint newer than every
  checkpoint present at its start has been saved, then scores as usual;
* the trainer, after its first checkpoint, waits until that evaluation has started.

Each process appends ``{"event", "step", "time"}`` lines to the file EVENTS: ``eval_start``
and ``eval_end`` around every evaluation of a checkpoint.
"""
import json
import sys
import time

from revtrain import cli
from revtrain.training import Checkpointer, CheckpointEvaluator

TIMEOUT_SECONDS = 200.0  # Generous: both processes start, import and compile meanwhile.


def _record(events: str, event: str, step: int) -> None:
    with open(events, "a") as f:
        f.write(json.dumps({"event": event, "step": step, "time": time.time()}) + "\n")


def _read(events: str) -> list[dict]:
    try:
        with open(events) as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {TIMEOUT_SECONDS:g} s for {what}")
        time.sleep(0.05)


def _evaluator_waits(events: str) -> None:
    evaluate_step = CheckpointEvaluator.evaluate_step

    def evaluate_step_in_step(self, step):
        _record(events, "eval_start", step)
        if sum(e["event"] == "eval_start" for e in _read(events)) == 1:
            present = max(self.checkpointer.all_steps())

            def newer_saved():
                self.checkpointer.reload()
                return max(self.checkpointer.all_steps()) > present

            _wait_for(newer_saved, f"a checkpoint newer than step {present}")
        results = evaluate_step(self, step)
        _record(events, "eval_end", step)
        return results

    CheckpointEvaluator.evaluate_step = evaluate_step_in_step


def _trainer_waits(events: str) -> None:
    save = Checkpointer.save

    def save_in_step(self, step, tree):
        saved = save(self, step, tree)
        if saved and self.all_steps() == [step]:  # The run's first checkpoint.
            _wait_for(lambda: any(e["event"] == "eval_start" for e in _read(events)),
                      "the first evaluation to start")
        return saved

    Checkpointer.save = save_in_step


def main(argv: list[str]) -> int:
    role, events, flags = argv[1], argv[2], argv[3:]
    if role == "eval":
        _evaluator_waits(events)
        return cli.eval_main(["revtrain-eval", *flags])
    _trainer_waits(events)
    return cli.train_main(["revtrain-train", *flags])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
