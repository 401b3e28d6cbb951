"""`BlockTrainer`: one step of block-wise training, driven by a schedule built once.

Activation memory does not grow with depth: the forward pass keeps only each block's input
stack and the layers' states; the backward pass reconstructs every reversible layer's input
from its output (RevNet, Gomez et al. 2017; Reformer, Kitaev et al. 2020) and updates each
layer with its own fused forward-backward-optimizer function as soon as its gradient is
known (Trax's ``ReversibleSerialTrainer`` design). Where values live is a `ParamStore`;
`ReversibleSerialTrainer` and `MemoryEfficientTrainer` are this class with a
`DeviceStore` and a `HostStore`.

With ``fsdp=True`` (ZeRO-3 / FSDP) the store keeps each layer's weights and slots sharded
over the mesh; each of the layer's functions all-gathers its weights first, reduce-scatters
its gradient and updates only the local shard (see `revtrain.trainers.fbo`), so a device
holds ``(weights + slots) / n_devices`` plus one layer's gathered weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from revtrain import host_heap
from revtrain.layers.base import Layer, inputs_from_stack, outputs_onto_stack
from revtrain.layers.blocks import blocks_to_layers
from revtrain.layers.reversible import ReversibleLayer, ReversibleSelect
from revtrain.trainers import devices
from revtrain.trainers.base import OptimizerFn, TrainerBase
from revtrain.trainers.fbo import FBO, FORWARD, LOSS, FnCache
from revtrain.trainers.precompile import (
    AbstractStore,
    CallRecorder,
    CompileTimes,
    abstract_step_inputs,
    compile_all,
    timed,
)
from revtrain.trainers.protocols import DeviceFootprint, ParamStore, TrainState
from revtrain.trainers.schedule import Op, build_schedule
from revtrain.trainers.stores import delete_arrays

Block = tuple[Layer, Sequence[ReversibleLayer]]
StoreFactory = Callable[[jax.sharding.Mesh, int, TrainState, tuple[Op, ...]], ParamStore]


def _as_items(stack: Any) -> tuple:
    return tuple(stack) if isinstance(stack, tuple) else (stack,)


class BlockTrainer(TrainerBase):
    """Trains ``blocks`` then ``loss_layer`` layer by layer, reversing reversible layers.

    The model is the flat layer list ``[std_0, *rev_0, std_1, *rev_1, ..., loss_layer]``
    (see `revtrain.layers.blocks_to_layers`); layer ``i`` gets the rng
    ``split(split(rng, n_devices)[d], n_layers)[i]`` on device ``d`` (``split(rng,
    n_layers)[i]`` for one device), exactly what ``Serial(*layers)`` does with the device
    key, so this trainer and `Trainer` on ``Serial(*layers)`` agree, dropout included.

    One step runs the schedule (`revtrain.trainers.schedule`): forward through each block,
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
      make_store: ``(mesh, n_devices, initial TrainState, schedule) -> ParamStore``; with
        ``fsdp`` the store must keep weights and slots in `devices.value_shardings` layout.
      n_devices: devices to use (default: all local devices).
      mesh: a one-axis ``jax.sharding.Mesh`` to use instead of ``n_devices`` (see
        `revtrain.trainers.devices.resolve_mesh`).
      fsdp: shard weights and optimizer slots over the mesh (`devices.fsdp_spec`). Results
        do not change (the invariance); any optax transformation works, the non-elementwise
        ones (e.g. ``clip_by_global_norm`` inside ``optimizer_fn``) see the global gradient.
      free_accelerators_on_step: delete this trainer's transient device buffers (the
        batch, block inputs, final activations and cotangents) at the end of each step;
        the batch is then copied through host memory, so a caller's arrays are never
        deleted.
      keep_every: keep an exact copy of the stack every ``keep_every`` reversible layers
        of a block (the input of its reversible layers ``p = k, 2k, ...``, counting from
        0; flat layers, so a `ReversibleTransformerLM` layer is 4: two half-residuals and
        two swaps); the backward pass recomputes such a layer from the copy instead of
        reversing it, so reconstruction drift (bfloat16 compute: see
        `revtrain.layers.reconstruction_error`) accumulates over at most ``keep_every - 1``
        reversals instead of the whole block. Costs ``n_rev // keep_every`` more stack
        copies per block (``device_footprint().kept_bytes``; host memory for a
        `HostStore`) and no extra compute. None keeps only block inputs.
      clip_global_norm: clip the gradient of the whole model to this global L2 norm
        before any update, exactly as ``optax.chain(optax.clip_by_global_norm(c), opt)``
        does in `Trainer` (per-layer optimizers alone can only clip each layer by its own
        norm, e.g. ``optimizer_fn(..., clip_gradient_norm=c)``, which is cheaper). Cost:
        a first backward pass that reverses and recomputes every layer again to get each
        layer's squared gradient norm (no updates, no slot transfers), so the backward
        work doubles: measured 1.6-1.8x the step time with `DeviceStore` and 1.45-1.6x
        with `HostStore` (ReversibleTransformerLM d_model 64, 8 layers, sequence 64,
        batch 8, Adam, one device of a 2-core CPU; median of 7 steps). The final
        activations are held through that pass (one stack). Its stats add
        ``gradients_l2``, the global norm. None (the default) does not clip.

    Raises:
      TypeError: for a block member that is not a `ReversibleLayer`.
      ValueError: for uninitialised layers, an impossible ``n_devices``, ``keep_every <
        1`` or ``clip_global_norm <= 0``.
    """

    def __init__(self, blocks: Sequence[Block], loss_layer: Layer, optimizer_fn: OptimizerFn,
                 make_store: StoreFactory, n_devices: int | None = None,
                 free_accelerators_on_step: bool = False, keep_every: int | None = None,
                 clip_global_norm: float | None = None, mesh: jax.sharding.Mesh | None = None,
                 fsdp: bool = False):
        if clip_global_norm is not None and not clip_global_norm > 0:
            raise ValueError(f"clip_global_norm={clip_global_norm} must be > 0 or None")
        blocks = [(std, list(revs)) for std, revs in blocks]
        for _std, revs in blocks:
            for layer in revs:
                if not isinstance(layer, ReversibleLayer):
                    raise TypeError(f"block member {layer.name} (created at {layer.caller}) "
                                    f"is not a ReversibleLayer; put it in the block's "
                                    f"standard layer")
        self.layers = blocks_to_layers(blocks, loss_layer)
        super().__init__(self.layers, optimizer_fn, n_devices, mesh=mesh, fsdp=fsdp)
        self.free_accelerators_on_step = free_accelerators_on_step
        self._copy_batch = free_accelerators_on_step
        self.keep_every, self.clip_global_norm = keep_every, clip_global_norm
        self._schedule = build_schedule([len(revs) for _, revs in blocks], keep_every,
                                        clip_global_norm is not None)
        optimizers = [optimizer_fn() for _ in self.layers]
        weights = tuple(layer.weights for layer in self.layers)
        initial = TrainState(weights, tuple(layer.state for layer in self.layers),
                             _InitialSlots(optimizers, weights))
        self._init_learning_rate(initial.slots[-1])
        self._remember_signature(initial._replace(slots=tuple(
            jax.eval_shape(opt.init, w) for opt, w in zip(optimizers, weights, strict=True))))
        self._store = make_store(self.mesh, self.n_devices, initial, self._schedule)
        self._cache = FnCache(self.mesh, optimizers[0], fsdp=self.fsdp)
        self._fns = tuple(None if _reorders_only(op, self.layers[op.layer]) else
                          self._cache.get(op.kind, self.layers[op.layer], op.norm_only)
                          for op in self._schedule)
        loss_at = next(k for k, op in enumerate(self._schedule) if op.kind == LOSS)
        self._phase_starts = {loss_at: "loss_start", loss_at + 1: "backward_start"}
        replicated = devices.replicated(self.mesh)
        self._indices = tuple(jax.device_put(np.int32(i), replicated)
                              for i in range(len(self.layers)))
        self._max_norm = (None if clip_global_norm is None else
                          jax.device_put(np.float32(clip_global_norm), replicated))
        self._norm_counted = eqx.debug.assert_max_traces(_global_norm, max_traces=None)
        self._global_norm = jax.jit(self._norm_counted)
        self._recorder: CallRecorder | None = None
        self.compile_times: CompileTimes | None = None

    # ----------------------------------------------------------------------------------
    # The training values.

    def host_values(self, part: str) -> tuple:
        """One entry per flat layer of ``part`` (weights, state or slots)."""
        return self._store.host_values(part)

    def saved_values(self, part: str) -> tuple:
        """One entry per flat layer of ``part`` as the store holds it, for a sharded
        checkpoint: global ``jax.Array`` s (sharded with ``fsdp``) or host arrays (see
        `revtrain.trainers.protocols.ParamStore`)."""
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
        counts = self._cache.trace_counts()
        if self.clip_global_norm is not None:
            counts["global_norm"] = eqx.debug.get_num_traces(self._norm_counted)
        return counts

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
          ``learning_rate`` and ``layer{i}/gradients_l2`` (of the global gradient, before
          clipping), ``layer{i}/weights_l2`` for every flat layer ``i``; with
          ``clip_global_norm`` also ``gradients_l2``, the whole model's gradient norm.

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
        common = {"rngs": devices.shard_per_device(self._rng_data(rng, len(self.layers)),
                                                   self.mesh),
                  "weight_total": self._weight_totals(batch)}
        lr_rep = None if lr is None else jax.device_put(lr, devices.replicated(self.mesh))
        loss, stats = self._run_schedule(stack, common, lr_rep)
        if learning_rate is not None:
            self.learning_rate = float(learning_rate)
        self._notify_phase("step_end")
        stats = {"loss": loss, **stats}
        if lr is not None:
            stats["learning_rate"] = np.float32(lr)
        if first:  # One wait, in the first step only, to tell running from compiling.
            jax.block_until_ready(loss)
            self.compile_times = self.compile_times._replace(
                run_s=time.perf_counter() - start)
        return loss, stats

    def precompile(self, batch_signature: Sequence[Any],
                   learning_rate: float | None = None) -> CompileTimes:
        """Traces and compiles every per-layer program of a step before the first step.

        Walks the schedule once on abstract values, then compiles the distinct programs
        side by side in a thread pool; the steps then compile nothing (details, and how
        to enable JAX's persistent compilation cache, in `revtrain.trainers.precompile`).
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
        stack, common, lr_rep = abstract_step_inputs(
            self.mesh, self.n_devices, batch_signature,
            self._rng_data(jax.random.key(0), len(self.layers)),
            self._learning_rate_arg(learning_rate))
        saved = self._store, self.observers
        self._recorder, self.observers = CallRecorder(self.mesh), []
        self._store = AbstractStore(self.mesh, self._signature, self.fsdp)
        try:
            start = time.perf_counter()
            self._run_schedule(stack, common, lr_rep)
            trace_s = time.perf_counter() - start
            calls = list(self._recorder.calls.values())
        finally:
            self._recorder, (self._store, self.observers) = None, saved
        _, compile_s = timed(compile_all, calls)
        # The compiler's freed host memory goes back to the system (`host_heap`): the
        # first step's peak RSS is then the larger, not the sum, of compiling and running
        # (measured: 898 -> 786 MiB, ``benchmarks/host_memory.py``,
        # ReversibleSerialTrainer at depth 16).
        host_heap.release_free_host_memory()
        self.compile_times = CompileTimes(trace_s, compile_s, math.nan, len(calls))
        return self.compile_times

    def _run_schedule(self, stack: Any, common: dict, lr_rep: Any) -> tuple:
        """Runs the schedule's ops; returns ``(loss, per-layer stats)``."""
        store = self._store
        store.begin_step()
        self._notify_phase("step_start")
        kept: dict[int, Any] = {}
        stats: dict[str, Any] = {}
        ct = loss = final = None
        squared_norms: list[jax.Array] = []
        clip = None
        for position, op in enumerate(self._schedule):
            if op.kind == LOSS:
                final = store.end_forward(stack) if final is None else final
                stack = final
                if not op.norm_only and squared_norms:
                    clip = (self._call(self._global_norm, tuple(squared_norms)),
                            self._max_norm)
                    stats["gradients_l2"] = clip[0]
            if position in self._phase_starts:
                self._notify_phase(self._phase_starts[position])
            store.prepare(position)
            fn, layer = self._fns[position], self.layers[op.layer]
            rep = {"index": self._indices[op.layer], "lr": lr_rep, "clip": clip}
            if op.kind == FORWARD:
                if op.starts_block or op.keep_point:
                    kept[op.layer] = store.stash(stack)
                stack = self._forward(op, fn, layer, stack, common, rep)
                continue
            if op.kind == FBO:
                stack = store.unstash(kept[op.layer] if op.norm_only else kept.pop(op.layer))
            if op.norm_only:
                stack, ct, squared_norm = self._norm(op, fn, layer, stack, ct, common, rep)
                squared_norms.append(squared_norm)
            elif op.kind == LOSS:
                loss, stack, ct = self._loss(op, fn, layer, stack, common, rep, stats)
            elif op.kind == FBO:
                ct = self._std_backward(op, fn, layer, stack, ct, common, rep, stats)
            else:
                stack, ct = self._reverse(op, fn, layer, stack, ct, common, rep, stats)
        if self.free_accelerators_on_step and self._recorder is None:
            delete_arrays((stack, ct, kept, final))
        store.finish_step()
        return loss, stats

    def _call(self, fn: Callable, *args: Any) -> Any:
        """Calls ``fn``, or records the call while `precompile` walks the schedule."""
        return fn(*args) if self._recorder is None else self._recorder(fn, *args,
                                                                       grouped=False)

    def _dispatch(self, op: Op, fn: Callable, *args: Any) -> Any:
        if self._recorder is not None:
            return self._recorder(fn, *args)
        if self.observers:
            self._notify_dispatch(op.label, fn, args)
        outputs = fn(*args)
        self._inflight.note(outputs)
        return outputs

    def _forward(self, op, fn, layer, stack, common, rep) -> Any:
        if fn is None:  # `_reorders_only`: no program, the same arrays in another order.
            y, _ = layer.pure_fn(inputs_from_stack(stack, layer.n_in), (), (), None)
            self._store.keep_state(op.layer, self._store.state(op.layer))
            return outputs_onto_stack(y, stack, layer.n_in)
        dev = {"x": inputs_from_stack(stack, layer.n_in),
               "state": self._store.state(op.layer), "rngs": common["rngs"]}
        y, new_state = self._dispatch(op, fn, dev, self._store.weights(op.layer), rep)
        self._store.keep_state(op.layer, new_state)
        return outputs_onto_stack(y, stack, layer.n_in)

    def _loss_input(self, layer, stack) -> Any:
        stack = self._store.unstash(stack)
        n_items = len(_as_items(stack))
        if n_items != layer.n_in:
            raise ValueError(f"the loss layer {layer.name} takes {layer.n_in} stack items but "
                             f"the model leaves {n_items}; make the loss layer consume the "
                             f"whole stack")
        return stack

    def _norm(self, op, fn, layer, stack, ct, common, rep) -> tuple[Any, Any, jax.Array]:
        """A ``norm_only`` op: moves ``stack`` and ``ct`` down one layer as the update
        pass will, and returns the layer's squared gradient norm; updates nothing."""
        store = self._store
        if op.kind == LOSS:
            stack = self._loss_input(layer, stack)
            dev = {"x": stack, "state": store.state(op.layer), **common}
            ct_x, squared_norm = self._dispatch(op, fn, dev, store.weights(op.layer), rep)
            return stack, ct_x, squared_norm
        ct_y = inputs_from_stack(ct, layer.n_out)
        if op.kind == FBO:
            dev = {"x": inputs_from_stack(stack, layer.n_in), "state": store.state(op.layer),
                   "rngs": common["rngs"], "ct_y": ct_y}
            ct_x, squared_norm = self._dispatch(op, fn, dev, store.weights(op.layer), rep)
            return stack, outputs_onto_stack(ct_x, ct, layer.n_out), squared_norm
        dev = {"y": inputs_from_stack(stack, layer.n_out), "ct_y": ct_y,
               "state": store.state(op.layer), "new_state": store.new_state(op.layer),
               "rngs": common["rngs"]}
        x, ct_x, squared_norm = self._dispatch(op, fn, dev, store.weights(op.layer), rep)
        return (outputs_onto_stack(x, stack, layer.n_out),
                outputs_onto_stack(ct_x, ct, layer.n_out), squared_norm)

    def _loss(self, op, fn, layer, stack, common, rep, stats) -> tuple:
        stack = self._loss_input(layer, stack)
        dev = {"x": stack, "state": self._store.state(op.layer), **common}
        loss, ct, params, new_state, layer_stats = self._dispatch(
            op, fn, dev, self._store.params(op.layer), rep)
        self._store.keep_params(op.layer, params)
        self._store.keep_state(op.layer, new_state)
        _add_layer_stats(stats, op.layer, layer_stats)
        return loss, stack, ct

    def _reverse(self, op, fn, layer, stack, ct, common, rep, stats) -> tuple[Any, Any]:
        store = self._store
        dev = {"y": inputs_from_stack(stack, layer.n_out),
               "ct_y": inputs_from_stack(ct, layer.n_out), "state": store.state(op.layer),
               "new_state": store.new_state(op.layer), "rngs": common["rngs"]}
        x, ct_x, params, layer_stats = self._dispatch(op, fn, dev, store.params(op.layer), rep)
        store.keep_params(op.layer, params)
        _add_layer_stats(stats, op.layer, layer_stats)
        return (outputs_onto_stack(x, stack, layer.n_out),
                outputs_onto_stack(ct_x, ct, layer.n_out))

    def _std_backward(self, op, fn, layer, stack, ct, common, rep, stats) -> Any:
        store = self._store
        dev = {"x": inputs_from_stack(stack, layer.n_in), "state": store.state(op.layer),
               "rngs": common["rngs"], "ct_y": inputs_from_stack(ct, layer.n_out)}
        ct_x, params, layer_stats = self._dispatch(op, fn, dev, store.params(op.layer), rep)
        store.keep_params(op.layer, params)
        _add_layer_stats(stats, op.layer, layer_stats)
        return outputs_onto_stack(ct_x, ct, layer.n_out)


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


def _global_norm(squared_norms: tuple[jax.Array, ...]) -> jax.Array:
    """``sqrt(sum of the layers' squared gradient norms)``: the whole model's gradient norm."""
    return jnp.sqrt(jnp.sum(jnp.stack(squared_norms)))


def _add_layer_stats(stats: dict, i: int, layer_stats: dict) -> None:
    for name, value in layer_stats.items():
        stats[f"layer{i}/{name}"] = value


def _reorders_only(op: Op, layer: Layer) -> bool:
    """A forward op that only permutes stack items (a `ReversibleSelect`: no weights, no
    state, no rng), run on the host without a program."""
    return op.kind == FORWARD and isinstance(layer, ReversibleSelect)
