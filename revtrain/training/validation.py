"""Checks that a run is valid before anything is written: arguments, data, devices.

``train`` range-checks its numeric arguments and those of its run configuration
(`check_arguments`, called by the dataclasses of `revtrain.training.config`) before it takes
the output directory, and the `Loop` checks the first train batch against the model
(`check_first_batch`) and the devices (`check_batch_divides`) before it creates a
checkpoint directory or a metrics file. Each error is one line naming the value, the limit
and the gin binding to change, e.g. ``train.steps=-5 must be >= 1; change the binding
train.steps``. Without these checks such runs ran: ``steps=-5`` exited 0 after writing
checkpoint 0, and token ids >= ``vocab_size`` surfaced as a NaN loss.

A model may declare what it accepts with public attributes, as the model functions of
`revtrain.models` do: ``vocab_size`` (token ids of the inputs and targets are in ``[0,
vocab_size)``), ``max_len`` (longest sequence) and ``n_classes`` (class ids of the targets).
The binding named in an error is ``<model.name>.<attribute>``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from revtrain.batch_checks import check_divisible
from revtrain.training.schedules import check_schedule

# Numeric and switch arguments by gin name: (kind, smallest allowed value, None allowed);
# a "bool" is True or False (a 0 or 1 is refused: it is a typo for another field's value).
_RANGES: dict[str, dict[str, tuple[str, float, bool]]] = {
    "train": {"steps": ("int", 1, False)},
    "RunConfig": {"seed": ("int", 0, False), "n_devices": ("int", 1, True),
                  "fsdp": ("bool", 0, False), "accumulate_steps": ("int", 1, False)},
    "EvalConfig": {"every": ("int", 0, False), "steps": ("int", 0, True),
                   "eval_train": ("bool", 0, False)},
    "CheckpointConfig": {
        "every": ("int", 0, False),
        "max_to_keep": ("int", 1, True),
        "keep_period": ("int", 1, True),
        "keep_time_interval": ("float", math.ulp(0.0), True),
        "restore_step": ("int", 0, True),
        "init_weights_only": ("bool", 0, False),
        "async_save": ("bool", 0, False),
    },
    "LogConfig": {"every": ("int", 1, True), "progress": ("bool", 0, True)},
}


def _fail(binding: str, value: Any, rule: str) -> None:
    raise ValueError(f"{binding}={value!r} {rule}; change the gin binding {binding}")


def check_arguments(arguments: Mapping[str, Any], prefix: str = "train") -> None:
    """Range-checks the numeric arguments of ``prefix`` (those present in ``arguments``).

    ``prefix`` is a gin name: ``train`` (``steps >= 1``), ``RunConfig`` (``seed >= 0``,
    ``accumulate_steps >= 1``,
    ``n_devices >= 1`` or None and at most the local device count, a float ``schedule``
    finite and > 0, a schedule function finite and >= 0 at its first steps and not all
    0 there: `revtrain.training.schedules.check_schedule`), ``EvalConfig`` (``every >=
    0``, ``steps >= 0`` or None),
    ``CheckpointConfig`` (``every >= 0``; ``max_to_keep``, ``keep_period >= 1`` or None;
    ``keep_time_interval > 0`` seconds or None) or ``LogConfig`` (``every >= 1`` or None).
    Their switches (``RunConfig.fsdp``, ``EvalConfig.eval_train``,
    ``CheckpointConfig.init_weights_only`` and ``async_save``, ``LogConfig.progress``) must
    be True or False (``progress`` also None).

    Raises:
      ValueError: naming the first bad argument as ``<prefix>.<name>=<value>``, its limit
        and the binding to change.
    """
    for name, (kind, low, optional) in _RANGES.get(prefix, {}).items():
        if name not in arguments or (optional and arguments[name] is None):
            continue
        value, binding = arguments[name], f"{prefix}.{name}"
        if kind == "bool":
            if not isinstance(value, (bool, np.bool_)):
                _fail(binding, value, "must be True or False" + (" or None" if optional
                                                                  else ""))
            continue
        number = (int, np.integer) if kind == "int" else (int, float, np.number)
        if isinstance(value, bool) or not isinstance(value, number):
            _fail(binding, value, f"must be {'an integer' if kind == 'int' else 'a number'}"
                  + (" or None" if optional else ""))
        if not math.isfinite(value) or value < low:
            limit = f">= {low}" if kind == "int" else "> 0"
            _fail(binding, value, f"must be {limit}" + (" or None" if optional else ""))
    n_devices = arguments.get("n_devices")
    if prefix == "RunConfig" and n_devices is not None and n_devices > jax.local_device_count():
        _fail(f"{prefix}.n_devices", n_devices,
              f"is more than the {jax.local_device_count()} local devices")
    rate = arguments.get("schedule")
    if prefix == "RunConfig" and isinstance(rate, (int, float)) and not (
            math.isfinite(rate) and 0 < rate <= float(np.finfo(np.float32).max)):  # f32 rates
        _fail(f"{prefix}.schedule", rate, "must be a finite number > 0")
    if prefix == "RunConfig" and callable(rate):  # Its first rates, before anything runs.
        check_schedule(rate, f"{prefix}.schedule")


def _name(data: Any) -> str:
    return type(data).__name__


def check_first_batch(batch: Any, model: Any, data: Any) -> None:
    """Checks a train batch fits ``model`` before the model is initialised from it.

    Structure: a tuple ``(inputs, targets, weights)`` of arrays, ``weights`` the shape of
    ``targets`` and of a float dtype, all with the same leading (batch) axis. With
    ``model.vocab_size``: ``inputs`` are integer ``[batch, length]`` token ids in ``[0,
    vocab_size)``; with ``model.max_len``: ``length <= max_len``; targets are integer ids
    below ``model.vocab_size`` (or ``model.n_classes``).

    Args:
      batch: the first batch of ``data.train_stream()``.
      model: the model layer (its ``name`` and the attributes above are read).
      data: the `Inputs` the batch came from (named in errors; its ``vocab_size`` is
        suggested as the model's).

    Raises:
      ValueError: one line naming the value, the model's limit and the binding to change.
    """
    where = f"the first train batch of {_name(data)}"
    if not isinstance(batch, (tuple, list)) or len(batch) != 3:
        size = f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""
        raise ValueError(f"{where} is a {type(batch).__name__}{size}; a batch must be a tuple "
                         f"(inputs, targets, weights) of 3 arrays (see revtrain.data.Inputs)")
    arrays = [np.asarray(x) for x in batch]
    for part, array, given in zip(("inputs", "targets", "weights"), arrays, batch,
                                  strict=True):
        if array.dtype == object or array.ndim == 0:
            raise ValueError(f"{where}: {part} is not an array with a batch axis (got "
                             f"{type(given).__name__})")
    inputs, targets, weights = arrays
    if weights.shape != targets.shape or inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"{where}: shapes inputs {inputs.shape}, targets {targets.shape}, "
                         f"weights {weights.shape}; weights must have the targets' shape "
                         f"and all the same batch axis")
    if not np.issubdtype(weights.dtype, np.floating):
        raise ValueError(f"{where}: weights are {weights.dtype}; the loss mask must be a "
                         f"float array")
    _check_tokens(inputs, targets, model, data, where)


def check_vocab_size(model: Any, data: Any) -> None:
    """Checks the model's ``vocab_size`` holds every id of the data's tokenizer.

    The first batch may hold only small ids (ids past the model's vocabulary then surface
    later, as a crash or a NaN); the tokenizer says how many there can be.

    Args:
      model: the model layer (its ``name`` and ``vocab_size`` are read).
      data: the `Inputs`; its ``tokenizer`` (None for data without one) is read.

    Raises:
      ValueError: one line naming ``<model.name>.vocab_size``, the tokenizer's size and
        the binding to change.
    """
    vocab_size, tokenizer = getattr(model, "vocab_size", None), getattr(data, "tokenizer", None)
    if vocab_size is None or tokenizer is None or vocab_size >= tokenizer.vocab_size:
        return
    binding = f"{getattr(model, 'name', 'model')}.vocab_size"
    raise ValueError(f"{binding}={vocab_size} is smaller than the vocabulary of "
                     f"the tokenizer of {_name(data)}, {tokenizer.describe()}; set {binding}="
                     f"{tokenizer.vocab_size} (or more)")


def _check_tokens(inputs: np.ndarray, targets: np.ndarray, model: Any, data: Any,
                  where: str) -> None:
    vocab_size, name = getattr(model, "vocab_size", None), getattr(model, "name", "model")
    if vocab_size is not None:
        if not np.issubdtype(inputs.dtype, np.integer) or inputs.ndim != 2:
            raise ValueError(f"{where}: inputs are {inputs.dtype}{list(inputs.shape)}; "
                             f"{name} takes integer token ids [batch, length]")
        _check_ids(inputs, "inputs", f"{name}.vocab_size", vocab_size, data, where)
        max_len = getattr(model, "max_len", None)
        if max_len is not None and inputs.shape[1] > max_len:
            raise ValueError(f"{where}: sequence length {inputs.shape[1]} exceeds "
                             f"{name}.max_len={max_len}; set {name}.max_len to at least "
                             f"{inputs.shape[1]} or use shorter sequences")
    n_classes, attribute = vocab_size, "vocab_size"
    if n_classes is None:
        n_classes, attribute = getattr(model, "n_classes", None), "n_classes"
    if n_classes is not None:
        if not np.issubdtype(targets.dtype, np.integer):
            raise ValueError(f"{where}: targets are {targets.dtype}; {name} needs integer "
                             f"ids in [0, {name}.{attribute}={n_classes})")
        _check_ids(targets, "targets", f"{name}.{attribute}", n_classes, data, where)


def _check_ids(ids: np.ndarray, part: str, binding: str, limit: int, data: Any,
               where: str) -> None:
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low >= 0 and high < limit:
        return
    bad = low if low < 0 else high
    suggestion = max(high + 1, getattr(data, "vocab_size", None) or 0)
    fix = ("ids must be >= 0" if low < 0 else
           f"set {binding}={suggestion} to fit {_name(data)}'s ids")
    raise ValueError(f"{where}: id {bad} in the {part} is outside [0, {limit}) of "
                     f"{binding}={limit}; {fix}")


def check_mesh_divides(signature: Any, mesh_shape: Mapping[str, int], data: Any) -> None:
    """Checks this process's batch splits over ``RunConfig.mesh_shape``: its rows over
    ``data x fsdp`` and, with ``seq > 1``, every item's length (axis 1) over ``seq``.

    Raises:
      ValueError: naming the numbers, ``RunConfig.mesh_shape`` and the binding to change.
    """
    sizes = {name: mesh_shape.get(name, 1) for name in ("data", "fsdp", "seq")}
    shards, seq = sizes["data"] * sizes["fsdp"], sizes["seq"]
    check_divisible(signature[0].shape[0] * jax.process_count(), shards,
                    what=f"{_name(data)}'s batch size", by="data x fsdp",
                    fix=f"set {_name(data)}.batch_size to a multiple of {shards} (or change "
                        f"RunConfig.mesh_shape={dict(mesh_shape)!r})")
    for item in signature:
        shape = tuple(item.shape)
        if seq > 1 and (len(shape) < 2 or shape[1] % seq):
            length = shape[1] if len(shape) >= 2 else "none"
            raise ValueError(f"{_name(data)}'s sequence length {length} (batch shape "
                             f"{shape}) is not divisible by seq={seq} of "
                             f"RunConfig.mesh_shape={dict(mesh_shape)!r}; use a length that "
                             f"is a multiple of {seq} or change RunConfig.mesh_shape")


def check_batch_divides(batch_size: int, n_devices: int | None, data: Any) -> None:
    """Checks a per-process batch of ``batch_size`` rows splits evenly over the devices.

    Args:
      batch_size: rows of this process's batch.
      n_devices: devices it is split over; None for all local devices.
      data: the `Inputs` (named in the error).

    Raises:
      ValueError: naming both numbers and the bindings to change.
    """
    n = jax.local_device_count() if n_devices is None else n_devices
    # Global rows over global devices: the same condition as per process.
    total = n * jax.process_count()
    check_divisible(batch_size * jax.process_count(), total,
                    what=f"{_name(data)}'s batch size",
                    fix=f"set {_name(data)}.batch_size to a multiple of {total} (or "
                        f"RunConfig.n_devices)")


def check_accumulation_divides(batch_size: int, accumulate_steps: int, row_shards: int,
                               data: Any) -> None:
    """Checks a per-process batch of ``batch_size`` rows splits into ``accumulate_steps``
    equal micro-batches that each split over the devices that hold distinct rows.

    Args:
      batch_size: rows of this process's batch.
      accumulate_steps: micro-batches per step (``RunConfig.accumulate_steps``).
      row_shards: this process's devices that hold distinct rows (``n_devices``, or
        ``data x fsdp`` of a mesh's devices in this process).
      data: the `Inputs` (named in the error).

    Raises:
      ValueError: one line naming the global batch size, ``accumulate_steps``, the
        devices, their product and the bindings to change.
    """
    parts = accumulate_steps * row_shards
    if batch_size % parts == 0:
        return
    processes = jax.process_count()
    rows, shards, total = batch_size * processes, row_shards * processes, parts * processes
    raise ValueError(f"{_name(data)}'s batch size {rows} does not split into "
                     f"RunConfig.accumulate_steps={accumulate_steps} micro-batches over "
                     f"{shards} devices: it must be a multiple of {accumulate_steps} x "
                     f"{shards} = {total}; set {_name(data)}.batch_size to a multiple of "
                     f"{total} or change RunConfig.accumulate_steps")
