"""`Trainer`: the plain data-parallel trainer (whole model and its activations on device)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from revtrain.layers.base import Layer
from revtrain.layers.blocks import blocks_to_layers, extract_reversible_blocks
from revtrain.layers.combinators import Serial
from revtrain.layers.fused_head import fuse_loss_heads
from revtrain.layers.remat import remat_schedule
from revtrain.parallel import transfers
from revtrain.parallel.batches import device_weight_total, for_n_devices
from revtrain.parallel.collectives import REP, gather_weights, reduce_gradients
from revtrain.parallel.placement import Placement
from revtrain.parallel.rngs import StepKeys
from revtrain.parallel.transfers import abstract_device_bytes
from revtrain.trainers.common.base import OptimizerFn, TrainerBase
from revtrain.trainers.common.global_loss import check_scalar_loss, global_loss, loss_share
from revtrain.trainers.common.protocols import DeviceFootprint, ResidentBytes, TrainState
from revtrain.trainers.common.scanned_values import ScannedValues
from revtrain.trainers.common.updates import apply_optimizer


class Trainer(TrainerBase):
    """Data-parallel training of a model that ends in its loss, one jitted update per step.

    The whole model runs under ``jax.grad`` (all activations of a step are stored), inside
    ``jax.shard_map`` over the mesh: each device gets ``batch // n_devices`` examples (on a
    named mesh ``batch // (data x fsdp)`` rows and ``length // seq`` positions) and its
    own rng (``split(rng, n_devices)[d]``; the rng itself for one device).
    The optimizer update runs on the global weights, gradient and slots after it, in the
    same jitted program. Weight and slot buffers are donated. This is the baseline the
    reversible trainers must agree with.

    FSDP (``fsdp=True``, ZeRO-3 layout): weights and optimizer slots are stored sharded
    over the ``batch`` axis, each leaf along its largest dimension the axis size divides
    (`revtrain.parallel.placement.fsdp_spec`: leaves under 1024 elements or with no such
    dimension stay replicated). Inside the step each device all-gathers the sharded
    weights (``lax.all_gather(tiled=True)``), computes its gradient of the full weights,
    and the per-device gradients are summed *and* scattered in one reduce-scatter
    (``lax.psum_scatter``; replicated leaves are ``psum``-ed), so each device ends with its
    shard of the global gradient. The optimizer then runs on sharded arrays: XLA's
    partitioner updates each shard locally for element-wise transformations (Adam, SGD,
    ...) and inserts the reductions a non-element-wise one needs (e.g.
    ``optax.clip_by_global_norm``'s global norm), so *every* optax transformation is
    exact under FSDP, with no restriction. Per-device memory: ``(weights + slots) /
    n_devices`` at rest (`device_footprint`), plus the gathered weights and the gradient
    of one step while it runs (this trainer keeps all activations of a step anyway; the
    block trainers gather one layer at a time).

    Invariance: the loss is the weighted mean over the *global* batch, ``sum(w * loss) /
    sum(w)`` with ``w`` the batch's third item (each device's mean loss weighted by its
    share of the total weight, `revtrain.trainers.common.global_loss.loss_share`), and the
    gradient is the sum over devices of the gradients of those shares -- so losses,
    gradients and updated weights do not depend on how many devices or processes the batch
    is split over, nor on ``fsdp`` (the same per-device gradients are summed; only the order of
    the float32 additions may differ, ~1e-7 relative) -- dropout aside: each device draws
    its own masks, as in Trax. Layer state (e.g. BatchNorm statistics) is per device, as
    in Trax: each device's state is computed from its own rows (so batch statistics *do*
    depend on the split), and `state` and the layer objects show device 0's.

    Args:
      model_with_loss: an initialised layer mapping the batch ``(inputs, targets, weights)``
        to a scalar loss, e.g. ``Serial(model, CrossEntropyLoss())``.
      optimizer_fn: returns an optax ``GradientTransformation``; wrap it with
        ``optax.inject_hyperparams`` to set the learning rate per step.
      n_devices: devices to use (default: all local devices).
      mesh: a ``jax.sharding.Mesh`` to use instead of ``n_devices`` (may span processes):
        a named mesh of axes among ``data``, ``fsdp``, ``seq`` (e.g.
        ``jax.make_mesh((2, 2, 1), ('data', 'fsdp', 'seq'))``: rows over ``data x fsdp``,
        weights and slots over ``fsdp``, the length over ``seq``) or a one-axis mesh of
        another name (the batch axis); see `revtrain.parallel.mesh`.
      fsdp: shard weights and optimizer slots over the mesh (see above; on a named mesh
        its ``fsdp`` axis decides).
      placement: a `revtrain.parallel.placement.Placement` instead of ``n_devices``,
        ``mesh`` and ``fsdp``.
      scan_layers: keep each run of equal layers (`revtrain.layers.scan`) stacked in
        memory, so the step's forward, backward *and* optimizer update hold one copy of
        the run whatever its depth (`revtrain.trainers.common.scanned_values`; compile time stops
        growing with depth). The public values and checkpoints stay one entry per layer.
        Element-wise optimizers give bitwise the unstacked results; global-norm ones
        agree to float rounding. False: per-layer leaves (the forward still scans).
      remat: which layers run under ``jax.checkpoint`` (rematerialisation, JAX's
        ``remat``), so the backward pass keeps only their inputs and recomputes their
        activations: None (default) none, every activation is stored; ``'layer'`` each
        layer; an int ``k >= 1`` each group of ``k`` consecutive layers (``1`` is
        ``'layer'``). A layer is one sublayer of ``model_with_loss`` (a `Serial`), and in a
        run of equal layers one repetition of the run's group: the scan body (for the
        reversible LM, one attention + feed-forward block). A run is grouped on its own,
        as a scan over groups of ``k`` repetitions, each an inner scan under one
        checkpoint; when ``k`` does not divide the run's repeats the last group is the
        shorter remainder (its share of the run's weights sliced off: a copy). Layers
        between runs are grouped ``k`` at a time in order
        (`revtrain.layers.remat.RematSchedule`). The loss (the last sublayer) runs without
        a checkpoint: its backward pass follows its forward pass at once, so a checkpoint
        would add a recomputation and save nothing. Only the top-level sublayers count:
        `Trainer.from_model` (and `revtrain.training.build_trainer`) give the flat model;
        a nested model is one layer. A step costs about one more forward pass. Losses and
        weights equal the non-remat step's to float rounding (bitwise on CPU in the
        tests); weights, slots and checkpoints keep their layout.
      remat_policy: with ``remat``, the ``jax.checkpoint`` policy deciding which values
        inside a checkpointed group are saved after all: a ``jax.checkpoint_policies``
        member or its name (for gin), e.g. ``'dots_with_no_batch_dims_saveable'``
        (matmul outputs kept, the rest recomputed); None saves nothing but each group's
        inputs (``nothing_saveable``).

    Raises:
      ValueError: for an uninitialised model, an impossible ``n_devices``, a mesh with
        an axis outside ``data``/``fsdp``/``seq`` or that contradicts ``n_devices``, a
        ``remat`` other than None, ``'layer'`` or an int >= 1 (or with a model that is
        not a `Serial`), a ``remat_policy`` name that is not a ``jax.checkpoint_policies``
        policy, or a ``remat_policy`` without ``remat``.
      TypeError: for a non-bool ``fsdp`` or ``scan_layers``, a ``mesh`` that is not a
        Mesh, or a ``remat_policy`` that is not callable.
    """

    def __init__(self, model_with_loss: Layer, optimizer_fn: OptimizerFn,
                 n_devices: int | None = None, mesh: Mesh | None = None, fsdp: bool = False,
                 placement: Placement | None = None, scan_layers: bool = True,
                 remat: str | int | None = None,
                 remat_policy: str | Callable[..., Any] | None = None):
        super().__init__([model_with_loss], optimizer_fn, n_devices, mesh, fsdp, placement)
        if not isinstance(scan_layers, bool):
            raise TypeError(f"scan_layers={scan_layers!r} must be True or False")
        self._remat = remat_schedule(remat, remat_policy)
        if self._remat is not None and not isinstance(model_with_loss, Serial):
            raise ValueError(f"remat={remat!r} checkpoints the sublayers of a Serial, and "
                             f"model_with_loss is a {type(model_with_loss).__name__}; pass "
                             f"Serial(*layers, loss) or use Trainer.from_model")
        self._model = model_with_loss
        # Computed with its LM head and loss fused (no full logits; the same weights and
        # sublayers), found once here: `revtrain.layers.fuse_loss_heads`.
        self._computed = fuse_loss_heads(model_with_loss)
        self._optimizer = optimizer_fn()
        weights = model_with_loss.weights
        slots = jax.eval_shape(self._optimizer.init, weights)
        self._remember_signature(TrainState(weights, model_with_loss.state, slots))
        self._held = ScannedValues(self._computed, weights, model_with_loss.state,
                                   self._optimizer, scan_layers)
        self._public_shardings = {part: self.placement.weight_shardings(tree)
                                  for part, tree in (("weights", weights), ("slots", slots))}
        held = jax.eval_shape(self._held.held_weights, weights)
        self._shardings = {"weights": self._held.shardings(self.placement, held)}
        self._shardings["slots"] = self._held.shardings(
            self.placement, jax.eval_shape(self._optimizer.init, held))
        # Layout conversions, compiled once each (restores and checkpoints reuse them).
        held_fns = {"weights": (self._held.held_weights, self._held.public_weights),
                    "slots": (self._held.held_slots, self._held.public_slots)}
        self._convert = {(part, to): jax.jit(fns[to == "public"], out_shardings=(
            self._public_shardings if to == "public" else self._shardings)[part])
            for part, fns in held_fns.items() for to in ("held", "public")}
        if self.abstract:  # Shapes only, in the shardings the values would have.
            self._weights, self._slots, self._state = self._abstract_values(
                held, model_with_loss.state)
        else:
            self._weights = self._put_weights(weights)
            # Initialised in place: no device ever holds the whole slots when sharded.
            self._slots = jax.jit(self._optimizer.init,
                                  out_shardings=self._shardings["slots"])(self._weights)
            self._put_state(model_with_loss.state)
        self._init_learning_rate(self._slots)
        self._update, self._counted = self._make_update()
        self._keys = StepKeys(self.placement, None)

    def _abstract_values(self, held: Any, state: Any) -> tuple[Any, Any, Any]:
        """Held weights, slots and per-device state as `jax.ShapeDtypeStruct` s in the
        shardings the values would have (a trainer built on an abstract model)."""
        def placed(tree, shardings):
            return jax.tree.map(lambda a, sharding: jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=sharding), tree, shardings)
        rows = (self.placement.n_global_devices,)
        per_device = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            rows + tuple(a.shape), a.dtype, sharding=self.placement.per_device), state)
        return (placed(held, self._shardings["weights"]),
                placed(jax.eval_shape(self._optimizer.init, held), self._shardings["slots"]),
                per_device)

    def walk_abstract(self, batch_signature: Any, dispatcher: Any,
                      learning_rate: float | None = None, device: Any = None) -> None:
        """Dispatches one step's program to ``dispatcher`` on abstract values: the batch
        of ``batch_signature`` (global ``[batch, ...]`` shapes) split as `one_step` splits
        it, and the trainer's weights, state and slots as shapes in their shardings. The
        planner (`revtrain.planning`) passes a dispatcher that compiles and accounts, and
        a ``device`` that accounts for the step's inputs (``track``); a trainer built on
        an abstract model (`TrainerBase.abstract`) can do only this.

        Raises:
          ValueError: for a batch that does not split over the mesh.
        """
        batch, keys, lr = self._abstract_inputs(batch_signature, learning_rate,
                                                self._keys.signature(), device)
        values = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                             sharding=a.sharding),
                              (self._weights, self._state, self._slots))
        weights, state, slots = values
        dispatcher.phase("step_start")
        dispatcher.dispatch("train_step", self._update, batch, weights, state, keys, slots,
                            lr)
        dispatcher.phase("step_end")

    def values_bytes(self) -> ResidentBytes:
        """Bytes of the held weights, slots and per-device state on one device (values or,
        on an abstract model, shapes in their shardings): all on the device throughout."""
        def shapes(tree):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                               sharding=a.sharding), tree)
        return ResidentBytes(*(abstract_device_bytes(shapes(tree))
                               for tree in (self._weights, self._slots, self._state)))

    def _put_state(self, state: Any) -> None:
        self._state = transfers.shard_per_device(for_n_devices(state, self.n_devices),
                                                 self.placement)

    def _put_weights(self, weights: Any) -> Any:
        if not self._held.stacked:
            return transfers.put_sharded(weights, self._shardings["weights"])
        # Placed per layer first (values may be on any devices), then stacked on the mesh.
        public = transfers.put_sharded(weights, self._public_shardings["weights"])
        return self._convert["weights", "held"](public)

    def _put(self, values: TrainState) -> None:
        self._weights = self._put_weights(values.weights)
        self._put_state(values.state)
        if self._held.stacked:
            self._slots = self._convert["slots", "held"](
                transfers.put_sharded(values.slots, self._public_shardings["slots"]))
        else:
            self._slots = transfers.put_sharded(values.slots, self._shardings["slots"])
        self._init_learning_rate(self._slots)

    def _forward(self) -> Callable[..., Any]:
        """The computed model's pure function, ``(batch, weights, state, rng) -> (loss,
        new_state)``; with ``remat``, `Serial.forward_with_state` with its layers grouped
        under ``jax.checkpoint``."""
        if self._remat is None:
            return self._computed.pure_fn
        return functools.partial(self._computed.forward_with_state, remat=self._remat)

    def _make_update(self):
        model, optimizer, placement = self._computed, self._optimizer, self.placement
        forward = self._forward()
        shardings = self._shardings
        specs = jax.tree.map(lambda s: s.spec, shardings["weights"])
        axes, dev = placement.device_axes, placement.device_spec

        def gradients(batch, weights, state, rng):
            context = placement.sequence_context(batch)
            batch, state = jax.tree.map(lambda a: a[0], (batch, state))
            rng = jax.random.wrap_key_data(rng[0])
            share = loss_share(device_weight_total(batch[2] if len(batch) >= 3 else None,
                                                   axes), axes)

            def loss_fn(w):
                loss, new_state = forward(batch, w, state, rng)
                check_scalar_loss(model, loss)
                return share * loss.astype(jnp.float32), (loss, new_state)

            full = gather_weights(weights, specs, placement)
            with context:
                (_, (loss, new_state)), grads = jax.value_and_grad(loss_fn,
                                                                   has_aux=True)(full)
            grads = reduce_gradients(grads, specs, placement)
            new_state = jax.tree.map(lambda a: a[None], new_state)
            return grads, global_loss(share, loss, axes), new_state

        mapped = jax.shard_map(gradients, mesh=self.mesh,
                               in_specs=(dev, specs, dev, dev),
                               out_specs=(specs, REP, dev))

        def update(batch, weights, state, rng, slots, lr):
            grads, loss, new_state = mapped(batch, weights, state, rng)
            new_weights, new_slots = apply_optimizer(optimizer, grads, weights, slots, lr)
            new_weights = jax.lax.with_sharding_constraint(new_weights, shardings["weights"])
            new_slots = jax.lax.with_sharding_constraint(new_slots, shardings["slots"])
            stats = {"loss": loss, "gradients_l2": optax.tree.norm(grads),
                     "weights_l2": optax.tree.norm(new_weights)}
            if lr is not None:
                stats["learning_rate"] = jnp.asarray(lr, jnp.float32)
            return new_weights, new_state, new_slots, stats

        counted = eqx.debug.assert_max_traces(update, max_traces=None)
        return jax.jit(counted, donate_argnames=("weights", "state", "slots")), counted

    @classmethod
    def from_model(cls, model: Layer, loss_layer: Layer, optimizer_fn: OptimizerFn,
                   **options: Any) -> Trainer:
        """A trainer of an initialised ``model`` followed by ``loss_layer``: the whole
        flat model, ``Serial(*flat_layers)`` with its LM head fused into the loss
        (`revtrain.layers.fuse_loss_heads`), and ``options`` as the constructor's
        keyword arguments (``n_devices``, ``mesh``, ``fsdp``, ``placement``, ...).

        Every trainer has this class method (`revtrain.trainers.common.protocols.Trainer`),
        so `revtrain.training.build_trainer` builds any of them the same way.
        """
        blocks, loss = extract_reversible_blocks([model, loss_layer])
        return cls(fuse_loss_heads(Serial(*blocks_to_layers(blocks, loss))), optimizer_fn,
                   **options)

    def one_step(self, batch: Any, rng: jax.Array, step: int = 0,
                 learning_rate: float | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Runs one training step and updates the model's weights, state and slots.

        Args:
          batch: tuple of arrays ``(inputs, targets, weights)``, each ``[batch, ...]`` with
            ``batch`` divisible by ``n_devices``.
          rng: a ``jax.random.key``, split by device (then by layer inside `Serial`).
          step: the global step (informational; schedules live in the training loop).
          learning_rate: sets the optimizer's learning rate for this and later steps.

        Returns:
          ``(loss, stats)``: the float32 scalar loss, the weighted mean over the global
          batch; stats ``loss``, ``gradients_l2`` (L2 norm of the global gradient),
          ``weights_l2`` and ``learning_rate``.

        Raises:
          ValueError: for a batch not divisible by ``n_devices`` or a learning rate the
            optimizer cannot take; the trainer's weights are unchanged then.
        """
        del step
        lr = self._learning_rate_arg(learning_rate)
        sharded = self._shard_batch(batch)
        args = (sharded, self._weights, self._state, self._keys(rng), self._slots,
                self._placed_learning_rate(lr))
        self._dispatcher.phase("step_start")
        self._weights, self._state, self._slots, stats = self._dispatcher.dispatch(
            "train_step", self._update, *args)
        if learning_rate is not None:
            self.learning_rate = float(learning_rate)
        self._dispatcher.phase("step_end")
        return stats["loss"], dict(stats)

    # ----------------------------------------------------------------------------------
    # The training values.

    def host_values(self, part: str) -> Any:
        """``model_with_loss``'s weights or (device 0's) state tree, or the one optimizer
        state of the whole model. With several processes and ``fsdp=True`` every process
        must call this (the shards of other processes are gathered)."""
        if part == "state":
            return transfers.first_device_slice(self._state)
        values = {"weights": self._weights, "slots": self._slots}[part]
        held = jax.tree.map(transfers.host_value, values)
        return (self._held.public_weights(held) if part == "weights"
                else self._held.public_slots(held))

    def saved_values(self, part: str) -> Any:
        """Weights and slots as the sharded (or replicated) ``jax.Array`` s they are (with
        stacked runs, per-layer device copies: the values are on the devices twice while
        they live, as a block trainer's `revtrain.trainers.block.stacked.Unstacker` gives);
        the state as device 0's host copy."""
        if part == "state":
            return self.host_values(part)
        values = {"weights": self._weights, "slots": self._slots}[part]
        if not self._held.stacked:
            return values
        return self._convert[part, "public"](values)

    def value_shardings(self, part: str) -> Any:
        if part == "state":
            return super().value_shardings(part)
        return self._public_shardings[part]

    def restore(self, train_state: TrainState) -> None:
        self._put(self._checked(train_state))

    def device_footprint(self) -> DeviceFootprint:
        """Bytes of weights and slots on the mesh's first device of this process (sharded
        leaves count their shard)."""
        device = self.placement.first_local_device
        return DeviceFootprint(transfers.device_bytes(self._weights, device),
                               transfers.device_bytes(self._slots, device),
                               len(self._model.sublayers) or 1)

    def block_until_ready(self) -> None:
        transfers.block_until_ready_live((self._weights, self._state, self._slots))

    def trace_counts(self) -> dict[str, int]:
        return {"train_step": eqx.debug.get_num_traces(self._counted)}

    def _own_layers(self) -> list[Layer]:
        return [self._model]

    def _per_layer(self, tree: Any) -> list[Any]:
        return [tree]
