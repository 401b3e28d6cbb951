"""Locality-sensitive-hashing causal attention (Reformer): `LSHCausalAttention`.

Reformer's attention (Kitaev et al., 2020, section 3) attends only among positions whose
queries hash alike, so its work and memory grow as ``length x chunk_len`` rather than
``length**2``. Per head and per hashing round:

1. **Shared query/key.** One projection gives ``qk``; queries are ``qk`` and keys its
   unit-length normalisation ``qk / |qk|``, so a query's own key is always among its most
   similar; logits are ``q . k / sqrt(d_head)`` (Trax: keys normalised, then scaled).
2. **Angular LSH.** ``bucket = argmax([x R; -x R])`` for a random Gaussian rotation ``R``
   of ``d_head x n_buckets / 2`` (Andoni et al., 2015). Many buckets are hashed as a
   product of two smaller rotations (mixed radix), as Trax does above 128 buckets: the
   hash then costs ``length x d_head x (n1 + n2) / 2`` instead of ``length x d_head x n / 2``.
3. **Sort** the positions by ``(bucket, position)`` and cut the sorted sequence into chunks
   of ``chunk_len``; each chunk attends to itself and the ``n_chunks_before`` chunks before
   it (in sorted order; the first chunk has no chunk before it).
4. **Masks, by original position:** a query never sees a later position (causal), and it
   sees itself only when nothing else is available: its own logit is lowered by ``1e5``
   (Reformer's rule, Trax's constant), which with shared query/key would otherwise dominate.
   No same-bucket mask is applied (as Trax): a chunk's keys from a neighbouring bucket stay.
5. **Unsort** the outputs, and combine the ``n_hashes`` rounds with the softmax of their
   per-position log-sum-exp (each round's output weighted by the probability mass it saw).

Costs (per layer; ``B`` batch, ``H`` heads, ``L`` length, ``c`` chunk_len, ``b``
n_chunks_before, ``n`` n_hashes): ``B x H x n x L x c x (1 + b) x d_head`` multiply-adds
for the attention products plus the hash and an ``O(L log L)`` sort per round. Heads run
one at a time (a ``lax.scan`` under ``jax.checkpoint``, as `CausalAttention`'s blockwise
path), rounds one at a time within a head, and the chunk kernel loops over groups of
chunks holding ``float32[B, chunks, c, (1 + b) c]`` logits for about 4,096 sorted rows at a
time, so the memory beside the layer's input and output is ``O(B x L x d_head)`` (plus
the hash's ``B x L x n_f / 2`` rotated values per bucket factor): no
``L x c`` array over the whole sequence is kept, and the compiled program does not grow
with the length. The chunk kernel and the sort/unsort gathers have custom vjps: the
kernel recomputes its probabilities from the saved log-sum-exp (FlashAttention's
backward) and normalises its keys per window (no sorted key array), and a gather's
cotangent is the inverse gather (no scatter). The rounds of a head are combined under one
custom vjp (`lsh_rounds`) that keeps ``qk, v`` and the output and recomputes one round at
a time backwards, so one round's sorted ``q, v`` exist at a time.

What LSH approximates: within a round a query attends only to the keys that share its
chunks, so probability mass outside them is lost; more rounds (``n_hashes``) make a
missed neighbour less likely at proportionally more work. With ``chunk_len >= length``
there is one chunk and the layer is exact dense attention with the rules of 1 and 4. The
set of keys a position sees depends on how later positions hash (they move the sort), but
never on later positions' values: the output at ``t`` is a function of values ``<= t``
(as in Trax). Decoding (``'predict'`` mode) attends to every cached position with the same
rules, i.e. the ``chunk_len >= length`` limit of the layer.

Randomness: the rotations come from the layer's rng (or, with ``hash_seed``, from a fixed
key: Trax's ``hash_seed``), so a reversible layer's recomputation, and every trainer, hash
alike; attention dropout uses `revtrain.layers.dropout_masks.position_keep_mask` of the
sorted row and key slot, so the forward and backward passes drop alike.

Where the pieces live: hashing, sorting and permutations in `revtrain.layers.attention.lsh_hashing`;
one round's chunk kernel, `lsh_round` and the dense `shared_qk_attention` in
`revtrain.layers.attention.lsh_chunks`; this module holds the layer (projections, heads, rounds,
decoding) and re-exports both modules' public names.

References: Kitaev, Kaiser & Levskaya, 2020, "Reformer: The Efficient Transformer"; Trax
1.4.1 ``trax.layers.research.efficient_attention.LSHSelfAttention`` (argument names,
defaults, the ``1e5`` self penalty, the bucket factorisation); Andoni et al., 2015,
"Practical and Optimal LSH for Angular Distance".
"""


from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from revtrain.layers.attention.dense import head_widths, init_projections, project
from revtrain.layers.attention.headwise import Headwise, run_by_head
from revtrain.layers.attention.lsh_chunks import (
    SELF_PENALTY,
    lsh_round,
    normalised,
    shared_qk_attention,
)
from revtrain.layers.attention.lsh_hashing import (
    MAX_BUCKETS,
    MAX_UNFACTORED_BUCKETS,
    check_n_buckets,
    default_n_buckets,
    hash_buckets,
    permute,
    sort_order,
)
from revtrain.layers.attention.lsh_rounds import lsh_rounds
from revtrain.layers.attention.rotary import check_rotary_head_size, rotary_embedding
from revtrain.layers.core import check_mode, check_rate
from revtrain.layers.dropout_masks import DEFAULT_MASK_BITS, check_mask_bits, mask_seed
from revtrain.layers.layer import Layer
from revtrain.layers.sequence_parallel import check_not_split

DEFAULT_CHUNK_LEN = 128
# What a head's recomputation keeps rather than recomputes: its sort permutations.
_SAVE_SORT = jax.checkpoint_policies.save_only_these_names("lsh_sort")


def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"LSHCausalAttention {name}={value!r} must be an int >= {minimum}")
    return int(value)




class LSHCausalAttention(Layer):
    """Reformer's LSH causal self-attention: ``[batch, length, d_feature]`` -> same shape.

    Usable as a language model's ``attention_type`` (it takes the arguments the LMs pass:
    ``n_heads``, ``dropout``, ``mode``, ``max_len``, ``mask_bits``, ``rotary``). Weights
    are three float32 ``(w, b)`` pairs: the shared query/key (``w: [d_feature, n_heads *
    d_attention_key]``), the value (``[d_feature, n_heads * d_attention_value]``) and the
    output projections (``[n_heads * d_attention_value, d_feature]``), all ``[d_feature,
    d_feature]`` at the default widths (Glorot-uniform kernels, normal biases with stddev
    1e-6). The algorithm, its costs and what it approximates are in the module docstring.

    Args:
      d_feature: model width; the last axis of the input.
      n_heads: heads.
      dropout: drop rate of the attention probabilities, ``[0, 1)``, ``'train'`` mode only.
      mode: ``'train'``, ``'eval'`` or ``'predict'``. In ``'predict'`` mode with ``max_len``
        set, the layer decodes incrementally with a cache ``(keys: float32[batch,
        max_len, n_heads, d_attention_key], values: float32[batch, max_len, n_heads,
        d_attention_value], index: int32[])`` (normalised keys) and
        attends to every cached position under the layer's rules (the exact
        ``chunk_len >= length`` limit; not hashed). Without ``max_len`` it behaves as
        ``'eval'``.
      max_len: cache length for ``'predict'`` mode.
      chunk_len: sorted positions per chunk (Trax's default 128). A length it does not
        divide is padded at the end of the sorted order with masked positions.
      n_chunks_before: previous chunks each chunk also attends to (Trax's default 1).
      n_hashes: hashing rounds (Trax's default 1): each round costs a full pass of the
        attention; more rounds miss fewer similar keys.
      n_buckets: an even int, or a tuple of even ints hashed as their product; None
        (default) takes `default_n_buckets` of the length (Reformer's ``2 * length //
        chunk_len``, factorised above 128 as Trax).
      hash_seed: None (default) draws the rotations from the layer's rng each call (as
        Reformer: the hash changes every step); an int in ``[0, 2**32)`` fixes them
        (Trax's ``hash_seed``; every layer given the same seed hashes alike), so without
        attention dropout the output no longer depends on the rng -- e.g. the same on any
        device count.
      mask_bits: random bits per attention-dropout mask element, 16 or 8.
      rotary: rotate the shared query/key by position (RoFormer) before hashing; the LMs
        set it for ``pos_type='rotary'``.
      d_attention_key: per-head width of the shared query/key (Trax's ``ReformerLM``
        name; its ``LSHSelfAttention`` calls it ``d_qk`` and defaults to 64); None
        (default) is ``d_feature // n_heads``. The hash rotations are ``[d_attention_key,
        n_buckets / 2]``.
      d_attention_value: per-head width of the values (Trax's ``d_v``); None (default)
        is ``d_feature // n_heads``.

    Raises:
      ValueError: at construction, for ``d_feature``/``n_heads`` that are not positive
        ints or, where a width is left at its default, do not divide, a width that is not
        a positive int, ``chunk_len < 1``, ``n_hashes < 1``, ``n_chunks_before <
        0``, an odd (or non-int) ``n_buckets`` or more than `MAX_BUCKETS` of them,
        ``hash_seed`` not an int in ``[0, 2**32)``, ``max_len < 1``, a ``dropout`` outside
        ``[0, 1)``, an unknown ``mode``, ``mask_bits`` not 8 or 16, ``rotary`` with an odd
        ``d_attention_key``; on a call (wrapped in `LayerError`), inputs that are not ``[batch,
        length, d_feature]`` or are empty, a call without an rng and without
        ``hash_seed``, and in ``'predict'`` mode inputs of another batch than the cache's
        or longer than ``max_len`` (as `CausalAttention`, the cache index itself is not
        checked: writes past ``max_len`` are clamped).
    """

    def __init__(self, d_feature: int, n_heads: int = 1, dropout: float = 0.0,
                 mode: str = "train", max_len: int | None = None,
                 chunk_len: int = DEFAULT_CHUNK_LEN, n_chunks_before: int = 1,
                 n_hashes: int = 1, n_buckets: int | Sequence[int] | None = None,
                 hash_seed: int | None = None, mask_bits: int = DEFAULT_MASK_BITS,
                 rotary: bool = False, d_attention_key: int | None = None,
                 d_attention_value: int | None = None):
        super().__init__(n_in=1, n_out=1)
        self._d_feature = _check_int(d_feature, "d_feature", 1)
        self._n_heads = _check_int(n_heads, "n_heads", 1)
        self._d_key, self._d_value = head_widths(d_feature, n_heads, d_attention_key,
                                                 d_attention_value, "LSHCausalAttention")
        self._dropout = check_rate(dropout, "LSHCausalAttention")
        self._mode = check_mode(mode, "LSHCausalAttention")
        if max_len is not None:
            _check_int(max_len, "max_len", 1)
        self._cache_len = max_len if mode == "predict" else None
        self._chunk_len = _check_int(chunk_len, "chunk_len", 1)
        self._n_chunks_before = _check_int(n_chunks_before, "n_chunks_before", 0)
        self._n_hashes = _check_int(n_hashes, "n_hashes", 1)
        self._n_buckets = check_n_buckets(n_buckets, "LSHCausalAttention")
        if hash_seed is not None and not 0 <= _check_int(hash_seed, "hash_seed", 0) < 2 ** 32:
            raise ValueError(f"LSHCausalAttention hash_seed={hash_seed} must be below 2**32; "
                             f"use e.g. hash_seed=0")
        self._hash_seed = hash_seed
        self._mask_bits = check_mask_bits(mask_bits, "LSHCausalAttention")
        if rotary:
            check_rotary_head_size(self._d_key, "LSHCausalAttention")
        self._rotary = bool(rotary)

    def _check_input(self, shape: tuple[int, ...]) -> None:
        if len(shape) != 3 or shape[-1] != self._d_feature:
            raise ValueError(f"LSHCausalAttention(d_feature={self._d_feature}) expects inputs "
                             f"[batch, length, {self._d_feature}]; got shape {shape}")
        if not shape[0] or not shape[1]:
            raise ValueError(f"LSHCausalAttention got an empty input of shape {shape}; pass "
                             f"at least one sequence of one position")

    def n_buckets_for(self, length: int) -> tuple[int, ...]:
        """The bucket factors the layer hashes a ``length``-long sequence into."""
        return self._n_buckets or default_n_buckets(length, self._chunk_len)

    def forward_with_state(self, x, weights, state, rng):
        self._check_input(x.shape)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(jnp.float32)
        check_not_split("LSHCausalAttention", "use attention_type=CausalAttention (ring "
                        "attention over the split) or seq=1", why="sorts positions into "
                        "hash buckets")
        if self._cache_len is not None:
            return self._decode(x, weights, state)
        return run_by_head(self._headwise(x.shape, x.dtype, rng), x, weights), state

    def headwise(self, input_shape: tuple[int, ...], dtype, rng: jax.Array | None
                 ) -> Headwise | None:
        """This layer's call on ``[batch, length, d_feature]`` inputs of ``dtype`` as
        per-head stages (`revtrain.layers.attention.headwise`): the position-wise
        shared query/key and value projections (rotary angles included) around a core
        that hashes, sorts and attends over the whole length; ``run_by_head`` of it equals
        the call. None in ``'predict'`` mode with a cache (decoding runs whole).

        Raises:
          ValueError: as a call does (inputs, a missing rng, a sequence split).
        """
        self._check_input(tuple(input_shape))
        check_not_split("LSHCausalAttention", "use attention_type=CausalAttention (ring "
                        "attention over the split) or seq=1", why="sorts positions into "
                        "hash buckets")
        if self._cache_len is not None:
            return None
        return self._headwise(tuple(input_shape), dtype, rng)

    def _headwise(self, shape: tuple[int, ...], dtype, rng) -> Headwise:
        if self._hash_seed is not None:
            hash_key, dropout_key = jax.random.key(self._hash_seed), rng
        elif rng is None:
            raise ValueError("LSHCausalAttention draws its hash rotations from the rng, but "
                             "got rng=None; pass a jax.random.key or set hash_seed")
        else:
            hash_key, dropout_key = jax.random.split(rng)
        rate = self._dropout if self._mode == "train" else 0.0
        if rate and dropout_key is None:
            raise ValueError(f"LSHCausalAttention dropout={rate} needs an rng; pass a "
                             f"jax.random.key or use mode='eval'")
        seed = mask_seed(dropout_key) if rate else None
        length = shape[1]
        n_heads, n_hashes = self._n_heads, self._n_hashes
        factors = self.n_buckets_for(length)
        rotations = tuple(
            jax.random.normal(key, (n_heads, n_hashes, self._d_key, f // 2), jnp.float32)
            for key, f in zip(jax.random.split(hash_key, len(factors)), factors, strict=True))

        def project(x, pairs, h, positions):
            qk, v = (jnp.dot(x, w) + b for w, b in pairs)
            if self._rotary:
                qk = rotary_embedding(qk[:, :, None], positions)[:, :, 0]
            return qk, v

        def core(projected, h):
            qk, v = projected
            head_rotations = tuple(r[h] for r in rotations)
            if n_hashes == 1:
                out, _ = lsh_round(qk, v, tuple(r[0] for r in head_rotations),
                                   chunk_len=self._chunk_len,
                                   n_chunks_before=self._n_chunks_before, dropout_rate=rate,
                                   seed=seed, mask_bits=self._mask_bits, head=h,
                                   total_heads=n_heads, round_index=0, n_hashes=1)
                return out
            return lsh_rounds(qk, v, head_rotations, chunk_len=self._chunk_len,
                              n_chunks_before=self._n_chunks_before, dropout_rate=rate,
                              seed=seed, mask_bits=self._mask_bits, head=h,
                              total_heads=n_heads)

        return Headwise(n_heads, 2, jnp.dtype(dtype), project, core, jnp.arange(length),
                        policy=_SAVE_SORT)

    def _decode(self, x, weights, state):
        """Writes the new positions' normalised keys and values at the cache index and
        attends to every cached position up to each query (`shared_qk_attention`)."""
        keys, values, index = state
        batch, length, _ = x.shape
        if batch != keys.shape[0] or length > self._cache_len:
            raise ValueError(f"LSHCausalAttention decodes into a cache of batch "
                             f"{keys.shape[0]} and {self._cache_len} positions, but got "
                             f"inputs of shape {x.shape}; init the layer with this batch, or a "
                             f"larger max_len")

        qk, v = (project(pair, x).reshape(batch, length, self._n_heads, -1)
                 for pair in weights[:2])
        q_positions = index + jnp.arange(length)
        if self._rotary:
            qk = rotary_embedding(qk, q_positions)
        k = normalised(qk)
        keys = lax.dynamic_update_slice(keys, k.astype(keys.dtype), (0, index, 0, 0))
        values = lax.dynamic_update_slice(values, v.astype(values.dtype), (0, index, 0, 0))
        attended = shared_qk_attention(qk, values.astype(v.dtype), q_positions,
                                       jnp.arange(self._cache_len), keys=keys)
        out = project(weights[2], attended.reshape(batch, length, -1))
        return out, (keys, values, index + length)

    def init_weights_and_state(self, input_signature, rng):
        self._check_input(input_signature.shape)
        d, h = self._d_feature, self._n_heads
        shapes = ((d, h * self._d_key), (d, h * self._d_value), (h * self._d_value, d))
        return init_projections(input_signature, rng, shapes, self._cache_len,
                                (h, self._d_key, self._d_value))


__all__ = ["DEFAULT_CHUNK_LEN", "MAX_BUCKETS", "MAX_UNFACTORED_BUCKETS", "SELF_PENALTY",
           "LSHCausalAttention", "check_n_buckets", "default_n_buckets", "hash_buckets",
           "lsh_round", "normalised", "permute", "shared_qk_attention", "sort_order"]
