"""Builds the programs of a run from its configuration: training, evaluation, decoding.

One factory for the three tools (Paxml builds its train, eval and decode programs from one
experiment the same way): `build_model` initialises the model from the first train batch,
`build_evaluator` makes the sharded eval-mode scorer, and `build_loop` adds the trainer
(with its optimizer slots), the checkpointer and the metrics writer. ``revtrain-eval`` and
``revtrain-decode`` use the first two only, so they never build optimizer slots.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from revtrain.data.inputs import Inputs
from revtrain.layers import (
    SEQ_AXIS,
    Accuracy,
    Layer,
    LayerError,
    WeightedCategoryCrossEntropy,
    nest_flat_values,
    signature_of,
)
from revtrain.layers.sequence_parallel import SequenceSplitError, trace_split
from revtrain.parallel.placement import Placement
from revtrain.trainers import blocks_to_layers, extract_reversible_blocks
from revtrain.training.accumulation import check_no_global_clipping
from revtrain.training.checkpoints.access import check_run_access
from revtrain.training.checkpoints.checkpointer import Checkpointer
from revtrain.training.compile_cache import CompilationCacheConfig, use_compilation_cache
from revtrain.training.config import CheckpointConfig, EvalConfig, LogConfig, RunConfig
from revtrain.training.evaluation import Evaluator
from revtrain.training.loop import Loop
from revtrain.training.metrics_writer import MetricsWriter
from revtrain.training.run_directory import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    HISTORY_DIR,
    METRICS_FILE,
    TENSORBOARD_DIR,
    TOKENIZER_FILE,
    TOKENIZER_MODEL_FILE,
    broken_link_error,
)
from revtrain.training.run_tokenizer import (
    check_run_tokenizer,
    tokenizer_binding,
    write_run_tokenizer,
)
from revtrain.training.validation import (
    check_accumulation_divides,
    check_batch_divides,
    check_first_batch,
    check_mesh_divides,
    check_vocab_size,
)

logger = logging.getLogger(__name__)


def build_trainer(trainer_class: Callable[..., Any], model: Layer, loss_layer: Layer,
                  optimizer_fn: Callable[[], optax.GradientTransformation],
                  n_devices: int | None = None, **trainer_kwargs: Any) -> Any:
    """Builds ``trainer_class`` for an initialised ``model`` followed by ``loss_layer``.

    The class builds itself: ``trainer_class.from_model(model, loss_layer, optimizer_fn,
    n_devices=n_devices, **trainer_kwargs)`` (`revtrain.trainers.common.protocols.Trainer`;
    `Trainer` takes the whole flat model, the block trainers its blocks).

    Raises:
      TypeError: for a class without ``from_model``, naming it and the fix.
    """
    from_model = getattr(trainer_class, "from_model", None)
    if not callable(from_model):
        raise TypeError(f"trainer_class={trainer_class!r} has no from_model(model, loss_layer, "
                        f"optimizer_fn, **options); use a revtrain trainer, or give the class "
                        f"that class method")
    return from_model(model, loss_layer, optimizer_fn, n_devices=n_devices, **trainer_kwargs)


@dataclasses.dataclass
class BuiltModel:
    """An initialised training-mode model, its loss, and the trainers' flat view of both.

    Attributes:
      model: the ``mode='train'`` model, initialised from the first train batch; its layer
        objects keep their initial values (trainers own the trained ones).
      loss: the initialised loss layer.
      flat_layers: ``blocks_to_layers(*extract_reversible_blocks([model, loss]))``: the
        order of the per-layer values in a `TrainState` and in checkpoints.
      batch_signature: ``ShapeDtype`` of a train batch ``(inputs, targets, weights)``.
      seconds: wall time of the set-up, ``{'build': constructing the layer objects,
        'init': initialising their weights (or shapes), ready on the devices}``.
    """

    model: Layer
    loss: Layer
    flat_layers: Sequence[Layer]
    batch_signature: Any
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def initial_values(self) -> dict[str, tuple]:
        """``{'weights', 'state'}``: one initial value per flat layer (a restore template)."""
        return {"weights": tuple(layer.weights for layer in self.flat_layers),
                "state": tuple(layer.state for layer in self.flat_layers)}

    def nest(self, flat_values: Sequence[Any]) -> Any:
        """Per-flat-layer values (weights or state) as the model's tree."""
        return nest_flat_values(self.model, self.flat_layers, flat_values)


def resolve_inputs(inputs: Inputs | Any) -> Inputs:
    """``inputs`` if it is an `Inputs`, else ``inputs()`` (a class or factory)."""
    return inputs if isinstance(inputs, Inputs) else inputs()


def eval_splits(inputs: Inputs, eval_config: EvalConfig) -> dict[str, Inputs]:
    """``{'eval': inputs}`` followed by ``eval_config.splits``, each resolved to `Inputs`."""
    return {"eval": inputs} | {name: resolve_inputs(split) for name, split in
                               (eval_config.splits or {}).items()}


def _loss(run: RunConfig) -> Layer:
    loss = WeightedCategoryCrossEntropy() if run.loss is None else run.loss
    return loss if isinstance(loss, Layer) else loss()


def build_model(run: RunConfig, inputs: Inputs, abstract: bool = False) -> BuiltModel:
    """Checks the first train batch fits the model and the devices, then initialises both.

    Args:
      run: the model and its seed.
      inputs: the data; its first train batch gives the signature.
      abstract: give the model's layers ``jax.ShapeDtypeStruct`` s of their weights and
        state instead of values (``jax.eval_shape`` of the init: no random draws, no
        memory), for programs that restore every value from a checkpoint
        (``revtrain-eval``, ``revtrain-decode``). The loss layer is initialised for real
        (a loss has no weights or small ones).

    Raises:
      ValueError: for a missing model/inputs, a model vocabulary smaller than the
        tokenizer's, or a batch that does not fit the model or divide over the devices
        (`revtrain.training.validation`).
    """
    run.check_complete()
    start = time.perf_counter()
    model, loss = run.model(mode="train"), _loss(run)
    seconds = {"build": time.perf_counter() - start}
    check_vocab_size(model, inputs)
    batch = next(iter(inputs.train_stream(start_step=0)))
    check_first_batch(batch, model, inputs)
    signature = signature_of(tuple(batch))
    if run.mesh_shape is None:
        check_batch_divides(signature[0].shape[0], run.n_devices, inputs)
    else:
        run.mesh()  # Its size against the devices, before anything is built.
        check_mesh_divides(signature, run.mesh_shape, inputs)
    init_rng, _ = jax.random.split(jax.random.key(run.seed))
    start = time.perf_counter()
    if abstract:
        # A fresh model is traced, so no layer object of ``model`` ever holds a tracer.
        fresh = run.model
        model.weights, model.state = jax.eval_shape(
            lambda rng: fresh(mode="train").init(signature[0], rng=rng), init_rng)
    else:
        model.init(signature[0], rng=init_rng)
    loss.init((model.output_signature(signature[0]), signature[1], signature[2]))
    jax.block_until_ready((model.weights, model.state, loss.weights, loss.state))
    seconds["init"] = time.perf_counter() - start
    flat = blocks_to_layers(*extract_reversible_blocks([model, loss]))
    return BuiltModel(model, loss, flat, signature, seconds)


def check_sequence_split(run: RunConfig, built: BuiltModel) -> None:
    """Checks every layer of the model and loss accepts ``RunConfig.mesh_shape``'s
    split of the length (``seq > 1``), before a run writes anything.

    One training step's forward pass (model, then loss) is traced abstractly on the run's
    mesh under the split the trainers use (`revtrain.layers.sequence_parallel.trace_split`:
    ``jax.eval_shape``, nothing compiled or run), so a layer that cannot compute a shard of
    the length alone (`LSHCausalAttention`, `Conv`, ``ShiftRight``...) is found here, not
    in the first step.

    Raises:
      ValueError: naming ``RunConfig.mesh_shape``, the refusing layer and the fix.
    """
    mesh = run.mesh()
    if mesh is None or mesh.shape[SEQ_AXIS] == 1:
        return
    model, loss = built.model, built.loss

    def step(batch: Any, weights: Any, state: Any, loss_values: Any, rng: jax.Array) -> Any:
        inputs, *rest = batch
        outputs, _ = model.pure_fn(inputs, weights, state, rng)
        return loss.pure_fn((outputs, *rest), *loss_values, rng)[0]

    try:
        trace_split(step, built.batch_signature, model.weights, model.state,
                    (loss.weights, loss.state), jax.random.key(0), mesh=mesh)
    except (LayerError, SequenceSplitError) as e:
        refusal = getattr(e, "original", e)
        if not isinstance(refusal, SequenceSplitError):
            raise
        raise ValueError(f"RunConfig.mesh_shape={dict(run.mesh_shape)!r} splits the length "
                         f"over seq={mesh.shape[SEQ_AXIS]}, but {refusal}") from e


def build_evaluator(run: RunConfig, built: BuiltModel, inputs: Inputs,
                    placement: Placement | None = None) -> Evaluator:
    """The eval-mode model scored by ``{'loss', 'accuracy'}`` on the run's `Placement`
    (``placement``, the trainer's, or `RunConfig.placement`), plus ``bits_per_byte`` for
    text (counting the bytes of each token with a subword tokenizer)."""
    tokenizer = inputs.tokenizer
    token_bytes = (None if tokenizer is None or inputs.byte_level else
                   tokenizer.token_bytes())
    return Evaluator(run.model(mode="eval"), {"loss": built.loss, "accuracy": Accuracy()},
                     byte_level=inputs.byte_level, token_bytes=token_bytes,
                     placement=placement or run.placement())


def _schedule(run: RunConfig) -> optax.Schedule | None:
    if run.schedule is None or callable(run.schedule):
        return run.schedule
    return optax.constant_schedule(run.schedule)


def build_loop(run: RunConfig, eval_config: EvalConfig | None = None,
               checkpoint: CheckpointConfig | None = None, log: LogConfig | None = None,
               output_dir: str | None = None,
               compilation_cache: CompilationCacheConfig | None = None) -> Loop:
    """Builds the training `Loop` of a run and restores ``output_dir``'s newest checkpoint.

    The trainer gets `RunConfig.training_optimizer` (``optax.MultiSteps`` around
    ``RunConfig.optimizer`` when ``RunConfig.accumulate_steps`` > 1) and the loop the
    same ``accumulate_steps``.

    JAX's persistent compilation cache is turned on first (`use_compilation_cache`), so a
    restarted run loads its programs instead of compiling them.

    Args:
      run: the model, data and optimisation.
      eval_config: evaluation; default `EvalConfig()`.
      checkpoint: checkpointing; default `CheckpointConfig()`.
      log: logging; default `LogConfig()`.
      output_dir: where checkpoints (``checkpoints/``), ``metrics.jsonl`` and TensorBoard
        files go; None keeps nothing.
      compilation_cache: where JAX's persistent compilation cache goes; default
        ``CompilationCacheConfig()``: the process's own JAX setting if it has one (an
        earlier call, ``jax_compilation_cache_dir`` or ``JAX_COMPILATION_CACHE_DIR``),
        else ``$XDG_CACHE_HOME/revtrain/jax`` (``~/.cache/revtrain/jax``).

    Raises:
      ValueError: as `build_model` and `check_sequence_split`, for a batch that does not
        split into ``RunConfig.accumulate_steps`` micro-batches over the devices
        (`revtrain.training.validation.check_accumulation_divides`), for
        ``accumulate_steps`` > 1 with a trainer's ``clip_global_norm``, for a tokenizer
        other than the one the run in ``output_dir`` was trained with, or a checkpoint
        that does not match the model.
      CheckpointPermissionError: this user may not write ``output_dir``, its files, or
        its checkpoints (`revtrain.training.checkpoints.access`); before any step.
    """
    eval_config = eval_config or EvalConfig()
    use_compilation_cache(compilation_cache, source="build_loop(compilation_cache=...)")
    inputs = resolve_inputs(run.inputs)
    built = build_model(run, inputs)
    check_sequence_split(run, built)
    placement = run.placement()
    check_accumulation_divides(built.batch_signature[0].shape[0], run.accumulate_steps,
                               placement.n_devices // placement.n_seq, inputs)
    start = time.perf_counter()
    trainer = build_trainer(run.trainer_class, built.model, built.loss,
                            run.training_optimizer(), placement=placement,
                            **run.trainer_arguments())
    trainer_seconds = time.perf_counter() - start
    # A clip_global_norm bound on the trainer class (gin) is known only now.
    check_no_global_clipping(run.accumulate_steps, getattr(trainer, "clip_global_norm", None),
                             f"{type(trainer).__name__}'s options")
    splits = eval_splits(inputs, eval_config)
    checkpoint = checkpoint or CheckpointConfig()
    # Validated before anything is created in output_dir.
    check_run_tokenizer(output_dir, inputs.tokenizer, tokenizer_binding(inputs))
    init = (None if checkpoint.init_checkpoint_dir is None else
            init_checkpointer(checkpoint.init_checkpoint_dir))
    # The training run holds the run lock, so temporary directories are a crashed save's.
    checkpointer = None
    try:
        if output_dir is not None and jax.process_index() == 0:  # Before a step is trained.
            check_run_access(output_dir, (METRICS_FILE, TENSORBOARD_DIR, HISTORY_DIR,
                                          CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_MODEL_FILE))
        checkpointer = None if output_dir is None else Checkpointer(
            os.path.join(output_dir, CHECKPOINT_DIR), max_to_keep=checkpoint.max_to_keep,
            keep_period=checkpoint.keep_period,
            keep_time_interval=checkpoint.keep_time_interval,
            async_save=checkpoint.async_save, cleanup_tmp=True)
        if output_dir is not None and jax.process_index() == 0:
            write_run_tokenizer(output_dir, inputs.tokenizer)
    except BaseException:  # Closing removes a checkpoints/ that was created empty.
        for opened in (init, checkpointer):
            if opened is not None:
                opened.close()
        raise
    writer = MetricsWriter(output_dir, enabled=jax.process_index() == 0)
    # Once everything is checked: a bad input stays a one-line error. The restore is
    # timed by the Loop.
    logger.info("built the model in %.2f s", built.seconds["build"])
    logger.info("initialised the model's weights in %.2f s", built.seconds["init"])
    logger.info("built the trainer and its optimizer slots in %.2f s", trainer_seconds)
    return Loop(trainer, inputs, built, build_evaluator(run, built, inputs, placement), splits,
                checkpointer=checkpointer, init_checkpointer=init, writer=writer,
                schedule=_schedule(run), eval_config=eval_config, checkpoint=checkpoint,
                log=log or LogConfig(), seed=run.seed,
                accumulate_steps=run.accumulate_steps)


def init_checkpointer(path: str) -> Checkpointer:
    """A read-only `Checkpointer` of ``CheckpointConfig.init_checkpoint_dir``, checked to
    hold a checkpoint.

    Raises:
      FileNotFoundError: naming ``CheckpointConfig.init_checkpoint_dir`` when ``path`` is
        not a directory or holds no checkpoint.
    """
    source = Checkpointer(checkpoint_directory(path), max_to_keep=None, read_only=True)
    if source.latest_step() is None:
        source.close()
        raise FileNotFoundError(f"CheckpointConfig.init_checkpoint_dir={path!r} holds no "
                                f"checkpoint; point it at the output_dir of a run that "
                                f"saved one")
    return source


def checkpoint_directory(path: str) -> str:
    """A run directory's ``checkpoints/`` (or ``path`` itself when it holds the steps).

    Raises:
      FileNotFoundError: naming ``CheckpointConfig.init_checkpoint_dir`` when ``path`` is
        not a directory (a symbolic link to a missing target: naming both).
    """
    broken = broken_link_error("CheckpointConfig.init_checkpoint_dir", path)
    if broken:
        raise FileNotFoundError(broken)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"CheckpointConfig.init_checkpoint_dir={path!r} is not a "
                                f"directory; give the output_dir of another run")
    inner = os.path.join(path, CHECKPOINT_DIR)
    return inner if os.path.isdir(inner) else path
