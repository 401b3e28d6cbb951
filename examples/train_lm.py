"""Train the README's default language model from Python with the training `Loop`.

This is ``revtrain-train --config_file=configs/reversible_lm.gin`` written as Python: the
same model (a 2-layer reversible Transformer, Reformer-style), data (bytes of the
embedded corpus, Python's own documentation), optimizer and schedule, bound in plain
dataclasses instead of gin. `build_loop` checks the first batch against the model and the
devices, builds the trainer and restores the newest checkpoint in ``--output_dir``, so
running the script again with more ``--steps`` continues the run.

Run: ``python examples/train_lm.py --output_dir=runs/lm_from_python`` (1,000 steps, under
5 minutes on 2 CPU cores; about 1.9 bits per byte). ``--tiny`` trains a small model for a
few steps in seconds.
"""

import argparse
import functools
import logging
import math

from revtrain.data import TextFiles
from revtrain.layers import CrossEntropyLoss, Gelu
from revtrain.models import ReversibleTransformerLM
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
from revtrain.training import (
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    RunConfig,
    build_loop,
    optimizer_fn,
    warmup_rsqrt_decay,
)

TRAINERS = {"Trainer": Trainer, "ReversibleSerialTrainer": ReversibleSerialTrainer,
            "MemoryEfficientTrainer": MemoryEfficientTrainer}


def run_config(tiny: bool, trainer: str) -> RunConfig:
    """The values of configs/reversible_lm.gin (``tiny`` shrinks the model and batch)."""
    sizes = (dict(d_model=16, d_ff=32, n_layers=1, n_heads=2, max_len=32) if tiny else
             dict(d_model=128, d_ff=512, n_layers=2, n_heads=4, max_len=128))
    length, batch = (16, 2) if tiny else (128, 32)
    return RunConfig(
        # The model is a function of `mode` ('train', 'eval', 'predict'): the loop builds
        # the training model, the evaluator and the decoder from the same sizes.
        model=functools.partial(ReversibleTransformerLM, vocab_size=256, dropout=0.0,
                                ff_activation=Gelu, **sizes),
        # No paths: the default corpus, read from the standard library (no download).
        inputs=TextFiles(sequence_length=length, batch_size=batch, eval_fraction=0.05),
        trainer_class=TRAINERS[trainer],
        loss=CrossEntropyLoss,
        optimizer=functools.partial(optimizer_fn, name="adam", b2=0.98,
                                    clip_gradient_norm=1.0),
        schedule=warmup_rsqrt_decay(peak_value=2e-3, warmup_steps=2 if tiny else 200),
        seed=0)


def show_progress() -> None:
    """Prints the loop's reports (train/eval lines, checkpoints: INFO records of the
    `revtrain` loggers) on stderr, without the other libraries' INFO records."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("revtrain")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    logger.propagate = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default=None,
                        help="checkpoints, metrics.jsonl and TensorBoard files go here "
                             "(default: keep nothing)")
    parser.add_argument("--steps", type=int, default=None,
                        help="total training steps (default 1000; 4 with --tiny)")
    parser.add_argument("--trainer", choices=sorted(TRAINERS),
                        default="ReversibleSerialTrainer")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (seconds, for CI)")
    args = parser.parse_args()
    steps = args.steps or (4 if args.tiny else 1000)
    show_progress()

    run = run_config(args.tiny, args.trainer)
    every = max(1, steps // (2 if args.tiny else 4))  # 250 for 1,000 steps, as the config.
    loop = build_loop(run, EvalConfig(every=every, steps=2 if args.tiny else 20),
                      CheckpointConfig(every=every, max_to_keep=2),
                      LogConfig(every=every, progress=False), args.output_dir)
    with loop:  # Closing waits for pending checkpoint writes.
        if loop.restored_step is not None:
            print(f"resumed from the checkpoint of step {loop.restored_step}")
        metrics = loop.run(steps)  # Logs train/eval lines every `every` steps.
    # loop.run returns the last eval metrics: loss in nats per byte, and bits per byte.
    print(f"final eval at step {loop.step}: loss {metrics['loss']:.4f} bits_per_byte "
          f"{metrics['bits_per_byte']:.4f}")
    assert math.isfinite(metrics["loss"]), metrics


if __name__ == "__main__":
    main()
