"""Multi-head causal self-attention: `CausalAttention`, full or blockwise.

Scaled dot-product attention (Vaswani et al., 2017, section 3.2): ``softmax(q k^T /
sqrt(d_head) + causal_mask) v`` per head, with learned query, key, value and output
projections. It runs one of three exact implementations (`choose_implementation` picks
one when none is given):

* ``'xla'`` -- the full path: ``jax.nn.dot_product_attention`` without attention dropout,
  plain einsums (`einsum_attention`) with it. Holds the ``[batch, n_heads, length,
  length]`` logits and probabilities (and, in the backward pass, their cotangents); above
  `FULL_ATTENTION_MAX_BYTES` of logits it runs one head at a time, so ``[batch, 1, length,
  length]`` of them (`CausalAttention._by_head`).
* ``'blockwise'`` -- `revtrain.layers.attention.blockwise`: online softmax over blocks of
  ``block_size`` positions with a recomputing custom vjp; memory linear in the length, on
  every backend, attention dropout included.
* ``'cudnn'`` -- cuDNN's fused flash attention through ``jax.nn.dot_product_attention``
  (NVIDIA GPUs, float16/bfloat16, no attention dropout); memory linear in the length.

Attention dropout keeps or drops each probability by a pure function of the layer's key
and the element's ``(row, column)`` (`revtrain.layers.dropout_masks.position_keep_mask`),
so the full and the blockwise paths drop the same probabilities whatever the block size:
switching implementation never changes what a model computes beyond float rounding. The
attention logits and softmax are computed in at least float32 whatever the input dtype;
the output has the input dtype.

Sequence parallelism: traced under `revtrain.layers.sequence_parallel.sequence_sharded`
with ``n_shards > 1`` (the length split over a mesh axis), every implementation runs ring
attention (`revtrain.layers.attention.ring`: the blockwise kernel's online softmax with
key/value blocks passed around the ring), one head at a time as the blockwise path, and
rotary positions are the shard's global positions; the result equals the unsplit layer's
rows to float rounding, attention dropout included when every shard gets the same key.
Incremental decoding (``'predict'`` mode with ``max_len``) is not split: it raises.

The dense functions and the projections this layer shares with `LSHCausalAttention` are in
`revtrain.layers.attention.dense` (re-exported here).

References: Vaswani et al., 2017, "Attention Is All You Need"; Trax's
``trax.layers.attention.CausalAttention`` (arguments, dropout on the attention
probabilities, ``mode``); Rabe & Staats, 2021, and Dao et al., 2022 (blockwise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from revtrain.layers.attention.blockwise import (
    DEFAULT_BLOCK_SIZE,
    blockwise_attention,
    check_block_size,
)
from revtrain.layers.attention.dense import (
    by_head,
    causal_mask,
    dot_product_attention,
    einsum_attention,
    head_widths,
    init_projections,
    project,
)
from revtrain.layers.attention.headwise import Headwise, run_by_head
from revtrain.layers.attention.ring import ring_attention
from revtrain.layers.attention.rotary import check_rotary_head_size, rotary_embedding
from revtrain.layers.core import check_mode, check_rate
from revtrain.layers.dropout_masks import DEFAULT_MASK_BITS, check_mask_bits
from revtrain.layers.layer import Layer
from revtrain.layers.sequence_parallel import check_local_length, check_not_split

IMPLEMENTATIONS = (None, "xla", "blockwise", "cudnn")
# The full path is chosen while its float32 [batch, n_heads, length, length] logits take at
# most this many bytes (64 MiB: e.g. batch 32 x 4 heads at length 362, or 1 x 4 at 2,048).
FULL_ATTENTION_MAX_BYTES = 64 * 2 ** 20


def choose_implementation(batch: int, n_heads: int, length: int, d_head: int, dtype,
                          dropout: float, backend: str, d_value: int | None = None) -> str:
    """The implementation `CausalAttention` runs when given ``implementation=None``.

    * ``'xla'`` (the full path) while the float32 ``[batch, n_heads, length, length]``
      logits take at most `FULL_ATTENTION_MAX_BYTES` (64 MiB): at such sizes it is the
      fastest and its buffers are small;
    * above that, ``'cudnn'`` on a GPU backend for float16/bfloat16 inputs without
      attention dropout and with ``d_head`` a multiple of 8 up to 128, the values' width
      equal to it (what cuDNN's flash attention takes);
    * else ``'blockwise'`` (CPU, TPU, float32, dropout): linear memory everywhere.

    ``batch`` is what the layer sees: per device inside the trainers' ``shard_map``. All
    three are exact, and the full and blockwise paths draw the same dropout masks, so
    the choice changes results by float rounding only.

    Args:
      batch, n_heads, length, d_head: the attention's sizes (``d_head``: per-head width
        of queries and keys).
      dtype: the query/key/value dtype.
      dropout: the attention-dropout rate in effect (0 outside ``'train'`` mode).
      backend: ``jax.default_backend()``: ``'cpu'``, ``'gpu'`` or ``'tpu'``.
      d_value: per-head width of the values (default ``d_head``).

    Returns:
      ``'xla'``, ``'cudnn'`` or ``'blockwise'``.
    """
    if 4 * batch * n_heads * length * length <= FULL_ATTENTION_MAX_BYTES:
        return "xla"
    if (backend == "gpu" and jnp.dtype(dtype) in (jnp.float16, jnp.bfloat16)
            and not dropout and d_head % 8 == 0 and d_head <= 128
            and d_value in (None, d_head)):
        return "cudnn"
    return "blockwise"


class CausalAttention(Layer):
    """Multi-head causal self-attention: ``[batch, length, d_feature]`` -> same shape.

    Position ``t`` of the output depends only on input positions ``<= t``. Weights are four
    ``(w, b)`` pairs (float32), for the query, key, value and output projections in that
    order: ``w: [d_feature, n_heads * d_attention_key]`` for the query and the key,
    ``[d_feature, n_heads * d_attention_value]`` for the value and ``[n_heads *
    d_attention_value, d_feature]`` for the output (all ``[d_feature, d_feature]`` at the
    default widths); kernels are Glorot-uniform and biases normal with stddev 1e-6, as
    Trax's ``Dense``. Every implementation computes the same function (module
    docstring), so weights and checkpoints move freely between them.

    Args:
      d_feature: model width; the last axis of the input.
      n_heads: number of heads.
      dropout: drop rate for the attention probabilities, in ``[0, 1)``, ``'train'`` mode only.
      mode: ``'train'``, ``'eval'`` or ``'predict'``. In ``'predict'`` mode with ``max_len``
        set, the layer decodes incrementally (Trax's predict mode): its state is a
        key/value cache ``(keys: float32[batch, max_len, n_heads, d_attention_key],
        values: float32[batch, max_len, n_heads, d_attention_value], index: int32[])``,
        each call takes the next ``length`` positions (the whole prompt once,
        then one token) and attends to the cached positions before them with the full
        path (a new token costs ``O(max_len * d_feature)``; a prompt of ``p`` tokens holds
        ``[batch, n_heads, p, max_len]`` logits). Without ``max_len``, ``'predict'``
        behaves as ``'eval'``.
      max_len: cache length (longest decoded sequence) for ``'predict'`` mode.
      implementation: ``'xla'`` (full), ``'blockwise'`` (linear memory, any backend),
        ``'cudnn'`` (NVIDIA GPUs, float16/bfloat16 activations, e.g.
        ``compute_dtype=bfloat16``, no attention dropout), or None: chosen per call by
        `choose_implementation` (full up to 64 MiB of logits, else cuDNN where it applies,
        else blockwise).
      block_size: positions per block of the blockwise path (its logits take ``4 * batch
        * n_heads * block_size**2`` bytes per block); need not divide the length.
      mask_bits: random bits per element of the attention-dropout mask: 16 (rate error
        <= 7.6e-6) or 8 (rate error <= 2e-3); see `revtrain.layers.dropout_masks`.
      rotary: rotate queries and keys by their positions (`revtrain.layers.attention.rotary`,
        RoFormer) before attending; the LMs set it for ``pos_type='rotary'``.
      d_attention_key: per-head width of queries and keys (Trax's ``ReformerLM`` name);
        None (default) is ``d_feature // n_heads``. Logits are scaled by ``1 /
        sqrt(d_attention_key)``.
      d_attention_value: per-head width of values, and of each head's output before the
        output projection; None (default) is ``d_feature // n_heads``.

    Under a sequence split (`revtrain.layers.sequence_parallel.sequence_sharded`, ``n_shards
    > 1``) every implementation runs ring attention over the split's mesh axis (module
    docstring); ``'predict'`` mode with ``max_len`` raises there.

    Integer inputs are computed in float32 (as `Dense` does); float inputs in their dtype.

    Raises:
      ValueError: if ``d_feature`` or ``n_heads`` is not a positive int, ``d_feature`` is
        not divisible by ``n_heads`` where a width is left at its default, a width is not
        a positive int, ``implementation`` is unknown, ``block_size`` is not a positive
        int, ``rotary`` is set with an odd ``d_attention_key``, or ``'cudnn'`` is asked
        for where it cannot run (no GPU backend, attention dropout in ``'train'`` mode,
        or key and value widths that differ).
      LayerError: (from ``pure_fn``) for inputs that are not ``[batch, length, d_feature]``,
        or, under a sequence split, not of the split's local length or in ``'predict'``
        mode with a cache.
    """

    def __init__(self, d_feature: int, n_heads: int = 1, dropout: float = 0.0,
                 mode: str = "train", max_len: int | None = None,
                 implementation: str | None = None, mask_bits: int = DEFAULT_MASK_BITS,
                 block_size: int = DEFAULT_BLOCK_SIZE, rotary: bool = False,
                 d_attention_key: int | None = None, d_attention_value: int | None = None):
        super().__init__(n_in=1, n_out=1)
        for name, value in (("d_feature", d_feature), ("n_heads", n_heads)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"CausalAttention {name}={value!r} must be a positive int")
        self._d_key, self._d_value = head_widths(d_feature, n_heads, d_attention_key,
                                                 d_attention_value, "CausalAttention")
        self._d_feature = d_feature
        self._n_heads = n_heads
        self._dropout = check_rate(dropout, "CausalAttention")
        self._mode = check_mode(mode, "CausalAttention")
        if max_len is not None and max_len < 1:
            raise ValueError(f"CausalAttention max_len={max_len} must be >= 1 or None")
        self._cache_len = max_len if mode == "predict" else None
        self._implementation = _check_implementation(implementation, self._dropout, mode,
                                                     self._d_key, self._d_value)
        self._block_size = check_block_size(block_size, "CausalAttention")
        self._mask_bits = check_mask_bits(mask_bits, "CausalAttention")
        if rotary:
            check_rotary_head_size(self._d_key, "CausalAttention")
        self._rotary = bool(rotary)

    def _check_input(self, shape: tuple[int, ...]) -> None:
        if len(shape) != 3 or shape[-1] != self._d_feature:
            raise ValueError(f"CausalAttention(d_feature={self._d_feature}) expects inputs "
                             f"[batch, length, {self._d_feature}]; got shape {shape}")

    def forward_with_state(self, x, weights, state, rng):
        self._check_input(x.shape)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(jnp.float32)
        batch, length, _ = x.shape
        rate = self._dropout if self._mode == "train" else 0.0
        if self._cache_len is not None:
            check_not_split("CausalAttention(mode='predict')", "decode without a sequence "
                            "split (seq=1)", why="decodes from a key/value cache")
        sharded = check_local_length("CausalAttention", length)
        if sharded is not None:
            return self._by_head(x, weights, rng, rate, "ring", sharded), state
        implementation = None
        if self._cache_len is None:
            implementation = self._implementation or choose_implementation(
                batch, self._n_heads, length, self._d_key, x.dtype, rate,
                jax.default_backend(), self._d_value)
            large = 4 * batch * self._n_heads * length * length > FULL_ATTENTION_MAX_BYTES
            if implementation == "blockwise" or (implementation == "xla" and large):
                return self._by_head(x, weights, rng, rate, implementation), state

        def heads(a):
            return a.reshape(batch, length, self._n_heads, -1)

        q, k, v = (heads(project(pair, x)) for pair in weights[:3])
        if self._cache_len is not None:
            attended, state = self._attend_cached(q, k, v, state)
        else:
            if self._rotary:
                positions = jnp.arange(length)
                q, k = rotary_embedding(q, positions), rotary_embedding(k, positions)
            # The full path, when chosen rather than asked for, keeps jax.nn's own default.
            passed = None if self._implementation is None and implementation == "xla" else (
                implementation)
            attended = dot_product_attention(q, k, v, None, rate, rng, is_causal=True,
                                             implementation=passed, mask_bits=self._mask_bits)
        return project(weights[3], attended.reshape(batch, length, -1)), state

    def _by_head(self, x, weights, rng, rate, implementation, sharded=None):
        """Attention one head at a time: ``y = sum_h attn_h(x) W_o[h] + b_o``.

        Runs for the blockwise path, and for the full path where its logits exceed
        `FULL_ATTENTION_MAX_BYTES`. A ``lax.scan`` over the heads, each under
        ``jax.checkpoint``: the backward pass recomputes a head's projections and attention
        forward, so one head's ``q, k, v``, output and cotangents (and, on the full path,
        its ``[batch, 1, length, length]`` logits) exist at a time, beside ``x``, the sum
        and their cotangents: ``n_heads`` times fewer such buffers than all heads at once,
        for one more forward pass of the attention in the backward pass (measured on the
        blockwise path at 8K, d_model 128, 4 heads: 24% longer, 43% fewer temporaries).
        Dropout masks are those of all heads at once (``head_start``), so the result does
        not depend on it. ``implementation='ring'`` runs `ring_attention` over the axis of
        ``sharded`` (a `SequenceSharding`), whose global positions the rotary angles use.
        """
        headwise = self._headwise(x.dtype, x.shape[1], rng, rate, implementation, sharded)
        return run_by_head(headwise, x, weights)

    def headwise(self, input_shape: tuple[int, ...], dtype, rng: jax.Array | None
                 ) -> Headwise | None:
        """This layer's call on ``[batch, length, d_feature]`` inputs of ``dtype`` as
        per-head stages (`revtrain.layers.attention.headwise`): position-wise projections
        (rotary angles included) around a full-length core that runs the implementation
        the call would (ring under a sequence split), so ``run_by_head`` of it equals the
        call. None in ``'predict'`` mode with a cache (decoding runs whole).

        Raises:
          ValueError: as a call does, for inputs that are not ``[batch, length,
            d_feature]`` or not of a sequence split's local length.
        """
        self._check_input(tuple(input_shape))
        if self._cache_len is not None:
            return None
        batch, length, _ = input_shape
        rate = self._dropout if self._mode == "train" else 0.0
        sharded = check_local_length("CausalAttention", length)
        if sharded is not None:
            implementation = "ring"
        else:
            implementation = self._implementation or choose_implementation(
                batch, self._n_heads, length, self._d_key, dtype, rate,
                jax.default_backend(), self._d_value)
        return self._headwise(dtype, length, rng, rate, implementation, sharded)

    def _headwise(self, dtype, length: int, rng, rate: float, implementation: str,
                  sharded) -> Headwise:
        n_heads = self._n_heads
        positions = jnp.arange(length) if sharded is None else sharded.local_positions()

        def project(x, pairs, h, positions):
            q, k, v = (jnp.dot(x, w) + b for w, b in pairs)
            if self._rotary:
                q, k = (rotary_embedding(a[:, :, None], positions)[:, :, 0] for a in (q, k))
            return q, k, v

        def core(projected, h):
            q, k, v = (a[:, :, None] for a in projected)
            if implementation == "ring":
                attended = ring_attention(
                    q, k, v, axis_name=sharded.axis_name, block_size=self._block_size,
                    dropout_rate=rate, rng=rng, mask_bits=self._mask_bits, head_start=h,
                    total_heads=n_heads)
            elif implementation == "blockwise":
                attended = blockwise_attention(
                    q, k, v, block_size=self._block_size, dropout_rate=rate, rng=rng,
                    mask_bits=self._mask_bits, head_start=h, total_heads=n_heads)
            else:
                attended = dot_product_attention(
                    q, k, v, None, rate, rng, is_causal=True,
                    implementation=self._implementation, mask_bits=self._mask_bits,
                    head_start=h, total_heads=n_heads)
            return attended[:, :, 0]

        return Headwise(n_heads, 3, jnp.dtype(dtype), project, core, positions)

    def _attend_cached(self, q, k, v, state):
        """Writes ``k, v`` at the cache index and attends to every position up to each query."""
        keys, values, index = state
        query_positions = index + jnp.arange(q.shape[1])
        if self._rotary:
            q, k = rotary_embedding(q, query_positions), rotary_embedding(k, query_positions)
        keys = jax.lax.dynamic_update_slice(keys, k.astype(keys.dtype), (0, index, 0, 0))
        values = jax.lax.dynamic_update_slice(values, v.astype(values.dtype),
                                              (0, index, 0, 0))
        mask = jnp.arange(self._cache_len)[None, :] <= query_positions[:, None]
        implementation = None if self._implementation == "blockwise" else self._implementation
        attended = dot_product_attention(q, keys.astype(q.dtype), values.astype(v.dtype),
                                         mask, implementation=implementation)
        return attended, (keys, values, index + q.shape[1])

    def init_weights_and_state(self, input_signature, rng):
        self._check_input(input_signature.shape)
        d, h = self._d_feature, self._n_heads
        shapes = ((d, h * self._d_key), (d, h * self._d_key), (d, h * self._d_value),
                  (h * self._d_value, d))
        return init_projections(input_signature, rng, shapes, self._cache_len,
                                (h, self._d_key, self._d_value))


def _check_implementation(implementation: str | None, dropout: float, mode: str,
                          d_key: int, d_value: int) -> str | None:
    """Returns ``implementation`` if `CausalAttention` can run it here, else raises
    ValueError naming it and the fix."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"CausalAttention implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}; use 'blockwise' for long sequences or None to "
                         f"choose by size")
    if implementation != "cudnn":
        return implementation
    if d_key != d_value:
        raise ValueError(f"CausalAttention implementation='cudnn' needs keys and values of "
                         f"one width, but d_attention_key={d_key} and d_attention_value="
                         f"{d_value}; use equal widths or implementation='blockwise'")
    backend = jax.default_backend()
    if backend != "gpu":
        raise ValueError(f"CausalAttention implementation='cudnn' needs an NVIDIA GPU, but "
                         f"JAX's backend here is {backend!r}; use implementation='blockwise' "
                         f"(or None)")
    if dropout and mode == "train":
        raise ValueError(f"CausalAttention implementation='cudnn' runs without attention "
                         f"dropout, but dropout={dropout}; use dropout=0 or "
                         f"implementation='blockwise'")
    return implementation
__all__ = ["FULL_ATTENTION_MAX_BYTES", "IMPLEMENTATIONS", "CausalAttention", "by_head",
           "causal_mask", "choose_implementation", "dot_product_attention", "einsum_attention",
           "init_projections", "project"]
