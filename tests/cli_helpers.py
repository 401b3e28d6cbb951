"""Helpers the CLI tests share: tiny copy-task runs of revtrain-train (not a test file)."""
import os

import orbax.checkpoint as ocp

from revtrain import cli

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
COPY_TASK = os.path.join(CONFIGS, "copy_task.gin")
TINY = [  # Shrinks configs/copy_task.gin to seconds on CPU; batch 4 fits 1, 2 or 4 devices.
    "ReversibleTransformerLM.vocab_size=8", "ReversibleTransformerLM.d_model=8",
    "ReversibleTransformerLM.d_ff=16", "ReversibleTransformerLM.n_layers=1",
    "ReversibleTransformerLM.n_heads=2", "ReversibleTransformerLM.max_len=16",
    "CopyTask.vocab_size=8", "CopyTask.length=4", "CopyTask.batch_size=4",
    "EvalConfig.steps=1", "LogConfig.every=2", "LogConfig.progress=False",
]
TRAINERS = ["Trainer", "ReversibleSerialTrainer", "MemoryEfficientTrainer"]


def _train(output_dir, *bindings, config=COPY_TASK, extra_flags=()):
    argv = ["revtrain-train", f"--config_file={config}", f"--output_dir={output_dir}"]
    argv += [f"--gin_bindings={b}" for b in TINY + list(bindings)] + list(extra_flags)
    return cli.train_main(argv)


def _checkpoint(output_dir, step):
    """The flat checkpoint of ``step`` as a dict of numpy arrays (read without a template)."""
    path = os.path.join(output_dir, "checkpoints", str(step), "default")
    return ocp.StandardCheckpointer().restore(path)


def _steps(output_dir):
    return sorted(int(d) for d in os.listdir(os.path.join(output_dir, "checkpoints"))
                  if d.isdigit())
