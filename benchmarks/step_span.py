"""How much code one training step runs through: the files and the lines of definitions.

A newcomer reading one ``ReversibleSerialTrainer.one_step`` end to end reads every
function the step calls, on the host and inside its compiled programs. This script builds
a tiny `ReversibleTransformerLM` (depth 4) and records with ``sys.setprofile`` every
function of the training machinery (``revtrain/trainers`` and ``revtrain/parallel``; not
the model's layers) that the *first* step calls, tracing its programs included, and
reports the distinct files and the lines of those functions' definitions (``def`` to its
last line, docstring included; a function defined inside another counts once, within its
parent). ``--host_only`` counts the second step instead: only what runs on the host once
everything is compiled. The target (issue 44): at most 16 files and 1,300 lines for
`ReversibleSerialTrainer`.

    python benchmarks/step_span.py                    # ReversibleSerialTrainer
    python benchmarks/step_span.py --trainer=MemoryEfficientTrainer --list

Prints one line per trainer (and, with ``--list``, the functions per file).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # Run as a script: this checkout's revtrain first.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import revtrain  # noqa: E402
from revtrain import layers as tl  # noqa: E402
from revtrain import trainers  # noqa: E402
from revtrain.models import ReversibleTransformerLM  # noqa: E402

PACKAGE = os.path.dirname(os.path.abspath(revtrain.__file__))
SCOPE = tuple(os.path.join(PACKAGE, name) + os.sep for name in ("trainers", "parallel"))


def _step_fixture(trainer_name: str):
    model = ReversibleTransformerLM(vocab_size=32, d_model=16, d_ff=32, n_layers=4,
                                    n_heads=2, max_len=16, dropout=0.1)
    tokens = np.random.default_rng(0).integers(0, 32, (4, 17)).astype(np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:], np.ones((4, 16), np.float32))
    model.init(tl.signature_of(batch[0]), rng=jax.random.key(0))
    trainer = getattr(trainers, trainer_name).from_model(
        model, tl.CrossEntropyLoss(),
        lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), n_devices=1)
    return trainer, batch


def called_functions(trainer_name: str, host_only: bool = False) -> set[tuple[str, int]]:
    """``(file, first line)`` of every function in `SCOPE` the first step calls (the
    second step's with ``host_only``)."""
    trainer, batch = _step_fixture(trainer_name)
    if host_only:
        trainer.one_step(batch, jax.random.key(1))
        trainer.block_until_ready()
    seen: set[tuple[str, int]] = set()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(SCOPE):
                seen.add((code.co_filename, code.co_firstlineno))
    sys.setprofile(profile)
    try:
        trainer.one_step(batch, jax.random.key(2))
        trainer.block_until_ready()
    finally:
        sys.setprofile(None)
    return seen


def _definitions(path: str) -> list[tuple[int, int, int]]:
    """``(def line, first line, last line)`` of every function in ``path`` (the first
    line is its first decorator's, if any)."""
    import ast

    tree = ast.parse(Path(path).read_text())
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            spans.append((node.lineno, first, node.end_lineno))
    return spans


def span(functions: set[tuple[str, int]]) -> dict[str, int]:
    """Per file, the lines of the called functions' definitions (nested ones once)."""
    by_file = collections.defaultdict(set)
    for path, line in functions:
        by_file[path].add(line)
    lines: dict[str, int] = {}
    for path, firsts in by_file.items():
        spans = [(first, last) for lineno, first, last in _definitions(path)
                 if lineno in firsts or first in firsts]
        covered: set[int] = set()
        for first, last in spans:
            covered.update(range(first, last + 1))
        lines[os.path.relpath(path, os.path.dirname(PACKAGE))] = len(covered)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", default="ReversibleSerialTrainer",
                        choices=["Trainer", "ReversibleSerialTrainer", "MemoryEfficientTrainer"])
    parser.add_argument("--list", action="store_true", help="lines per file")
    parser.add_argument("--host_only", action="store_true",
                        help="the second step: what runs on the host once compiled")
    args = parser.parse_args()
    lines = span(called_functions(args.trainer, args.host_only))
    what = "its host side" if args.host_only else "one step, its programs traced,"
    print(f"{args.trainer}: {what} runs through {len(lines)} files and "
          f"{sum(lines.values())} lines of definitions of revtrain/trainers and "
          f"revtrain/parallel")
    if args.list:
        for path, n in sorted(lines.items(), key=lambda kv: -kv[1]):
            print(f"  {n:5d}  {path}")


if __name__ == "__main__":
    main()
