"""`BlockTrainer`: one step of block-wise training, a plan built once and run by one executor.

Activation memory does not grow with depth: the forward pass keeps only each block's input
stack and the layers' states; the backward pass reconstructs every reversible layer's input
from its output (RevNet, Gomez et al. 2017; Reformer, Kitaev et al. 2020) and updates each
layer with its own fused forward-backward-optimizer function as soon as its gradient is
known (Trax's ``ReversibleSerialTrainer`` design). Where values live is a `ParamStore`;
`ReversibleSerialTrainer` and `MemoryEfficientTrainer` are this class with a
`DeviceStore` and a `HostStore`.

With ``fsdp=True`` (ZeRO-3 / FSDP) the store keeps each layer's weights and slots sharded
over the mesh; each of the layer's functions all-gathers its weights first, reduce-scatters
its gradient and updates only the local shard (see `revtrain.trainers.block.programs`), so
a device holds ``(weights + slots) / n_devices`` plus one layer's gathered weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np

from revtrain import host_heap
from revtrain.layers.base import Layer
from revtrain.layers.blocks import Block, blocks_to_layers, extract_reversible_blocks
from revtrain.layers.reversible import ReversibleLayer
from revtrain.parallel.placement import Placement
from revtrain.parallel.rngs import StepKeys
from revtrain.trainers.block.compiling import compile_all, timed
from revtrain.trainers.block.executor import (
    BlockStep,
    StepInputs,
    run_step,
    summary_program,
)
from revtrain.trainers.block.options import BlockOptions
from revtrain.trainers.block.plan import build_plan, build_schedule, runs_of, windows
from revtrain.trainers.block.precompile import (
    AbstractStore,
    CompileTimes,
    CountedStore,
    RecordingDispatcher,
)
from revtrain.trainers.block.programs import ProgramCache
from revtrain.trainers.block.scan_programs import find_runs
from revtrain.trainers.block.stores import ParamStore, StoreFactory
from revtrain.trainers.common.base import OptimizerFn, TrainerBase
from revtrain.trainers.common.protocols import DeviceFootprint, ResidentBytes, TrainState


def _checked_blocks(blocks: Sequence[Block]) -> list[tuple[Layer, list[Layer]]]:
    """``blocks`` as ``(standard layer, reversible layers)`` lists, after checking them.

    Raises:
      TypeError: for a block member that is not reversible.
    """
    blocks = [(std, list(revs)) for std, revs in blocks]
    for _std, revs in blocks:
        for layer in revs:
            if not isinstance(layer, ReversibleLayer):
                raise TypeError(f"block member {layer.name} (created at {layer.caller}) "
                                f"is not a ReversibleLayer; put it in the block's "
                                f"standard layer")
    return blocks


class BlockTrainer(TrainerBase):
    """Trains ``blocks`` then ``loss_layer`` layer by layer, reversing reversible layers.

    The model is the flat layer list ``[std_0, *rev_0, std_1, *rev_1, ..., loss_layer]``
    (see `revtrain.layers.blocks_to_layers`); layer ``i`` gets the rng
    ``split(split(rng, n_devices)[d], n_layers)[i]`` on device ``d`` (``split(rng,
    n_layers)[i]`` for one device), exactly what ``Serial(*layers)`` does with the device
    key, so this trainer and `Trainer` on ``Serial(*layers)`` agree, dropout included.

    One step runs the plan (`revtrain.trainers.block.plan`, run by
    `revtrain.trainers.block.executor.run_step`): forward through each block,
    keeping only the block's input stack and the layers' states; the loss layer's fbo; then
    backward through the blocks in reverse: each reversible layer's reverse-and-fbo
    reconstructs its input from its output, each standard layer's fbo recomputes it from the
    stored block input. The forward op of a `ReversibleSelect` (e.g. `ReversibleSwap`)
    dispatches nothing: it only reorders stack items, which the host does on the arrays (a
    Transformer block's two swaps: 131 -> 99 dispatches per step at depth 16); its
    reverse-and-fbo is a program, as it updates the layer's optimizer state. Each layer has
    its own optimizer state (``optimizer_fn()`` is called once per layer). Compiled
    functions are resolved once, at construction, and shared between layers with equal
    non-None `Layer.structure_key` (using the transformation of the first such layer:
    ``optimizer_fn`` must return equivalent transformations on every call).

    Invariance, as in `Trainer`: the loss fbo gives each device's loss the cotangent
    ``W_d / sum W`` (its share of the global batch weights), so every cotangent flowing
    back is of the global weighted-mean loss, and each layer's gradient is the sum of the
    per-device gradients; results do not depend on the device or process count (dropout
    aside). Layer state is per device, as in `Trainer`.

    Args:
      blocks: ``[(std_layer, [rev_layers]), ...]``, from `extract_reversible_blocks`; all
        layers initialised (e.g. with `init_reversible_blocks`).
      loss_layer: maps the final stack to a scalar loss; consumes every stack item.
      optimizer_fn: returns an optax ``GradientTransformation``.
      make_store: a `revtrain.trainers.block.stores.StoreFactory`, ``(placement, initial
        TrainState, schedule) -> ParamStore``.
      placement: where values live (`revtrain.parallel.placement.Placement`; default:
        all local devices). With ``fsdp``, weights and optimizer slots are sharded over
        the mesh (`revtrain.parallel.placement.fsdp_spec`); results do not change (the
        invariance), and the non-elementwise optax transformations (e.g.
        ``clip_by_global_norm`` inside ``optimizer_fn``) see the global gradient.
      options: how the step runs (`revtrain.trainers.block.options.BlockOptions`: freeing,
        ``keep_every``, ``clip_global_norm``, ``scan_layers``, ``scan_window``); default
        ``BlockOptions()``. Scanning needs a store factory that accepts runs
        (``make_store`` is given the schedule, whose ops name the runs).

    Raises:
      TypeError: for a block member that is not a `ReversibleLayer`.
      ValueError: for uninitialised layers.
    """

    def __init__(self, blocks: Sequence[Block], loss_layer: Layer, optimizer_fn: OptimizerFn,
                 make_store: StoreFactory, placement: Placement | None = None,
                 options: BlockOptions | None = None):
        options = BlockOptions() if options is None else options
        blocks = _checked_blocks(blocks)
        self.layers = blocks_to_layers(blocks, loss_layer)
        super().__init__(self.layers, optimizer_fn, None, placement=placement)
        self.options = options
        self.free_accelerators_on_step = free_accelerators_on_step = (
            options.free_accelerators_on_step)
        self._copy_batch = free_accelerators_on_step
        self.keep_every = options.keep_every
        self.clip_global_norm = clip_global_norm = options.clip_global_norm
        self.scan_layers = options.scan_layers
        block_sizes = [len(revs) for _, revs in blocks]
        runs = find_runs(self.layers, block_sizes) if options.scan_layers else ()
        if options.scan_window is not None:
            runs = windows(runs, options.scan_window)
        schedule = build_schedule(block_sizes, options.keep_every,
                                  clip_global_norm is not None, runs)
        self.schedule, self.runs = tuple(schedule), runs_of(schedule)
        optimizers = [optimizer_fn() for _ in self.layers]
        weights = tuple(layer.weights for layer in self.layers)
        initial = TrainState(weights, tuple(layer.state for layer in self.layers),
                             _InitialSlots(optimizers, weights))
        slot_shapes = tuple(jax.eval_shape(opt.init, w)
                            for opt, w in zip(optimizers, weights, strict=True))
        self._init_learning_rate(slot_shapes[-1] if self.abstract else initial.slots[-1])
        self._remember_signature(initial._replace(slots=slot_shapes))
        # On an abstract model nothing is stored: the trainer only plans (`walk_abstract`).
        self._store: ParamStore = (
            AbstractStore(self.placement, self._signature, self.runs) if self.abstract
            else make_store(self.placement, initial, schedule))
        self._programs = ProgramCache(self.placement, optimizers[0])
        replicated = self.placement.replicated
        summarize, counted = summary_program(squared=False)
        sqrt_of_sum, counted_squared = summary_program(squared=True)
        self._norm_counters = {"step_summary": counted}
        if clip_global_norm is not None:
            self._norm_counters["global_norm_squared"] = counted_squared
        self._step = BlockStep(
            plan=build_plan(self.layers, schedule, self._program),
            indices=tuple(jax.device_put(np.int32(i), replicated)
                          for i in range(len(self.layers))),
            max_norm=(None if clip_global_norm is None else
                      jax.device_put(np.float32(clip_global_norm), replicated)),
            free_transients=free_accelerators_on_step, summarize=summarize,
            sqrt_of_sum=sqrt_of_sum)
        self._keys = StepKeys(self.placement, len(self.layers))
        self.compile_times: CompileTimes | None = None

    @classmethod
    def from_model(cls, model: Layer, loss_layer: Layer, optimizer_fn: OptimizerFn,
                   **options: Any) -> BlockTrainer:
        """A block trainer of an initialised ``model`` followed by ``loss_layer``: its
        blocks and loss layer (`revtrain.layers.extract_reversible_blocks`), and
        ``options`` as the constructor's keyword arguments. For the configurations
        (`ReversibleSerialTrainer`, `MemoryEfficientTrainer`), whose constructors take
        ``(blocks, loss_layer, optimizer_fn, **options)``.
        """
        blocks, loss = extract_reversible_blocks([model, loss_layer])
        return cls(blocks, loss, optimizer_fn, **options)

    def _program(self, op: Any, layer: Layer) -> Any:
        return self._programs.get(op, self.layers[op.run.start:op.run.start + op.run.period])

    # ----------------------------------------------------------------------------------
    # The training values.

    def host_values(self, part: str) -> tuple:
        """One entry per flat layer of ``part`` (weights, state or slots)."""
        return self._store.host_values(part)

    def saved_values(self, part: str) -> tuple:
        """One entry per flat layer of ``part`` as the store holds it, for a sharded
        checkpoint: global ``jax.Array`` s (sharded with ``fsdp``) or host arrays (see
        `revtrain.trainers.common.protocols.ParamStore`)."""
        return self._store.saved_values(part)

    def value_shardings(self, part: str) -> tuple:
        """Per leaf of `saved_values`, the ``NamedSharding`` to restore it into (None for a
        value held in host memory)."""
        return self._store.value_shardings(part)

    def restore(self, train_state: TrainState) -> None:
        train_state = self._checked(train_state)
        self._store.restore(train_state)
        self._init_learning_rate(train_state.slots[-1])

    def device_footprint(self) -> DeviceFootprint:
        return self._store.device_footprint()

    def block_until_ready(self) -> None:
        self._store.block_until_ready()

    def trace_counts(self) -> dict[str, int]:
        return {**self._programs.trace_counts(),
                **{name: eqx.debug.get_num_traces(counted)
                   for name, counted in self._norm_counters.items()}}

    def _own_layers(self) -> list[Layer]:
        return list(self.layers)

    def _per_layer(self, tree: Any) -> list[Any]:
        return list(tree)

    # ----------------------------------------------------------------------------------
    # One step.

    def one_step(self, batch: Any, rng: jax.Array, step: int = 0,
                 learning_rate: float | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Runs one training step block by block; same contract as `Trainer.one_step`.

        ``step`` is accepted for Trax parity (its trainers take it) and not used: the
        learning-rate schedule lives in the training loop.

        Returns:
          ``(loss, stats)``: the float32 scalar loss, the weighted mean over the global
          batch (as `Trainer`: independent of the device count); stats ``loss``,
          ``learning_rate``, ``gradients_l2`` (the whole model's global gradient norm,
          before clipping), ``weights_l2`` (the whole model's, after the update), and per
          flat layer ``layers/gradients_l2`` and ``layers/weights_l2``: float32
          ``[n_layers]`` vectors whose entry ``i`` is flat layer ``i``'s global gradient
          norm (before clipping) and new weight norm (vectors, as scanned layers' summaries
          are in flax and MaxText: a step returns the same few arrays at any depth).
          Device values: nothing is read to the host, and the call returns once the step
          is dispatched.

        Raises:
          ValueError: for a batch not divisible by ``n_devices``, a learning rate the
            optimizer cannot take, or a stack that does not match the loss layer's inputs;
            the weights are unchanged after any of these (they come before any update).
            Layers are updated one by one in the backward pass and their old buffers are
            donated, so an error there (a layer whose gradient cannot be traced, running
            out of accelerator memory, an observer that raises) leaves the layers already
            updated with their new values; ``restore`` a `TrainState` (e.g. the last
            checkpoint) to undo it -- it works after any failed step.
        """
        del step
        lr = self._learning_rate_arg(learning_rate)
        stack = self._shard_batch(batch)
        first = self.compile_times is None or math.isnan(self.compile_times.run_s)
        if self.compile_times is None:
            self.precompile(batch, learning_rate)
        start = time.perf_counter()
        inputs = StepInputs(stack, self._keys(rng), self._placed_learning_rate(lr))
        result = run_step(self._step, self._store, self._dispatcher, inputs)
        if learning_rate is not None:
            self.learning_rate = float(learning_rate)
        self._dispatcher.phase("step_end")
        stats = {"loss": result.loss, "gradients_l2": result.gradients_l2,
                 "weights_l2": result.weights_l2}
        if lr is not None:
            stats["learning_rate"] = inputs.lr
        stats.update({f"layers/{name}": value
                      for name, value in result.layer_stats._asdict().items()})
        if first:  # One wait, in the first step only, to tell running from compiling.
            jax.block_until_ready(result.loss)
            self.compile_times = self.compile_times._replace(
                run_s=time.perf_counter() - start)
        return result.loss, stats

    def precompile(self, batch_signature: Sequence[Any],
                   learning_rate: float | None = None) -> CompileTimes:
        """Traces and compiles every per-layer program of a step before the first step.

        Runs the step once on abstract values (`revtrain.trainers.block.precompile`: an
        `AbstractStore` and a `RecordingDispatcher`), then compiles the distinct programs
        (`revtrain.trainers.block.compiling.compile_all`: side by side in a thread pool,
        one after another while JAX's persistent compilation cache is on); the steps then
        compile nothing (details in `revtrain.trainers.block.precompile`).
        The first `one_step` calls this when it was not called.

        Args:
          batch_signature: the global batch ``(inputs, targets, weights)`` as arrays or
            `jax.ShapeDtypeStruct`s (``[batch, ...]``, batch divisible by ``n_devices``).
          learning_rate: as `one_step`'s (only whether one is passed matters).

        Returns:
          `CompileTimes` (``run_s`` NaN until the first step ran); also kept as
          ``compile_times``.

        Raises:
          ValueError: for a batch not divisible by ``n_devices``; any error tracing or
            compiling a layer's functions.
        """
        recorder = RecordingDispatcher(self.placement)
        start = time.perf_counter()
        self.walk_abstract(batch_signature, recorder, learning_rate=learning_rate)
        trace_s = time.perf_counter() - start
        calls = [*recorder.calls.values(), self._keys.abstract_call()]
        _, compile_s = timed(compile_all, calls)
        # The compiler's freed host memory goes back to the system (`host_heap`): the
        # first step's peak RSS is then the larger, not the sum, of compiling and running
        # (measured: 898 -> 786 MiB, ``benchmarks/host_memory.py``,
        # ReversibleSerialTrainer at depth 16).
        host_heap.release_free_host_memory()
        self.compile_times = CompileTimes(trace_s, compile_s, math.nan, len(calls))
        return self.compile_times

    def abstract_store(self, device: Any = None) -> CountedStore:
        """An abstract store of this trainer's values that counts their bytes, where its
        store keeps them: here all on the devices (`CountedStore`);
        `MemoryEfficientTrainer` keeps a window.

        Args:
          device: what accounts for the device copies a store makes and frees
            (``track``/``drop``, the planner's `revtrain.planning.ledger.LiveValues`);
            unused here, where no value moves.
        """
        del device
        return CountedStore(self.placement, self._signature, self.runs)

    def values_bytes(self) -> ResidentBytes:
        """Bytes of every layer's weights, slots and state on one device, were they all
        there (a scanned run's stacked once): what `ReversibleSerialTrainer` keeps."""
        return CountedStore(self.placement, self._signature, self.runs).all_bytes()

    def walk_abstract(self, batch_signature: Sequence[Any], dispatcher: Any,
                      store: Any = None, learning_rate: float | None = None,
                      device: Any = None) -> None:
        """Runs the step's plan once on abstract values, telling ``dispatcher`` of every
        call (`precompile` records them; the planner, `revtrain.planning`, compiles and
        accounts for them).

        Args:
          batch_signature: the global batch, as `precompile`'s.
          dispatcher: a `revtrain.trainers.common.dispatch.Dispatcher` that runs nothing.
          store: the `revtrain.trainers.block.stores.StepValues` the walk reads (default
            `abstract_store`'s).
          learning_rate: as `one_step`'s (only whether one is passed matters).
          device: accounts for the step's inputs as device values (``track``, the
            planner's `revtrain.planning.ledger.LiveValues`), or None.

        Raises:
          ValueError: for a batch not divisible by ``n_devices``.
        """
        inputs = StepInputs(*self._abstract_inputs(batch_signature, learning_rate,
                                                   self._keys.signature(), device))
        store = self.abstract_store() if store is None else store
        run_step(self._step, store, dispatcher, inputs)


class _InitialSlots(Sequence):
    """Each layer's initial optimizer slots, made when read: a store copies them where they
    live one layer at a time, so the whole model's initial slots never exist beside the
    store's copies (at depth 32 of the reformer benchmark, about 200 MiB of RSS)."""

    def __init__(self, optimizers: Sequence[Any], weights: Sequence[Any]):
        self._optimizers, self._weights = optimizers, weights

    def __len__(self) -> int:
        return len(self._weights)

    def __getitem__(self, i: int) -> Any:
        return self._optimizers[i].init(self._weights[i])
