"""revtrain.training: the training loop, checkpoints, metrics, optimizers and schedules."""

from revtrain.training.checkpoints import Checkpointer, flatten_tree, unflatten_tree
from revtrain.training.evaluation import Evaluator, bits_per_byte
from revtrain.training.interrupts import StopOnSignals
from revtrain.training.loop import Loop, NonFiniteLossError, build_trainer
from revtrain.training.metrics_writer import MetricsWriter, read_metrics
from revtrain.training.optimizers import optimizer_fn
from revtrain.training.schedules import constant, warmup_cosine_decay, warmup_rsqrt_decay

__all__ = [
    "Checkpointer", "Evaluator", "Loop", "MetricsWriter", "NonFiniteLossError",
    "StopOnSignals", "bits_per_byte", "build_trainer", "constant", "flatten_tree",
    "optimizer_fn", "read_metrics", "unflatten_tree", "warmup_cosine_decay",
    "warmup_rsqrt_decay",
]
