"""One run configuration: small frozen dataclasses that gin configures.

A run is described once, by four values that `train`, ``revtrain-eval`` and
``revtrain-decode`` all build their programs from (`revtrain.training.builder`):

* `RunConfig`: the model, data, loss, optimizer, learning-rate schedule, trainer, seed,
  devices and gradient accumulation -- what makes two runs different models;
* `EvalConfig`: how often and on what to evaluate;
* `CheckpointConfig`: how often to save, what to keep, where to start from;
* `LogConfig`: how often to write train metrics, and the progress bar.

In gin each field is bound by class name (``EvalConfig.every = 250``, ``RunConfig.model =
@ReversibleTransformerLM``); ``train.steps`` stays on ``train``. This replaces the 18
arguments ``train``, ``make_loop`` and ``Loop`` each repeated (Paxml's experiment
``task()`` / ``datasets()`` split plays the same role). Each dataclass range-checks its
fields when built (`revtrain.training.validation.check_arguments`), so a bad value is a
one-line error naming the binding before anything is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import optax
from jax.sharding import Mesh

from revtrain.data.inputs import Inputs
from revtrain.layers import Layer
from revtrain.parallel.mesh import check_mesh_shape, mesh_from_shape
from revtrain.parallel.placement import Placement
from revtrain.trainers import Trainer
from revtrain.training.accumulation import accumulating_optimizer, check_no_global_clipping
from revtrain.training.optimizers import optimizer_fn
from revtrain.training.validation import check_arguments

# The bindings of train before this module existed, and what replaced them.
LEGACY_BINDINGS = {
    "model": "RunConfig.model", "inputs": "RunConfig.inputs",
    "optimizer": "RunConfig.optimizer", "trainer_class": "RunConfig.trainer_class",
    "loss": "RunConfig.loss", "learning_rate": "RunConfig.schedule",
    "seed": "RunConfig.seed", "n_devices": "RunConfig.n_devices",
    "trainer_kwargs": "RunConfig.trainer_kwargs",
    "eval_every": "EvalConfig.every", "eval_steps": "EvalConfig.steps",
    "checkpoint_every": "CheckpointConfig.every",
    "max_to_keep": "CheckpointConfig.max_to_keep",
    "keep_period": "CheckpointConfig.keep_period",
    "keep_time_interval": "CheckpointConfig.keep_time_interval",
    "log_every": "LogConfig.every", "progress": "LogConfig.progress",
}


def _fields(config: Any) -> dict[str, Any]:
    """The fields of a dataclass, shallow (``dataclasses.asdict`` deep-copies values)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The model, data and optimisation of a run.

    Args:
      model: the model function, called as ``model(mode='train')``, ``model(mode='eval')``
        and ``model(mode='predict')`` (e.g. ``ReversibleTransformerLM``).
      inputs: an `Inputs` or a function returning one (e.g. the class ``TextFiles``).
      optimizer: ``() -> optax.GradientTransformation`` built with
        ``optax.inject_hyperparams`` (default `optimizer_fn`).
      trainer_class: `Trainer`, `ReversibleSerialTrainer` or `MemoryEfficientTrainer`.
      loss: the loss layer or its class; default ``WeightedCategoryCrossEntropy``.
      schedule: the learning rate: a float, an optax schedule ``step -> rate``
        (``@warmup_rsqrt_decay()`` in gin), or None to keep the optimizer's own rate
        (``optimizer_fn.learning_rate``).
      seed: seeds the weight initialisation and the per-step rngs.
      n_devices: devices per process (default: all local devices).
      fsdp: shard the weights and optimizer slots over the devices (FSDP / ZeRO-3; the
        trainer's ``fsdp`` argument, passed only when True). Checkpoints restore across
        this setting and the device count.
      mesh_shape: the trainer's named mesh as axis sizes by name, e.g. ``{'data': 2,
        'fsdp': 2}`` (axes ``data``, ``fsdp``, ``seq``; a missing one is 1): rows of the
        batch over ``data x fsdp``, weights and slots over ``fsdp`` (replicated over
        ``data``), the length axis over ``seq``
        (`revtrain.parallel.mesh.mesh_from_shape`: the first ``n_devices`` devices of
        every process, ordered by process, ``seq`` then ``fsdp`` fastest, so ``{'data':
        processes, 'fsdp': devices per process}`` keeps each ``fsdp`` group in one
        process). The sizes must multiply to the run's devices. Evaluation splits rows
        over this process's ``data x fsdp`` devices (not the length). Checkpoints
        restore across mesh shapes. None: ``n_devices`` and ``fsdp``.
      trainer_kwargs: extra keyword arguments of ``trainer_class``.
      accumulate_steps: gradient accumulation: train each global batch as this many equal
        micro-batches (consecutive rows), one ``trainer.one_step`` each, and update the
        weights once per batch, through ``optax.MultiSteps(optimizer(),
        every_k_schedule=accumulate_steps)`` (`revtrain.training.accumulation`). Peak
        activation memory is that of one micro-batch; the optimizer slots gain one
        gradient-sized accumulator (per layer in the block trainers). Steps, schedules,
        checkpoints, evaluation and metrics count optimizer updates, as with 1. The
        update is the mean of the micro-batches' gradients, each of its own weighted-mean
        loss, so it equals one step on the whole batch when every micro-batch carries the
        same total loss weight (an unpadded batch); the step's loss is the mean of the
        micro-batches' losses. Micro-batch ``i`` of a step gets the key ``fold_in(step
        key, i)``. The batch size must be a multiple of ``accumulate_steps`` x the devices
        that hold distinct rows (checked before anything is written). Refused with a
        block trainer's ``clip_global_norm`` (it would clip each micro-batch's gradient,
        not the update's: bind ``optimizer_fn.clip_gradient_norm``, which clips the
        accumulated gradient). A checkpoint restores across values above 1, not between
        1 and more (the optimizer state differs). 1 (the default) runs exactly as
        before.

    Raises:
      ValueError: for a negative ``seed``, ``n_devices`` < 1 or above the local device
        count, a float ``schedule`` that is not finite and > 0, a non-bool ``fsdp``,
        ``fsdp`` given both here and in ``trainer_kwargs``, a ``mesh_shape`` with an axis
        outside ``data``/``fsdp``/``seq`` or a size < 1, ``mesh_shape`` with ``fsdp`` or
        a ``mesh`` in ``trainer_kwargs``, an ``accumulate_steps`` that is not an int >= 1,
        or ``accumulate_steps`` > 1 with a ``clip_global_norm`` in ``trainer_kwargs``
        (or its ``options``).
    """

    model: Callable[..., Layer] | None = None
    inputs: Inputs | Callable[[], Inputs] | None = None
    optimizer: Callable[[], optax.GradientTransformation] = optimizer_fn
    trainer_class: Callable[..., Any] = Trainer
    loss: Layer | Callable[[], Layer] | None = None
    schedule: float | optax.Schedule | None = None
    seed: int = 0
    n_devices: int | None = None
    fsdp: bool = False
    mesh_shape: Mapping[str, int] | None = None
    trainer_kwargs: Mapping[str, Any] | None = None
    accumulate_steps: int = 1

    def __post_init__(self):
        check_arguments(_fields(self), "RunConfig")
        self._check_accumulation()
        if self.fsdp and "fsdp" in (self.trainer_kwargs or {}):
            raise ValueError("RunConfig.fsdp=True and RunConfig.trainer_kwargs['fsdp'] are "
                             "both set; bind only RunConfig.fsdp")
        if self.mesh_shape is not None:
            check_mesh_shape(self.mesh_shape, "RunConfig.mesh_shape")
            clash = [f"RunConfig.{name}" for name, bad in (
                ("fsdp", self.fsdp), ("trainer_kwargs['mesh']",
                                      "mesh" in (self.trainer_kwargs or {}))) if bad]
            if clash:
                raise ValueError(f"RunConfig.mesh_shape={dict(self.mesh_shape)!r} and "
                                 f"{clash[0]} are both set; with a mesh its 'fsdp' axis "
                                 f"shards the weights: bind only RunConfig.mesh_shape")

    def _check_accumulation(self) -> None:
        """Refuses gradient accumulation with a block trainer's ``clip_global_norm`` in
        ``trainer_kwargs`` (`check_no_global_clipping`; one bound on the trainer class in
        gin is refused when the trainer is built)."""
        kwargs = self.trainer_kwargs or {}
        clip = kwargs.get("clip_global_norm")
        if clip is None:
            clip = getattr(kwargs.get("options"), "clip_global_norm", None)
        check_no_global_clipping(self.accumulate_steps, clip, "RunConfig.trainer_kwargs")

    def training_optimizer(self) -> Callable[[], optax.GradientTransformation]:
        """The ``optimizer_fn`` the run's trainer gets: ``optimizer`` itself, or with
        ``accumulate_steps`` > 1 ``optimizer`` wrapped in ``optax.MultiSteps``
        (`revtrain.training.accumulation.accumulating_optimizer`)."""
        return accumulating_optimizer(self.optimizer, self.accumulate_steps)

    def mesh(self) -> Mesh | None:
        """The trainer's mesh of ``mesh_shape`` (None without one), over the first
        ``n_devices`` devices of every process.

        Raises:
          ValueError: when the sizes do not multiply to the run's devices, naming
            ``RunConfig.mesh_shape``, both counts and the fix.
        """
        if self.mesh_shape is None:
            return None
        return mesh_from_shape(self.mesh_shape, self.n_devices, "RunConfig.mesh_shape")

    def placement(self) -> Placement:
        """The run's one `revtrain.parallel.Placement`, which its trainer and its evaluation
        share: ``trainer_kwargs['placement']`` when given, else the mesh of ``mesh_shape``
        (or a ``mesh`` in ``trainer_kwargs``) or ``n_devices`` devices (or
        ``trainer_kwargs['n_devices']`` when ``n_devices`` is unset), with ``fsdp``.
        Builds the mesh: call it after ``jax.distributed`` is initialised.

        Raises:
          ValueError, TypeError: as `Placement.resolve` and `mesh`.
        """
        kwargs = dict(self.trainer_kwargs or {})
        if kwargs.get("placement") is not None:
            return kwargs["placement"]
        mesh = self.mesh() if self.mesh_shape is not None else kwargs.get("mesh")
        fsdp = self.fsdp or bool(kwargs.get("fsdp", False))
        n_devices = self.n_devices if self.n_devices is not None else kwargs.get("n_devices")
        return Placement.resolve(n_devices, mesh, fsdp)

    def trainer_arguments(self) -> dict[str, Any]:
        """Keyword arguments of ``trainer_class`` beyond the model, optimizer and
        `placement`: ``trainer_kwargs`` without the ones `placement` reads."""
        return {k: v for k, v in (self.trainer_kwargs or {}).items()
                if k not in ("placement", "mesh", "fsdp", "n_devices")}

    def check_complete(self) -> None:
        """Raises a ValueError naming the binding when ``model`` or ``inputs`` is unset."""
        if self.model is None or self.inputs is None:
            missing = "RunConfig.model" if self.model is None else "RunConfig.inputs"
            raise ValueError(f"{missing} is not set; bind it in the gin config, e.g. "
                             f"RunConfig.model = @ReversibleTransformerLM and "
                             f"RunConfig.inputs = @TextFiles")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """When and on what a run is evaluated (Paxml's eval programs).

    Args:
      every: evaluate every this many steps while training (0: only at the end).
      steps: batches per evaluation of each split; None for one exact pass over each
        split's finite eval data (`Inputs.eval_pass`: no cycling, the last partial batch
        padded and masked); 0 never evaluates.
      splits: more named eval splits, ``{name: Inputs}`` (or functions returning one);
        each is evaluated on its ``eval_stream``/``eval_pass`` and gets its own records in
        ``metrics.jsonl`` and its own TensorBoard run ``tensorboard/<name>``. The run's
        own inputs are always the split ``'eval'``.
      eval_train: also evaluate the eval-mode model on the current train batch (split
        ``'eval_train'``), as Paxml's ``eval_train`` does.

    Raises:
      ValueError: for ``every < 0``, ``steps < 0``, an ``eval_train`` that is not True or
        False, or a split named ``'eval'``, ``'train'`` or ``'eval_train'``.
    """

    every: int = 100
    steps: int | None = 10
    splits: Mapping[str, Inputs | Callable[[], Inputs]] | None = None
    eval_train: bool = False

    def __post_init__(self):
        check_arguments(_fields(self), "EvalConfig")
        for name in self.splits or {}:
            if name in ("eval", "train", "eval_train"):
                raise ValueError(f"EvalConfig.splits has a split named {name!r}, a name the "
                                 f"loop uses itself; rename it in the gin binding "
                                 f"EvalConfig.splits")

    @property
    def enabled(self) -> bool:
        """Whether evaluation runs at all (``steps != 0``)."""
        return self.steps != 0


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When checkpoints are saved and what is kept (Paxml's checkpoint manager).

    Args:
      every: save every this many steps (0: only at the end).
      max_to_keep: keep the newest this many checkpoints (None: all).
      keep_period: also keep, permanently, every checkpoint whose step is a multiple of
        this; None disables.
      keep_time_interval: also keep, permanently, one checkpoint per this many seconds;
        None disables.
      restore_step: on start, restore this step instead of the newest (Paxml's
        ``restore_step``); saves of steps up to the newest existing one are skipped.
      init_checkpoint_dir: warm start: when the run has no checkpoint yet, start from the
        newest checkpoint of this run directory (Paxml's ``init_checkpoint``); its
        structure must match the model's (the error names the first mismatching path).
      init_weights_only: warm-start weights and layer state only (fresh optimizer slots,
        step 0); False restores everything, step and optimizer slots included.
      async_save: save in a background thread (orbax asynchronous checkpointing); the
        loop waits for the last save before it exits.

    Raises:
      ValueError: for a value below its limit (``every``, ``restore_step >= 0``, the
        others >= 1 or > 0), or a switch that is not True or False.
    """

    every: int = 100
    max_to_keep: int | None = 3
    keep_period: int | None = None
    keep_time_interval: float | None = None
    restore_step: int | None = None
    init_checkpoint_dir: str | None = None
    init_weights_only: bool = True
    async_save: bool = False

    def __post_init__(self):
        check_arguments(_fields(self), "CheckpointConfig")


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """How training reports progress.

    Args:
      every: write train metrics every this many steps; None: ``EvalConfig.every``, or
        100 when that is 0.
      progress: show a tqdm progress bar; None shows it when stderr is a terminal.
      profile_steps: ``(first, last)``: record a ``jax.profiler`` trace of steps
        ``first..last`` (1-based, as the log lines count) into ``output_dir/profile``
        (TensorBoard's profile plugin reads it). Every step is annotated
        (``StepTraceAnnotation``) in any trace.

    Raises:
      ValueError: for ``every < 1``, ``profile_steps`` not integers ``1 <= first <=
        last``, or a ``progress`` that is not True, False or None.
    """

    every: int | None = None
    progress: bool | None = None
    profile_steps: tuple[int, int] | None = None

    def __post_init__(self):
        check_arguments(_fields(self), "LogConfig")
        steps = self.profile_steps
        if steps is not None and not (
                isinstance(steps, (tuple, list)) and len(steps) == 2
                and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
                and 1 <= steps[0] <= steps[1]):
            raise ValueError(f"LogConfig.profile_steps={steps!r} must be (first, last) integers "
                             f"with 1 <= first <= last; change the gin binding "
                             f"LogConfig.profile_steps")



def legacy_binding_error(names: list[str]) -> ValueError:
    """The one-line error for ``train.<name>`` bindings that moved to a dataclass."""
    name = names[0]
    new = LEGACY_BINDINGS.get(name)
    if new is None:
        return ValueError(f"train.{name} is not a parameter of train; see "
                          f"docs/gin_reference.md for train and the *Config bindings")
    return ValueError(f"train.{name} is now {new}; change the gin binding train.{name} "
                      f"to {new}")
