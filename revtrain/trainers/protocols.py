"""The trainers' vocabulary: `TrainState`, `DeviceFootprint`, and the `ParamStore`, observer
and per-layer function protocols.

A trainer *owns* its training values, a `TrainState`; layer objects are updated only on
request (`TrainerBase.sync_to`, in the spirit of flax NNX ``update``). *Where* the values
of a block trainer live during a step -- replicated on the devices, in host memory with a
prefetch window, or (later) sharded over the mesh -- is a `ParamStore`; the trainer's step
is a schedule of ops built once (`revtrain.trainers.schedule`) that asks the store for
values and gives the new ones back. Observers watch dispatches and phases (benchmarks, the
memory ledger) without reading a trainer's private attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import jax

Weights = Any  # A pytree of arrays (``()`` for a layer without weights).
State = Any  # A pytree of arrays updated by the forward pass (``()`` for none).
Slots = Any  # An optax optimizer state.
Stack = Any  # One array or a tuple of arrays: the data stack (``[n_devices, ...]`` leaves).


class TrainState(NamedTuple):
    """All values a trainer trains: host (numpy) copies, owned by the trainer.

    For the block trainers each field is a tuple with one entry per flat layer
    (``blocks_to_layers(blocks, loss_layer)``), and ``slots[i]`` is layer ``i``'s own
    optimizer state. For `Trainer` ``weights`` and ``state`` are the trees of its
    ``model_with_loss`` (for ``Serial(*flat_layers)``, again one entry per flat layer) and
    ``slots`` is one optimizer state for the whole model. ``state`` is device 0's (layer
    state is per device, as in Trax). Checkpoints store exactly these three trees.
    """

    weights: Any
    state: Any
    slots: Any


class DeviceFootprint(NamedTuple):
    """Bytes of training values resident on *one* device (the mesh's first) right now.

    Attributes:
      weights_bytes: bytes of weight buffers on the device (a replicated leaf counts once
        per device; prefetched and not-yet-copied-back layers included).
      slots_bytes: bytes of optimizer-slot buffers on the device.
      resident_layers: number of flat layers with weights on the device.
      kept_bytes: bytes of the activation stacks the last step's forward pass kept on the
        device for its backward pass -- block inputs and the ``keep_every`` copies, all
        alive at once at the end of the forward pass (an array shared by several stacks,
        e.g. the batch's targets, counts once). 0 where they wait in host memory
        (`HostStore`) and for `Trainer`, whose activations live inside its compiled step.
        Not part of `total_bytes`.
    """

    weights_bytes: int
    slots_bytes: int
    resident_layers: int
    kept_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Weights plus slots bytes (``kept_bytes`` excluded)."""
        return self.weights_bytes + self.slots_bytes


class Observer(Protocol):
    """Watches a trainer (``trainer.observers.append(obs)``); both methods are optional.

    ``on_dispatch(label, fn, args)`` is called just before each compiled function runs
    (``label`` e.g. ``'forward/layer3'``; ``fn(*args)`` is the call about to happen);
    ``on_phase(label)`` at phase boundaries of a step: ``'step_start'``, ``'loss_start'``,
    ``'backward_start'``, ``'step_end'``. Observers must not change the arguments.
    """

    def on_dispatch(self, label: str, fn: Callable[..., Any], args: tuple) -> None: ...

    def on_phase(self, label: str) -> None: ...


class Params(NamedTuple):
    """A layer's weights and optimizer slots as one fbo argument (donated by name)."""

    weights: Weights
    slots: Slots


class ForwardFn(Protocol):
    """``(dev, weights, rep) -> (y, new_state)``, jitted over the ``batch`` mesh axis.

    ``dev`` holds per-device values with a leading device axis: ``x`` (the layer's
    inputs), ``state``, ``rngs`` (the step's ``[n_devices, n_layers, *key]`` key data);
    ``rep`` holds replicated values: ``index`` (int32, the flat layer index into
    ``rngs``). Outputs are per device.
    """

    def __call__(self, dev: Mapping[str, Any], weights: Weights,
                 rep: Mapping[str, Any]) -> tuple[Any, State]: ...


class FboFn(Protocol):
    """Standard layer: ``(dev, params, rep) -> (ct_x, new_params, stats)``.

    ``dev``: ``x`` (the stored input), ``state``, ``rngs``, ``ct_y``; ``params``: a
    `Params` (donated); ``rep``: ``index``, ``lr`` (float32 or None) and ``clip``
    (None, or float32 ``(global_norm, max_norm)``: the gradient is scaled as
    ``optax.clip_by_global_norm`` would scale the whole model's before the update).
    """

    def __call__(self, dev: Mapping[str, Any], params: Params,
                 rep: Mapping[str, Any]) -> tuple[Any, Params, dict]: ...


class ReverseFboFn(Protocol):
    """Reversible layer: ``(dev, params, rep) -> (x, ct_x, new_params, stats)``.

    ``dev``: ``y`` (the output, from which the input is reconstructed), ``ct_y``,
    ``state`` (old), ``new_state``, ``rngs``; ``params`` and ``rep`` as `FboFn`.
    """

    def __call__(self, dev: Mapping[str, Any], params: Params,
                 rep: Mapping[str, Any]) -> tuple[Any, Any, Params, dict]: ...


class LossFboFn(Protocol):
    """Loss layer: ``(dev, params, rep) -> (loss, ct_x, new_params, new_state, stats)``.

    ``dev``: ``x`` (the final stack), ``state``, ``rngs``, ``weight_total`` (each
    device's total batch weight); ``loss`` is the weighted mean over the global batch.
    """

    def __call__(self, dev: Mapping[str, Any], params: Params,
                 rep: Mapping[str, Any]) -> tuple[jax.Array, Any, Params, State, dict]: ...


class NormFn(Protocol):
    """The gradient-norm variant of `FboFn`, `ReverseFboFn` or `LossFboFn` (exact
    global-norm clipping): ``(dev, weights, rep) -> (*outputs, squared_norm)``.

    ``dev`` and ``rep`` as the fbo it varies; ``weights`` are not donated and nothing is
    updated. ``outputs`` are ``(ct_x,)`` for a standard or loss layer and ``(x, ct_x)`` for
    a reversible one; ``squared_norm`` is the float32 squared L2 norm of the layer's global
    (device-summed) weight gradient, replicated.
    """

    def __call__(self, dev: Mapping[str, Any], weights: Weights,
                 rep: Mapping[str, Any]) -> tuple[Any, ...]: ...


class ParamStore(Protocol):
    """Where a block trainer's weights, slots, states and kept activations live.

    The trainer drives one step as: ``begin_step()``; for each op of its schedule
    ``prepare(position)`` then the op, which reads ``weights(i)`` / ``params(i)`` /
    ``state(i)`` / ``new_state(i)`` and hands results back with ``keep_params(i, ...)``
    and ``keep_state(i, ...)``; a block's input stack is ``stash``-ed in the forward pass
    and ``unstash``-ed for its standard layer's fbo; ``end_forward(stack)`` lets the final
    activations leave the device; ``finish_step()`` makes the new states current and
    settles every transfer. Values given by ``params(i)`` are donated to the fbo and must
    not be used again, so a layer's update cannot be taken back: a step that raises before
    its first ``keep_params`` leaves every stored value as it was, one that raises later
    (in the backward pass) leaves the layers already updated with their new values, and
    ``restore`` (which must work whatever state a failed step left) undoes it.
    ``host_values(part)`` gives host copies of ``'weights'``, ``'state'`` or ``'slots'``,
    one entry per flat layer. ``saved_values(part)`` gives the same values as they live,
    without a host copy, for a sharded checkpoint: global ``jax.Array`` s in their own
    sharding (each process then writes only its shards), or host arrays where the store
    keeps values in host memory; ``value_shardings(part)`` gives, per leaf, the
    ``NamedSharding`` a checkpoint should be restored into (None for a host-held leaf), and
    ``restore`` accepts host arrays or ``jax.Array`` s in any sharding (resharding them).
    ``block_until_ready()`` waits until every value the store holds is computed and
    every transfer it started has landed, without copying anything that stays on the
    devices to the host.
    Implementations: `revtrain.trainers.stores.DeviceStore` (all on the
    devices) and `revtrain.trainers.stores.HostStore` (host memory, prefetch window).
    """

    def begin_step(self) -> None: ...

    def prepare(self, position: int) -> None: ...

    def weights(self, i: int) -> Weights: ...

    def params(self, i: int) -> Params: ...

    def keep_params(self, i: int, params: Params) -> None: ...

    def state(self, i: int) -> State: ...

    def new_state(self, i: int) -> State: ...

    def keep_state(self, i: int, new_state: State) -> None: ...

    def stash(self, stack: Stack) -> Any: ...

    def unstash(self, kept: Any) -> Stack: ...

    def end_forward(self, stack: Stack) -> Any: ...

    def finish_step(self) -> None: ...

    def block_until_ready(self) -> None: ...

    def host_values(self, part: str) -> tuple: ...

    def saved_values(self, part: str) -> tuple: ...

    def value_shardings(self, part: str) -> tuple: ...

    def restore(self, train_state: TrainState) -> None: ...

    def device_footprint(self) -> DeviceFootprint: ...
