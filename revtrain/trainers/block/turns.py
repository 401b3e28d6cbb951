"""Keeping the layers of a scan body apart: each layer's work in its own turn.

A scan body that holds several layers (`revtrain.trainers.block.scan_programs`) gives XLA
room to mix them, and two things it then does cost memory that grows with what the body
holds:

* it schedules work of a later layer that does not wait for the earlier one -- its
  random draws (dropout masks, LSH rotations) -- beside the earlier layer's work, so both
  layers' temporaries are live at once;
* it fuses a layer's slot update into the write of its weights, which then re-reads the
  stacked slots that their own in-place write overwrites, and protects that read by
  copying every stacked buffer of the run on every iteration.

`in_turn` stops both by computing a function inside a conditional: its branches are
computations of their own (nothing is fused into or hoisted out of them). The price is
the conditional's outputs, which are new buffers: a layer's reverse inside one copies
the four stack items it returns (the two streams and their cotangents: at 65,536 tokens
and ``d_model`` 128, 128 MiB). So the optimizer update always runs in turn (its outputs
are one layer's weights and slots), and a layer's reverse does only where what XLA could
schedule early -- the bytes of its random draws, `random_draw_bytes` -- outweighs the
stack items it would copy (`reverse_in_turn`): a dropout model of short sequences keeps
its masks apart, a long sequence keeps its streams uncopied.
(`jax.lax.optimization_barrier` does neither on CPU: it is removed before fusion.)

Results: on one device the scanned reverse gives bitwise the per-layer programs' values
whichever layers run in turn; with FSDP, a reverse outside a conditional lets XLA fuse
the gathered weights' use otherwise, so the two agree to float rounding (as the
trainers' invariance tests require).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# The primitives whose outputs are random bits (typed keys lower to ``random_bits``, raw
# uint32 keys to ``threefry2x32``).
RANDOM_PRIMITIVES = frozenset({"random_bits", "threefry2x32"})
# What a draw's bytes grow to before they are used (`revtrain.layers.dropout_masks` unpacks
# 16-bit draws into 32-bit words).
MASK_GROWTH = 2


def in_turn(fn: Callable, t: jax.Array, *operands: Any) -> Any:
    """``fn(*operands)``, computed inside a conditional whose other branch (zeros of the
    same types) never runs: ``t`` is a scan step, never negative (module docstring)."""
    def zeros(*args):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args))
    return jax.lax.cond(t >= 0, fn, zeros, *operands)


def _sub_jaxprs(value: Any) -> list[Any]:
    if hasattr(value, "eqns"):  # A Jaxpr.
        return [value]
    if hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):  # A ClosedJaxpr.
        return [value.jaxpr]
    if isinstance(value, tuple | list):
        return [j for v in value for j in _sub_jaxprs(v)]
    return []


def _draw_bytes(jaxpr: Any) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in RANDOM_PRIMITIVES:
            total += sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.outvars)
        for value in eqn.params.values():
            total += sum(_draw_bytes(sub) for sub in _sub_jaxprs(value))
    return total


def random_draw_bytes(fn: Callable, *args: Any) -> int:
    """The bytes of random bits ``fn(*args)`` draws, each draw counted once (a draw inside
    a loop is one iteration's), per device inside a ``shard_map``. Traces ``fn`` (args may
    be tracers or `jax.ShapeDtypeStruct` s); compiles nothing."""
    return _draw_bytes(jax.make_jaxpr(fn)(*args).jaxpr)


def reverse_in_turn(fn: Callable, carry: Any, n_devices: int, *args: Any) -> bool:
    """Whether a layer's reverse ``fn(*args)`` runs in turn: what its random draws (per
    device) become outweighs the ``carry`` it returns (global arrays over ``n_devices``),
    which a conditional would copy. A draw counts twice (`MASK_GROWTH`): dropout unpacks
    its 16-bit draws into 32-bit words before comparing them."""
    carry_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(carry))
    return MASK_GROWTH * random_draw_bytes(fn, *args) >= carry_bytes // max(n_devices, 1)


__all__ = ["MASK_GROWTH", "RANDOM_PRIMITIVES", "in_turn", "random_draw_bytes", "reverse_in_turn"]
