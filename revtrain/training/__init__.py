"""revtrain.training: the training loop, checkpoints, metrics, optimizers and schedules."""

from revtrain.training.checkpoints import (
    Checkpointer,
    CheckpointMismatchError,
    CheckpointUnreadableError,
    flatten_tree,
    unflatten_tree,
)
from revtrain.training.decoding import Decoder, decode_text
from revtrain.training.evaluation import Evaluator, bits_per_byte
from revtrain.training.interrupts import StopOnSignals
from revtrain.training.loop import Loop, NonFiniteLossError, build_trainer
from revtrain.training.metrics_writer import MetricsWriter, read_metrics
from revtrain.training.optimizers import optimizer_fn
from revtrain.training.run_lock import RunLock, RunLockError
from revtrain.training.schedules import constant, warmup_cosine_decay, warmup_rsqrt_decay
from revtrain.training.train_lib import make_loop, train

__all__ = [
    "CheckpointMismatchError", "CheckpointUnreadableError", "Checkpointer", "Decoder",
    "Evaluator", "Loop", "MetricsWriter", "NonFiniteLossError", "RunLock", "RunLockError",
    "StopOnSignals", "bits_per_byte", "build_trainer", "constant", "decode_text",
    "flatten_tree", "make_loop", "optimizer_fn", "read_metrics", "train", "unflatten_tree",
    "warmup_cosine_decay", "warmup_rsqrt_decay",
]
