"""Sequence parallelism: the length axis of activations sharded over the ``seq`` mesh axis.

The contract between a trainer and the layers:

1. **Layout.** Before sharding a batch, the trainer permutes every batch leaf's length axis
   (axis 1) on the host by ``perm = sequence_layout(n_shards, length)`` and then shards
   that axis *contiguously* over the ``seq`` mesh axis (`SEQ_AXIS`): shard ``s`` holds
   global positions ``perm[s * L / n:(s + 1) * L / n]``. The layout is *striped* (Brandon
   et al., 2023): global position ``p`` lives on shard ``p % n`` as local row ``p // n``,
   so local row ``r`` of shard ``s`` is position ``r * n + s``. Outputs come back in the
   same order (``np.argsort(perm)`` undoes it); losses, which are weighted means over
   positions, need no un-permuting.
2. **Tracing.** The trainer traces the program body inside ``shard_map`` (activations of
   local length ``length // n_shards``) within ``with sequence_sharded(axis_name,
   n_shards, length):``. Layers read `current` while tracing; nothing is read at run time,
   so a compiled program is specific to ``(axis_name, n_shards, length)`` and a program
   cache must be keyed by them. Outside the context (or with ``n_shards == 1``) every layer
   computes as it always did. Initialise layers and compute output signatures outside the
   context (no layer's weights or output shape depend on the split); under it, a layer
   that needs the shard index (attention, position tables, dropout) must be traced inside
   ``shard_map``.
3. **Layers.** Position-wise layers (`Dense`, `Embedding`, `LayerNorm`, activations over
   the feature axis, `Chunk`, the chunked and fused losses) need nothing. Layers that
   depend on positions use this shard's global positions (`SequenceSharding.
   local_positions`): `PositionalEncoding` adds the table's rows at those positions and
   rotary attention rotates by them. `CausalAttention` (every ``implementation``) runs
   ring attention over ``axis_name`` (`revtrain.layers.attention.ring`). Layers that mix
   positions in a way a shard cannot compute alone raise a one-line ``ValueError`` naming
   the layer and the fix (`check_not_split`): `LSHCausalAttention`, incremental decoding
   (``mode='predict'`` caches), `ShiftRight`, `Conv`, the pools, `BatchNorm` over the
   length in ``'train'`` mode, `Mean`, `Flatten`, `Concatenate`, `Split`, `Softmax` and
   `LogSoftmax` over axis 1, `ReversibleReshape`, and the dense attention functions
   (`dot_product_attention`, `einsum_attention`, `blockwise_attention`) called directly.
   A user's `Fn` is not checked. `trace_split` traces a model abstractly under a split,
   so a program can find such a layer before it writes anything. The split axis is axis 1
   of ``[batch, length, ...]`` activations (rank 3 or more); rank-2 arrays are not
   refused by the reductions above, as they may as well be rows of positions
   (``[positions, vocab]`` in a fused loss) as ``[batch, length]`` token ids.
4. **Losses.** A loss layer returns this shard's weighted mean; the trainer combines the
   shards as it combines devices over the batch (weights summed over every axis the
   batch and the length are split over), so the invariance holds.
5. **Dropout.** Give every device of one ``seq`` group the *same* rng (split keys over the
   batch axes only). Then attention dropout does not depend on the split: each
   probability's keep bit is a hash of the layer's key and its *global* (row, column)
   (`revtrain.layers.dropout_masks.position_keep_mask`), so ring attention on ``n``
   shards drops exactly what one-device attention drops. `Dropout` and the encoding
   dropout of `PositionalEncoding` draw a mask of the local shape from the key folded
   with the shard index (`shard_key`), so shards draw independent masks and a position's
   mask depends on ``n_shards`` (as per-device keys make masks depend on the device
   count); a `Dropout` whose ``shared_axes`` include the length keeps the key as given,
   so its mask is shared along the whole sequence.

Why striped rather than zig-zag (the Llama-3 context-parallel layout: ``2n`` chunks,
shard ``s`` holding chunks ``s`` and ``2n - 1 - s``): both give every shard the same
causal work at every ring step, but with stripes each step is exactly the one-device
blockwise kernel's causal pattern over local blocks (query block ``i`` visits key blocks
``0..i``; keys from a higher shard lose the diagonal), so ring attention reuses that
kernel unchanged, and the length need only divide by ``n`` (zig-zag: by ``2n``). The costs:
a ring step visits ``nb (nb + 1) / 2`` local block pairs against zig-zag's ``nb**2 / 2``
(``nb`` local blocks; ``1 + 1 / nb`` times as many, the extra diagonal blocks being half
masked), and the dropout mask hashes one word per element instead of one per 4 (16-bit
masks), as a shard's columns are not contiguous. `ring_block_counts` measures the work
per shard and step for any layout (``benchmarks/ring_attention.py`` prints it).

References: Liu, Zaharia & Abbeel, 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"; Brandon et al., 2023, "Striped Attention: Faster Ring Attention for
Causal Transformers"; Dubey et al., 2024, "The Llama 3 Herd of Models" (context
parallelism, zig-zag chunks).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

SEQ_AXIS = "seq"


def _check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


def check_layout(n_shards: int, length: int, owner: str = "sequence_layout") -> tuple[int, int]:
    """Returns ``(n_shards, length)`` as ints if both are positive and ``n_shards`` divides
    ``length``, else raises a one-line ValueError naming them and the fix."""
    n = _check_positive_int(n_shards, f"{owner} n_shards")
    length = _check_positive_int(length, f"{owner} length")
    if length % n:
        lower, upper = length - length % n, length + n - length % n
        raise ValueError(f"sequence length {length} is not divisible by the seq mesh axis "
                         f"size n_shards={n}; use a length that is a multiple of {n} (e.g. "
                         f"{lower or upper} or {upper}) or another seq axis size")
    return n, length


def sequence_layout(n_shards: int, length: int) -> np.ndarray:
    """The striped order of positions a trainer gives the length axis before sharding it.

    Args:
      n_shards: size of the ``seq`` mesh axis.
      length: the global sequence length ``L``.

    Returns:
      int64 ``[length]`` permutation: ``perm[s * L / n + r] = r * n + s``, so contiguous
      shard ``s`` holds positions ``s, s + n, s + 2n, ...``; the identity for ``n == 1``.

    Raises:
      ValueError: for a non-positive ``n_shards`` or ``length``, or a length ``n_shards``
        does not divide (`check_layout`).
    """
    n, length = check_layout(n_shards, length)
    return np.arange(length).reshape(length // n, n).T.reshape(-1)


class SequenceSharding(NamedTuple):
    """What a layer sees of the split while tracing under `sequence_sharded`.

    Attributes:
      axis_name: the ``shard_map`` mesh axis the length is split over.
      n_shards: that axis's size.
      length: the global sequence length; activations hold ``length // n_shards`` rows.
    """
    axis_name: str
    n_shards: int
    length: int

    @property
    def local_length(self) -> int:
        """Rows of the length axis this device holds."""
        return self.length // self.n_shards

    def shard_index(self) -> jax.Array:
        """int32 scalar: this device's index along ``axis_name`` (inside ``shard_map``)."""
        try:
            size = lax.axis_size(self.axis_name)
        except NameError as e:
            raise ValueError(f"sequence_sharded(axis_name={self.axis_name!r}) is active, but "
                             f"no shard_map axis of that name is being traced; trace the "
                             f"program body inside shard_map over {self.axis_name!r}") from e
        if size != self.n_shards:
            raise ValueError(f"sequence_sharded says n_shards={self.n_shards} but mesh axis "
                             f"{self.axis_name!r} has size {size}; pass n_shards={size}")
        return lax.axis_index(self.axis_name).astype(jnp.int32)

    def local_positions(self) -> jax.Array:
        """int32 ``[local_length]``: the global positions of this device's rows (striped)."""
        return (jnp.arange(self.local_length, dtype=jnp.int32) * self.n_shards
                + self.shard_index())

    def describe(self) -> str:
        """``sequence_sharded(axis_name='seq', n_shards=4, length=1024)``, for messages."""
        return (f"sequence_sharded(axis_name={self.axis_name!r}, n_shards={self.n_shards}, "
                f"length={self.length})")


_CURRENT: contextvars.ContextVar[SequenceSharding | None] = contextvars.ContextVar(
    "revtrain_sequence_sharding", default=None)


@contextlib.contextmanager
def sequence_sharded(axis_name: str, n_shards: int, length: int
                     ) -> Iterator[SequenceSharding]:
    """Declares, while tracing a ``shard_map`` body, that axis 1 is split over ``axis_name``.

    The setting is a ``contextvars.ContextVar`` (thread- and task-local), restored on exit;
    contexts nest, the innermost wins.

    Args:
      axis_name: the mesh axis of the length (`SEQ_AXIS` in the trainers).
      n_shards: that axis's size; 1 leaves every layer as it is outside the context.
      length: the global sequence length (before the split).

    Yields:
      The `SequenceSharding` that `current` returns inside the block.

    Raises:
      ValueError: for an empty ``axis_name``, a non-positive ``n_shards`` or ``length``,
        or a length ``n_shards`` does not divide (`check_layout`).
    """
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"sequence_sharded axis_name={axis_name!r} must be a mesh axis name "
                         f"such as {SEQ_AXIS!r}")
    n_shards, length = check_layout(n_shards, length, "sequence_sharded")
    token = _CURRENT.set(SequenceSharding(axis_name, n_shards, length))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def current() -> SequenceSharding | None:
    """The innermost active `sequence_sharded` setting, or None outside every one."""
    return _CURRENT.get()


def split() -> SequenceSharding | None:
    """`current` when it splits the length (``n_shards > 1``), else None."""
    sharding = _CURRENT.get()
    return sharding if sharding is not None and sharding.n_shards > 1 else None


class SequenceSplitError(ValueError):
    """A layer refuses to run with its length split over devices (`check_not_split`)."""


def check_not_split(owner: str, fix: str, why: str = "mixes positions") -> None:
    """Raises a one-line `SequenceSplitError` when the length is split (`split`):
    ``owner`` ``why`` across the shards, which one shard cannot compute; ``fix`` says what
    to use instead."""
    sharding = split()
    if sharding is not None:
        raise SequenceSplitError(f"{owner} {why} along the length, which "
                                 f"{sharding.describe()} splits over devices; {fix}")


def trace_split(fn: Callable[..., Any], batch: Any, *replicated: Any, mesh: Mesh,
                axis_name: str = SEQ_AXIS) -> Any:
    """``jax.eval_shape`` of ``fn(batch, *replicated)`` traced as a trainer traces its
    program body on ``mesh``: inside ``shard_map``, every ``[batch, length, ...]`` leaf of
    ``batch`` split along its length over ``axis_name`` (``replicated`` whole on every
    device), under `sequence_sharded`. Nothing is compiled or run, so a model can be
    checked against a mesh before a run writes anything: a layer that refuses the split
    raises its `SequenceSplitError` here rather than in the first step.

    Args:
      fn: the program body, e.g. a model's ``pure_fn`` followed by its loss.
      batch: arrays or ``jax.ShapeDtypeStruct`` s, global shapes; leaves of rank >= 2 have
        the length on axis 1 (all the same length).
      *replicated: arrays or ``jax.ShapeDtypeStruct`` s (weights, state, rng).
      mesh: a mesh with an axis ``axis_name``.
      axis_name: the mesh axis of the length.

    Returns:
      The ``jax.ShapeDtypeStruct`` s of ``fn``'s per-device outputs.

    Raises:
      ValueError: as `check_layout` for a length ``axis_name`` does not divide; whatever
        ``fn`` raises while traced (`SequenceSplitError` for a refused split).
    """
    n_shards = mesh.shape[axis_name]
    lengths = [np.shape(a)[1] for a in jax.tree.leaves(batch) if np.ndim(a) >= 2]
    if not lengths:
        raise ValueError(f"trace_split: no leaf of the batch has a length axis (rank >= 2) "
                         f"to split over {axis_name!r}")

    def body(local_batch: Any, *values: Any) -> Any:
        with sequence_sharded(axis_name, n_shards, lengths[0]):
            return fn(local_batch, *values)

    specs = jax.tree.map(lambda a: P(None, axis_name) if np.ndim(a) >= 2 else P(), batch)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, *[P()] * len(replicated)),
                           out_specs=P(), check_vma=False)
    return jax.eval_shape(mapped, batch, *replicated)


def check_local_length(owner: str, length: int) -> SequenceSharding | None:
    """`split`, after checking that activations have its local length; None when unsplit."""
    sharding = split()
    if sharding is not None and length != sharding.local_length:
        raise ValueError(f"{owner} got a length-{length} input under {sharding.describe()}, "
                         f"whose shards hold {sharding.local_length} positions; give each "
                         f"device length // n_shards = {sharding.local_length} rows")
    return sharding


def shard_key(rng: jax.Array | None) -> jax.Array | None:
    """``fold_in(rng, shard index)`` when the length is split, else ``rng``: the key of a
    dropout mask drawn over this shard's rows, so that shards draw independent masks."""
    sharding = split()
    if rng is None or sharding is None:
        return rng
    return jax.random.fold_in(rng, sharding.shard_index())


def ring_block_counts(perm: np.ndarray, n_shards: int, block_size: int) -> np.ndarray:
    """Causal work of ring attention per shard and ring step, for a layout ``perm``.

    Shard ``s`` holds positions ``perm[s * L / n:(s + 1) * L / n]``; at ring step ``k`` it
    holds the keys of shard ``(s - k) % n``. Both are cut into local blocks of
    ``block_size`` rows; a (query block, key block) pair needs work when some key in it is
    at or before some query (``min(keys) <= max(queries)``), i.e. when a block-skipping
    kernel must visit it.

    Args:
      perm: int ``[L]`` layout (e.g. `sequence_layout`, or ``np.arange(L)`` for contiguous
        shards).
      n_shards: number of shards ``n``; must divide ``L``.
      block_size: rows per local block (the last block may be shorter).

    Returns:
      int64 ``[n_steps = n, n_shards]``: block pairs needing work. A ring step lasts as
      long as its busiest shard, so ``counts.max(1).sum() / counts.mean(1).sum()`` is the
      slowdown from imbalance (1 = balanced).
    """
    perm = np.asarray(perm)
    local = perm.size // n_shards
    n_blocks = -(-local // block_size)
    edges = np.arange(n_blocks) * block_size
    shards = perm.reshape(n_shards, local)
    first = np.minimum.reduceat(shards, edges, axis=1)   # [n, blocks]: min key per block
    last = np.maximum.reduceat(shards, edges, axis=1)    # max query per block
    counts = np.zeros((n_shards, n_shards), np.int64)
    for step in range(n_shards):
        for s in range(n_shards):
            t = (s - step) % n_shards
            counts[step, s] = int(np.sum(first[t][None, :] <= last[s][:, None]))
    return counts


__all__ = ["SEQ_AXIS", "SequenceSharding", "SequenceSplitError", "check_layout",
           "check_local_length", "check_not_split", "current", "ring_block_counts",
           "sequence_layout", "sequence_sharded", "shard_key", "split", "trace_split"]
