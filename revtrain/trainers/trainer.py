"""`Trainer`: the plain data-parallel trainer (whole model and its activations on device)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from revtrain.layers.base import Layer
from revtrain.trainers import devices
from revtrain.trainers.base import OptimizerFn, TrainerBase
from revtrain.trainers.fbo import (
    DEV,
    REP,
    apply_optimizer,
    check_scalar_loss,
    combine_gradients,
    global_loss,
    loss_share,
    varying,
)
from revtrain.trainers.protocols import DeviceFootprint, TrainState


class Trainer(TrainerBase):
    """Data-parallel training of a model that ends in its loss, one jitted update per step.

    The whole model runs under ``jax.grad`` (all activations of a step are stored), inside
    ``jax.shard_map`` over the ``batch`` mesh axis: each device gets ``batch // n_devices``
    examples and its own rng (``split(rng, n_devices)[d]``; the rng itself for one device),
    and one optimizer update is applied to replicated weights. Weight and slot buffers are
    donated. This is the baseline the reversible trainers must agree with.

    Invariance: the loss is the weighted mean over the *global* batch, ``sum(w * loss) /
    sum(w)`` with ``w`` the batch's third item (each device's mean loss weighted by its
    share of the total weight, `revtrain.trainers.fbo.loss_share`), and the gradient is
    the sum over devices of the gradients of those shares -- so losses, gradients and
    updated weights do not depend on how many devices or processes the batch is split
    over (dropout aside: each device draws its own masks, as in Trax). Layer state (e.g.
    BatchNorm statistics) is per device, as in Trax: each device's state is computed from
    its own rows (so batch statistics *do* depend on the split), and `state` and the layer
    objects show device 0's.

    Args:
      model_with_loss: an initialised layer mapping the batch ``(inputs, targets, weights)``
        to a scalar loss, e.g. ``Serial(model, CrossEntropyLoss())``.
      optimizer_fn: returns an optax ``GradientTransformation``; wrap it with
        ``optax.inject_hyperparams`` to set the learning rate per step.
      n_devices: devices to use (default: all local devices).

    Raises:
      ValueError: for an uninitialised model or an impossible ``n_devices``.
    """

    def __init__(self, model_with_loss: Layer, optimizer_fn: OptimizerFn,
                 n_devices: int | None = None):
        super().__init__([model_with_loss], optimizer_fn, n_devices)
        self._model = model_with_loss
        self._optimizer = optimizer_fn()
        weights = model_with_loss.weights
        initial = TrainState(weights, model_with_loss.state, self._optimizer.init(weights))
        self._remember_signature(initial)
        self._put(initial)
        self._update, self._counted = self._make_update()

    def _put(self, values: TrainState) -> None:
        self._weights = devices.replicate(values.weights, self.mesh)
        self._state = devices.shard_per_device(
            devices.for_n_devices(values.state, self.n_devices), self.mesh)
        self._slots = devices.replicate(values.slots, self.mesh)
        self._init_learning_rate(values.slots)

    def _make_update(self):
        model, optimizer = self._model, self._optimizer

        def body(batch, weights, state, rng, weight_total, slots, lr):
            batch, state = jax.tree.map(lambda a: a[0], (batch, state))
            rng = jax.random.wrap_key_data(rng[0])
            share = loss_share(weight_total[0])

            def loss_fn(w):
                loss, new_state = model.pure_fn(batch, w, state, rng)
                check_scalar_loss(model, loss)
                return share * loss.astype(jnp.float32), (loss, new_state)

            (_, (loss, new_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                varying(weights))
            grads = combine_gradients(grads)
            new_weights, new_slots = apply_optimizer(optimizer, grads, weights, slots, lr)
            stats = {"loss": global_loss(share, loss),
                     "gradients_l2": optax.tree.norm(grads),
                     "weights_l2": optax.tree.norm(new_weights)}
            if lr is not None:
                stats["learning_rate"] = jnp.asarray(lr, jnp.float32)
            new_state = jax.tree.map(lambda a: a[None], new_state)
            return new_weights, new_state, new_slots, stats

        counted = eqx.debug.assert_max_traces(body, max_traces=None)
        mapped = jax.shard_map(counted, mesh=self.mesh,
                               in_specs=(DEV, REP, DEV, DEV, DEV, REP, REP),
                               out_specs=(REP, DEV, REP, REP))

        def update(batch, weights, state, rng, weight_total, slots, lr):
            return mapped(batch, weights, state, rng, weight_total, slots, lr)
        return jax.jit(update, donate_argnames=("weights", "state", "slots")), counted

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
        totals = self._weight_totals(batch)
        rng_data = self._rng_data(rng)
        args = (sharded, self._weights, self._state, rng_data, totals, self._slots, lr)
        self._notify_phase("step_start")
        if self.observers:
            self._notify_dispatch("train_step", self._update, args)
        self._weights, self._state, self._slots, stats = self._update(*args)
        if learning_rate is not None:
            self.learning_rate = float(learning_rate)
        self._notify_phase("step_end")
        return stats["loss"], dict(stats)

    # ----------------------------------------------------------------------------------
    # The training values.

    def host_values(self, part: str) -> Any:
        """``model_with_loss``'s weights or (device 0's) state tree, or the one optimizer
        state of the whole model."""
        if part == "state":
            return devices.first_device_slice(self._state)
        return devices.unreplicate({"weights": self._weights, "slots": self._slots}[part])

    def restore(self, train_state: TrainState) -> None:
        self._put(self._checked(train_state))

    def device_footprint(self) -> DeviceFootprint:
        device = self.mesh.devices.flat[0]
        return DeviceFootprint(_device_bytes(self._weights, device),
                               _device_bytes(self._slots, device),
                               len(self._model.sublayers) or 1)

    def block_until_ready(self) -> None:
        values = jax.tree.leaves((self._weights, self._state, self._slots))
        # A failed step may have donated some: there is nothing to wait for in those.
        jax.block_until_ready([a for a in values if not a.is_deleted()])

    def trace_counts(self) -> dict[str, int]:
        return {"train_step": eqx.debug.get_num_traces(self._counted)}

    def _own_layers(self) -> list[Layer]:
        return [self._model]

    def _per_layer(self, tree: Any) -> list[Any]:
        return [tree]


def _device_bytes(tree: Any, device: jax.Device) -> int:
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree)
               for s in leaf.addressable_shards if s.device == device)
