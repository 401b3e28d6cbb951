"""revtrain.training: the training loop, checkpoints, metrics, optimizers and schedules.

- `train_lib`: `train`, the gin-configurable entry point of ``revtrain-train``;
- `config`: the run configuration (`RunConfig`, `CheckpointConfig`, `EvalConfig`,
  `LogConfig`); `validation`: its checks before anything is written;
- `builder`: builds a run's model, trainer, loop, evaluator and decoder;
- `loop`: `Loop`, which trains, evaluates, saves and logs; `loop_metrics`: its metric
  window, progress bar and formatting; `interrupts`: a graceful stop on signals;
- `optimizers`, `schedules`: the optax optimizer and learning-rate schedules;
  `accumulation`: gradient accumulation over micro-batches (``optax.MultiSteps``);
- `checkpoints/`: saving, retaining and restoring checkpoints (orbax);
- `evaluation`: `Evaluator`; `eval_program`: ``revtrain-eval``'s continuous evaluation;
- `decoding`: autoregressive decoding; `decode_program`: ``revtrain-decode``'s program;
- the run directory: `run_directory` (its file names), `run_files` (safe small writes),
  `run_lock` (one writer), `run_tokenizer` (the tokenizer record), `config_history`,
  `metrics_writer` (JSON lines and TensorBoard), `write_failures` (one line per failed
  write);
- `barriers`: the one barrier of multi-process runs;
- `compile_cache`: JAX's persistent compilation cache, on by default for the programs and
  `build_loop`.
"""

from revtrain.training.accumulation import (
    accumulated_step,
    accumulating_optimizer,
    micro_batches,
)
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
    "RunConfig", "RunLock", "RunLockError", "RunWriteError", "StopOnSignals",
    "accumulated_step", "accumulating_optimizer", "bits_per_byte",
    "build_evaluator", "build_loop", "build_model", "build_trainer", "constant",
    "decode_text", "flatten_tree", "micro_batches", "optimizer_fn", "read_metrics", "train",
    "unflatten_tree", "use_compilation_cache", "warmup_cosine_decay",
    "warmup_rsqrt_decay",
]
