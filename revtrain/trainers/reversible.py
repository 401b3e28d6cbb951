"""`ReversibleSerialTrainer`: block-wise training with per-layer optimizers and fbo functions.

Activation memory does not grow with depth: the forward pass keeps only each block's input
stack and the layers' states; the backward pass reconstructs every reversible layer's input
from its output (RevNet, Gomez et al. 2017; Reformer, Kitaev et al. 2020) and updates each
layer with its own fused forward-backward-optimizer function as soon as its gradient is
known (Trax's ``ReversibleSerialTrainer`` design).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from revtrain.layers.base import Layer, inputs_from_stack, outputs_onto_stack
from revtrain.layers.blocks import blocks_to_layers
from revtrain.layers.reversible import ReversibleLayer
from revtrain.trainers import devices
from revtrain.trainers.base import OptimizerFn, TrainerBase, stats_with_learning_rate
from revtrain.trainers.fbo import FnCache

Block = tuple[Layer, Sequence[ReversibleLayer]]


def _as_items(stack: Any) -> tuple:
    return tuple(stack) if isinstance(stack, tuple) else (stack,)


class ReversibleSerialTrainer(TrainerBase):
    """Trains ``blocks`` then ``loss_layer`` layer by layer, reversing reversible layers.

    The model is the flat layer list ``[std_0, *rev_0, std_1, *rev_1, ..., loss_layer]``
    (see `revtrain.layers.blocks_to_layers`); layer ``i`` gets the rng
    ``split(split(rng, n_devices)[d], n_layers)[i]`` on device ``d`` (``split(rng,
    n_layers)[i]`` for one device), exactly what ``Serial(*layers)`` does with the device
    key, so this trainer and `Trainer` on ``Serial(*layers)`` agree, dropout included.

    One step: (1) forward through each block, keeping only the block's input stack and the
    layers' old/new states; (2) the loss layer's fbo; (3) backward through the blocks in
    reverse: each reversible layer's reverse-and-fbo reconstructs its input from its output,
    each standard layer's fbo recomputes it from the stored block input. Each layer has its
    own optimizer state (``optimizer_fn()`` is called once per layer). Compiled functions
    are shared between layers with equal `Layer.structure_key` and use the transformation
    of the first such layer: ``optimizer_fn`` must return equivalent transformations on
    every call.

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
      n_devices: devices to use (default: all local devices).
      free_accelerators_on_step: delete this trainer's transient device buffers (the
        batch, block inputs, final activations and cotangents) at the end of each step;
        the batch is then copied through host memory, so a caller's arrays are never
        deleted.

    Raises:
      TypeError: for a block member that is not a `ReversibleLayer`.
      ValueError: for uninitialised layers or an impossible ``n_devices``.
    """

    def __init__(self, blocks: Sequence[Block], loss_layer: Layer, optimizer_fn: OptimizerFn,
                 n_devices: int | None = None, free_accelerators_on_step: bool = False):
        self._blocks = [(std, list(revs)) for std, revs in blocks]
        for _std, revs in self._blocks:
            for layer in revs:
                if not isinstance(layer, ReversibleLayer):
                    raise TypeError(f"block member {layer.name} (created at {layer.caller}) "
                                    f"is not a ReversibleLayer; put it in the block's "
                                    f"standard layer")
        self._loss_layer = loss_layer
        self.layers = blocks_to_layers(self._blocks, loss_layer)
        super().__init__(self.layers, optimizer_fn, n_devices)
        self.free_accelerators_on_step = free_accelerators_on_step
        self._copy_batch = free_accelerators_on_step
        optimizers = [optimizer_fn() for _ in self.layers]
        self._fns = FnCache(self.mesh, optimizers[0])
        weights = [layer.weights for layer in self.layers]
        states = [layer.state for layer in self.layers]
        slots = [opt.init(w) for opt, w in zip(optimizers, weights, strict=True)]
        self._init_learning_rate(slots[-1])
        self._store_initial(weights, states, slots)
        self._block_indices = self._index_blocks()

    def _index_blocks(self) -> list[tuple[int, list[int]]]:
        indices, i = [], 0
        for _, revs in self._blocks:
            indices.append((i, list(range(i + 1, i + 1 + len(revs)))))
            i += 1 + len(revs)
        return indices

    # ----------------------------------------------------------------------------------
    # Where values live: on the devices here; `MemoryEfficientTrainer` overrides these.

    def _store_initial(self, weights: list, states: list, slots: list) -> None:
        self._weights = [devices.replicate(w, self.mesh) for w in weights]
        self._slots = [devices.replicate(s, self.mesh) for s in slots]
        self._states = [self._per_device_state(s) for s in states]

    def _per_device_state(self, state: Any) -> Any:
        return devices.shard_per_device(devices.for_n_devices(state, self.n_devices),
                                        self.mesh)

    def _device_weights_and_slots(self, i: int) -> tuple[Any, Any]:
        return self._weights[i], self._slots[i]

    def _keep_weights_and_slots(self, i: int, weights: Any, slots: Any) -> None:
        self._weights[i], self._slots[i] = weights, slots

    def _device_state(self, state: Any) -> Any:
        return state

    def _keep_state(self, state: Any) -> Any:
        return state

    def _keep_stack(self, stack: Any) -> Any:
        return stack

    def _device_stack(self, kept: Any) -> Any:
        return kept

    def _begin_step(self, schedule: list[int]) -> None:
        del schedule

    def _before_layer(self, position: int) -> None:
        del position

    def _end_forward(self, stack: Any) -> Any:
        return stack

    def _end_step(self) -> None:
        pass

    def _host_weights(self, i: int) -> Any:
        return devices.unreplicate(self._weights[i])

    def _host_slots(self, i: int) -> Any:
        return devices.unreplicate(self._slots[i])

    def _host_state(self, i: int) -> Any:
        return devices.first_device_slice(self._states[i])

    # ----------------------------------------------------------------------------------
    # One step.

    def one_step(self, batch: Any, rng: jax.Array, step: int = 0,
                 learning_rate: float | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Runs one training step block by block; same contract as `Trainer.one_step`.

        Returns:
          ``(loss, stats)``: the float32 scalar loss, the weighted mean over the global
          batch (as `Trainer`: independent of the device count); stats ``loss``,
          ``learning_rate`` and ``layer{i}/gradients_l2`` (of the global gradient),
          ``layer{i}/weights_l2`` for every flat layer ``i``.

        Raises:
          ValueError: for a batch not divisible by ``n_devices``, a learning rate the
            optimizer cannot take, or a stack that does not match the loss layer's inputs;
            the weights are unchanged after any of these.
        """
        del step
        lr = self._learning_rate_arg(learning_rate)
        stack = self._shard_batch(batch)
        weight_totals = self._weight_totals(batch)
        rngs = self._rng_data(rng, len(self.layers))
        n = len(self.layers)
        self._begin_step(list(range(n)) + list(range(n - 2, -1, -1)))
        self._record("step_start")
        stats: dict[str, Any] = {}
        new_states: list[Any] = [None] * n
        stack, kept_stacks = self._forward(stack, rngs, new_states)
        loss, ct_stack = self._loss(stack, weight_totals, rngs, lr, new_states, stats)
        self._backward(stack, ct_stack, kept_stacks, rngs, lr, new_states, stats)
        if self.free_accelerators_on_step:
            delete_arrays((stack, ct_stack, kept_stacks))
        self._states = new_states
        if learning_rate is not None:
            self.learning_rate = float(learning_rate)
        self._end_step()
        self._record("step_end")
        self._new_step()
        for i, layer in enumerate(self.layers):
            self._write_back(layer, i, lambda i=i: self._host_weights(i),
                             lambda i=i: self._host_state(i))
        stats = {"loss": loss, **stats}
        return loss, stats_with_learning_rate(stats, None if lr is None else np.float32(lr))

    def _rng(self, rngs: np.ndarray, i: int) -> jax.Array:
        return devices.shard_per_device(rngs[:, i], self.mesh)

    def _forward(self, stack: Any, rngs: np.ndarray, new_states: list) -> tuple[Any, list]:
        kept_stacks, position = [], 0
        for std_i, rev_is in self._block_indices:
            kept_stacks.append(self._keep_stack(stack))
            for i in [std_i] + rev_is:
                self._before_layer(position)
                position += 1
                layer = self.layers[i]
                fn = self._fns.get("forward", layer)
                w, _ = self._device_weights_and_slots(i)
                args = (inputs_from_stack(stack, layer.n_in), w,
                        self._device_state(self._states[i]), self._rng(rngs, i))
                self._record(f"forward/layer{i}", fn, args)
                y, new_state = fn(*args)
                new_states[i] = self._keep_state(new_state)
                stack = outputs_onto_stack(y, stack, layer.n_in)
        return self._end_forward(stack), kept_stacks

    def _loss(self, stack, weight_totals, rngs, lr, new_states,
              stats) -> tuple[jax.Array, Any]:
        i = len(self.layers) - 1
        layer = self.layers[i]
        stack = self._device_stack(stack)
        n_items = len(_as_items(stack))
        if n_items != layer.n_in:
            raise ValueError(f"the loss layer {layer.name} takes {layer.n_in} stack items but "
                             f"the model leaves {n_items}; make the loss layer consume the "
                             f"whole stack")
        self._before_layer(i)
        fn = self._fns.get("loss_fbo", layer)
        w, slots = self._device_weights_and_slots(i)
        args = (stack, w, self._device_state(self._states[i]), self._rng(rngs, i),
                weight_totals, slots, lr)
        self._record(f"loss/layer{i}", fn, args)
        loss, ct, new_w, new_slots, new_state, layer_stats = fn(*args)
        self._keep_weights_and_slots(i, new_w, new_slots)
        new_states[i] = self._keep_state(new_state)
        _add_layer_stats(stats, i, layer_stats)
        return loss, ct

    def _backward(self, stack, ct_stack, kept_stacks, rngs, lr, new_states, stats) -> None:
        position = len(self.layers)
        blocks = zip(reversed(self._block_indices), reversed(kept_stacks), strict=True)
        for (std_i, rev_is), kept in blocks:
            for i in reversed(rev_is):
                self._before_layer(position)
                position += 1
                stack, ct_stack = self._reverse_layer(i, stack, ct_stack, rngs, lr,
                                                      new_states, stats)
            self._before_layer(position)
            position += 1
            stack = self._device_stack(kept)
            ct_stack = self._std_layer_backward(std_i, stack, ct_stack, rngs, lr, stats)

    def _reverse_layer(self, i, stack, ct_stack, rngs, lr, new_states, stats):
        layer = self.layers[i]
        fn = self._fns.get("reverse_and_fbo", layer)
        w, slots = self._device_weights_and_slots(i)
        args = (inputs_from_stack(stack, layer.n_out), inputs_from_stack(ct_stack, layer.n_out),
                w, self._device_state(self._states[i]), self._device_state(new_states[i]),
                self._rng(rngs, i), slots, lr)
        self._record(f"backward/layer{i}", fn, args)
        x, ct_x, new_w, new_slots, layer_stats = fn(*args)
        self._keep_weights_and_slots(i, new_w, new_slots)
        _add_layer_stats(stats, i, layer_stats)
        return (outputs_onto_stack(x, stack, layer.n_out),
                outputs_onto_stack(ct_x, ct_stack, layer.n_out))

    def _std_layer_backward(self, i, stack, ct_stack, rngs, lr, stats):
        layer = self.layers[i]
        fn = self._fns.get("fbo", layer)
        w, slots = self._device_weights_and_slots(i)
        args = (inputs_from_stack(stack, layer.n_in), w, self._device_state(self._states[i]),
                self._rng(rngs, i), inputs_from_stack(ct_stack, layer.n_out), slots, lr)
        self._record(f"backward/layer{i}", fn, args)
        ct_x, new_w, new_slots, layer_stats = fn(*args)
        self._keep_weights_and_slots(i, new_w, new_slots)
        _add_layer_stats(stats, i, layer_stats)
        return outputs_onto_stack(ct_x, ct_stack, layer.n_out)

    # ----------------------------------------------------------------------------------
    # Weights, state and slots as host values: one entry per flat layer.

    @property
    def weights(self) -> tuple:
        """Host copies of every flat layer's weights (``Serial(*layers).weights``)."""
        return tuple(self._host_weights(i) for i in range(len(self.layers)))

    @weights.setter
    def weights(self, weights: Sequence[Any]) -> None:
        devices.check_same_structure(tuple(weights), self.weights, "weights")
        self._store_initial(list(weights), [self._host_state(i) for i in
                                            range(len(self.layers))], list(self.slots))
        for layer, w in zip(self.layers, weights, strict=True):
            layer.weights = w

    @property
    def state(self) -> tuple:
        """Host copies of device 0's state of every flat layer."""
        return tuple(self._host_state(i) for i in range(len(self.layers)))

    @state.setter
    def state(self, state: Sequence[Any]) -> None:
        devices.check_same_structure(tuple(state), self.state, "state")
        self._store_initial(list(self.weights), list(state), list(self.slots))
        for layer, s in zip(self.layers, state, strict=True):
            layer.state = s

    @property
    def slots(self) -> tuple:
        """Host copies of every flat layer's optimizer state."""
        return tuple(self._host_slots(i) for i in range(len(self.layers)))

    @slots.setter
    def slots(self, slots: Sequence[Any]) -> None:
        devices.check_same_structure(tuple(slots), self.slots, "slots")
        self._store_initial(list(self.weights), list(self.state), list(slots))
        self._init_learning_rate(slots[-1])


def delete_arrays(tree: Any) -> None:
    """Frees the device buffers of the jax arrays in ``tree`` (trainer-owned ones only)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def _add_layer_stats(stats: dict, i: int, layer_stats: dict) -> None:
    for name, value in layer_stats.items():
        stats[f"layer{i}/{name}"] = value
