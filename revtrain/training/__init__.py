"""revtrain.training: the training loop, checkpoints, metrics, optimizers and schedules."""

from revtrain.training.builder import (
    BuiltModel,
    build_evaluator,
    build_loop,
    build_model,
    build_trainer,
)
from revtrain.training.checkpoints.checkpointer import (
    Checkpointer,
    CheckpointSaveError,
    CheckpointUnreadableError,
)
from revtrain.training.checkpoints.trees import (
    CheckpointMismatchError,
    flatten_tree,
    unflatten_tree,
)
from revtrain.training.compile_cache import CompilationCacheConfig, use_compilation_cache
from revtrain.training.config import CheckpointConfig, EvalConfig, LogConfig, RunConfig
from revtrain.training.decoding import CachedDecoder, Decoder, decode_text
from revtrain.training.eval_program import CheckpointEvaluator
from revtrain.training.evaluation import Evaluator, bits_per_byte
from revtrain.training.interrupts import StopOnSignals
from revtrain.training.loop import Loop, NonFiniteLossError
from revtrain.training.metrics_writer import MetricsWriter, read_metrics
from revtrain.training.optimizers import optimizer_fn
from revtrain.training.run_lock import RunLock, RunLockError
from revtrain.training.schedules import constant, warmup_cosine_decay, warmup_rsqrt_decay
from revtrain.training.train_lib import train
from revtrain.training.write_failures import RunWriteError

__all__ = [
    "BuiltModel", "CachedDecoder", "CheckpointConfig", "CheckpointEvaluator",
    "CheckpointMismatchError", "CheckpointSaveError", "CheckpointUnreadableError",
    "Checkpointer", "CompilationCacheConfig", "Decoder",
    "EvalConfig", "Evaluator", "LogConfig", "Loop", "MetricsWriter", "NonFiniteLossError",
    "RunConfig", "RunLock", "RunLockError", "RunWriteError", "StopOnSignals", "bits_per_byte",
    "build_evaluator", "build_loop", "build_model", "build_trainer", "constant",
    "decode_text", "flatten_tree", "optimizer_fn", "read_metrics", "train",
    "unflatten_tree", "use_compilation_cache", "warmup_cosine_decay",
    "warmup_rsqrt_decay",
]
