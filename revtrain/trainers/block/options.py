"""`BlockOptions`: how a block trainer runs its step, as one value.

Everything a block trainer takes besides its layers, optimizer, store and placement: what
it frees, what it keeps, whether it clips by the global norm, and what it scans. The two
configurations (`revtrain.trainers.ReversibleSerialTrainer`,
`revtrain.trainers.MemoryEfficientTrainer`) take ``options=BlockOptions(...)`` or the same
fields as keyword arguments, a convenience that builds the value (`resolve_options`), as
``n_devices=``/``mesh=``/``fsdp=`` build a `revtrain.parallel.placement.Placement`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class BlockOptions:
    """The options of a block trainer's step; checked when built.

    Attributes:
      free_accelerators_on_step: delete the trainer's transient device buffers (the
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
        work doubles. The final activations are held through that pass (one stack).
        None (the default) does not clip.
      scan_layers: run each run of consecutive reversible layers of equal structure (the
        rule of `revtrain.layers.scan`: a `ReversibleTransformerLM`'s blocks) as one
        forward and one reverse-and-fbo program, each a ``lax.scan`` with every layer's
        own optimizer update inside, the run's values stacked in the store
        (`revtrain.trainers.block.scan_programs`): a step dispatches the same few programs
        at any depth. Results are those of ``scan_layers=False``, which runs one program
        per layer and op (for debugging and comparison).
      scan_window: with ``scan_layers``, cut each run into pieces of at most this many
        repetitions of its group, one program pair each
        (`revtrain.trainers.block.plan.windows`), so a store that puts a scanned run's
        values on the devices for its ops holds one window's; None scans whole runs.

    Raises:
      TypeError: for a non-bool ``scan_layers`` or ``free_accelerators_on_step``, a
        ``keep_every`` or ``scan_window`` that is not an int, or a ``clip_global_norm``
        that is not a number.
      ValueError: for ``keep_every < 1``, a ``clip_global_norm`` that is not finite and
        > 0, or ``scan_window < 2``.
    """

    free_accelerators_on_step: bool = False
    keep_every: int | None = None
    clip_global_norm: float | None = None
    scan_layers: bool = True
    scan_window: int | None = None

    def __post_init__(self):
        for name in ("scan_layers", "free_accelerators_on_step"):
            if not isinstance(getattr(self, name), bool | np.bool_):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False")
        keep, clip = self.keep_every, self.clip_global_norm
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int | np.integer)):
            raise TypeError(f"keep_every={keep!r} must be an int >= 1 or None")
        if keep is not None and keep < 1:
            raise ValueError(f"keep_every={keep} must be >= 1 or None")
        number = isinstance(clip, int | float | np.number) and not isinstance(clip, bool)
        if clip is not None and not number:
            raise TypeError(f"clip_global_norm={clip!r} must be a finite number > 0 or None")
        if clip is not None and not 0 < clip < np.inf:
            raise ValueError(f"clip_global_norm={clip} must be a finite number > 0 or None")
        window = self.scan_window
        if window is None:
            return
        if isinstance(window, bool) or not isinstance(window, int | np.integer):
            raise TypeError(f"scan_window={window!r} must be an int >= 2 or None")
        if window < 2:
            raise ValueError(f"scan_window={window} must be >= 2 repetitions per program "
                             f"(a scan needs two) or None")


def resolve_options(options: BlockOptions | None, defaults: BlockOptions,
                    **fields: Any) -> BlockOptions:
    """A trainer's `BlockOptions`: ``options`` itself, or ``defaults`` with the keyword
    ``fields`` the caller gave (those that differ from ``defaults``).

    Raises:
      ValueError: when ``options`` is given with a field that differs from ``defaults``.
      TypeError: for an ``options`` that is not a `BlockOptions`; as `BlockOptions`.
    """
    changed = {name: value for name, value in fields.items()
               if value is not getattr(defaults, name) and value != getattr(defaults, name)}
    if options is None:
        return dataclasses.replace(defaults, **changed)
    if changed:
        raise ValueError(f"options= was given with {', '.join(sorted(changed))}=; pass "
                         f"either a BlockOptions or those arguments")
    if not isinstance(options, BlockOptions):
        raise TypeError(f"options={options!r} is not a BlockOptions; build one with "
                        f"BlockOptions(keep_every=..., ...)")
    return options


__all__ = ["BlockOptions", "resolve_options"]
