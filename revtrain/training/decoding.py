"""Autoregressive decoding of a language model: with a key/value cache, or by recomputing.

Two decoders with one `decode` method:

* `CachedDecoder` runs the ``mode='predict'`` model one token at a time; its attention
  layers keep the keys and values of earlier positions in their state (Trax's predict
  mode). A new token costs ``O(n_layers * (d_model^2 + d_model * d_ff))`` for the
  projections plus ``O(n_layers * max_len * d_model)`` for attention over the cache
  (masked to the positions decoded so far), independent of how many tokens came before.
  Prompt plus continuation must fit the cache (``max_len``).
* `Decoder` runs the eval-mode model on a fixed window of the newest ``length`` tokens
  (right-padded while shorter) and reads the output at the last real position: every token
  costs a whole forward pass of ``length`` positions, ``O(length)`` times the cached
  per-token work, but any number of tokens can be generated (the window slides).

Both compile one step function and sample with `sample_token`: greedy (temperature 0 is
argmax), temperature, top-k and top-p (nucleus, Holtzman et al., 2020), as Paxml's
decoding and Trax's ``autoregressive_sample`` offer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from revtrain.data.tokenizers import ByteTokenizer, Tokenizer
from revtrain.layers import Layer


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def sample_token(log_probs: jax.Array, rng: jax.Array, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None) -> jax.Array:
    """Picks the next token id from ``log_probs: float32[vocab]``.

    Args:
      log_probs: log-probabilities (or logits) over the vocabulary.
      rng: key for sampling (unused when ``temperature == 0``).
      temperature: 0 for greedy decoding (argmax); else sample from
        ``softmax(log_probs / temperature)``.
      top_k: sample among the ``top_k`` most likely tokens only.
      top_p: sample among the smallest set of most likely tokens whose probability is at
        least ``top_p`` (nucleus sampling).

    Returns:
      int32[] token id.
    """
    if temperature == 0:
        return jnp.argmax(log_probs).astype(jnp.int32)
    logits = log_probs.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if top_p is not None:
        order = jnp.argsort(-logits)
        probs = jax.nn.softmax(logits[order])
        before = jnp.cumsum(probs) - probs  # Mass of the more likely tokens.
        keep = jnp.zeros_like(logits, bool).at[order].set(before < top_p)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(rng, logits).astype(jnp.int32)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None,
                   prefix: str = "") -> None:
    """Raises a one-line ValueError for a temperature that is negative, nan or inf, top_k < 1
    or top_p outside (0, 1], and for top_k or top_p at temperature 0: greedy decoding takes
    the argmax and would silently ignore them (asked for, they mean "sample"). ``prefix``
    goes before each name in the message (``'--'``: the command-line flags)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 (0 is "
                         f"greedy)")
    if temperature == 0 and (top_k is not None or top_p is not None):
        name, value = ("top_k", top_k) if top_k is not None else ("top_p", top_p)
        raise ValueError(f"{prefix}{name}={value} has no effect at {prefix}temperature=0 "
                         f"(greedy decoding); pass {prefix}temperature above 0 to sample, or "
                         f"leave {prefix}{name} out")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 or None")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] or None")


class _Sampling:
    """Shared argument checks and the token loop of both decoders."""

    def decode(self, prompt: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
               rng: jax.Array | None = None, top_k: int | None = None,
               top_p: float | None = None) -> list[int]:
        """Returns ``max_new_tokens`` new token ids continuing ``prompt``.

        Args:
          prompt: token ids (bytes for a byte LM); must not be empty.
          max_new_tokens: how many tokens to generate.
          temperature: 0 for greedy (argmax) decoding; else the sampling temperature.
          rng: key for sampling; token ``i`` uses ``fold_in(rng, i)``; default key 0.
          top_k, top_p: restrict sampling as `sample_token`.

        Raises:
          ValueError: for an empty prompt, bad sampling arguments, or (cached) a prompt and
            continuation longer than the cache.
        """
        if len(prompt) == 0:
            raise ValueError("prompt is empty; give at least one token to continue")
        check_sampling(temperature, top_k, top_p)
        rng = jax.random.key(0) if rng is None else rng
        self.check_length(len(prompt), max_new_tokens)
        log_probs = self._start([int(t) for t in prompt])
        new = []
        for i in range(max_new_tokens):
            token = int(sample_token(log_probs, jax.random.fold_in(rng, i),
                                     float(temperature), top_k, top_p))
            new.append(token)
            if i + 1 < max_new_tokens:
                log_probs = self._advance(token)
        return new

    def check_length(self, n_prompt: int, n_new: int) -> None:
        """Raises a one-line ValueError when ``n_prompt`` tokens plus ``n_new`` new ones
        do not fit the decoder (only `CachedDecoder` has a limit: its cache)."""


class Decoder(_Sampling):
    """Decoding by recomputing a sliding window with the eval-mode LM (no cache).

    Args:
      model: an eval-mode LM, ``int32[1, length] -> float32[1, length, vocab]``.
      weights: its weights (e.g. from a checkpoint; the layer objects are not read).
      state: its state, likewise.
      length: window length (at most the model's ``max_len``).

    Raises:
      ValueError: for ``length < 1``.
    """

    def __init__(self, model: Layer, weights: Any, state: Any, length: int):
        if length < 1:
            raise ValueError(f"length={length} must be >= 1")
        self.length = int(length)
        self._values = (weights, state)

        def next_log_probs(weights, state, tokens, position):
            output, _ = model.pure_fn(tokens, weights, state, jax.random.key(0))
            return jax.nn.log_softmax(output[0, position].astype(jnp.float32))

        self._next_log_probs = jax.jit(next_log_probs)

    def _start(self, prompt: list[int]) -> jax.Array:
        self._tokens = prompt
        return self._window()

    def _advance(self, token: int) -> jax.Array:
        self._tokens.append(token)
        return self._window()

    def _window(self) -> jax.Array:
        window = self._tokens[-self.length:]
        buffer = np.zeros((1, self.length), np.int32)
        buffer[0, :len(window)] = window
        return self._next_log_probs(*self._values, buffer, len(window) - 1)


class CachedDecoder(_Sampling):
    """Incremental decoding with the ``mode='predict'`` LM and its key/value cache.

    Args:
      model: a ``mode='predict'`` LM (e.g. ``ReversibleTransformerLM(mode='predict')``)
        whose attention caches ``max_len`` positions; initialised here for one sequence.
      weights: its weights (those of the train/eval model: the trees are the same).
      max_len: the cache length: prompt plus continuation must fit.
      model_max_len: the model's own ``max_len`` when the cache was built shorter (what
        one decode needs, `revtrain.training.decode_program.load_decoder`); default
        ``max_len``.

    Per token: one ``[1, 1]`` forward pass, ``O(d_model^2 + d_model * d_ff + max_len *
    d_model)`` per layer (see the module docstring).
    """

    def __init__(self, model: Layer, weights: Any, max_len: int,
                 model_max_len: int | None = None):
        self.max_len = int(max_len)
        self.model_max_len = int(model_max_len or max_len)
        _, self._initial_state = model.init(jax.ShapeDtypeStruct((1, 1), jnp.int32))
        self._weights = weights

        def step(weights, state, token):
            output, state = model.pure_fn(token, weights, state, jax.random.key(0))
            return jax.nn.log_softmax(output[0, -1].astype(jnp.float32)), state

        self._step = jax.jit(step)

    def check_length(self, n_prompt: int, n_new: int) -> None:
        """Raises a one-line ValueError, naming both numbers, the cache and the fixes, when
        ``n_prompt + n_new > max_len``."""
        if n_prompt + n_new <= self.max_len:
            return
        room = self.max_len - n_prompt
        fixes = [f"ask for at most {room} new ones (--max_new_bytes={room})"] if room > 0 else []
        if n_new < self.max_len:
            fixes.append(f"shorten the prompt to at most {self.max_len - n_new} tokens")
        fixes.append("decode without the cache (--nocache: a sliding window)")
        fix = ", ".join(fixes[:-1]) + ", or " + fixes[-1] if len(fixes) > 1 else fixes[0]
        raise ValueError(f"prompt of {n_prompt} tokens plus {n_new} new ones exceeds the "
                         f"cache of max_len={self.max_len}; {fix}")

    def _start(self, prompt: list[int]) -> jax.Array:
        self._state = self._initial_state
        for token in prompt:
            log_probs = self._advance(token)
        return log_probs

    def _advance(self, token: int) -> jax.Array:
        log_probs, self._state = self._step(self._weights, self._state,
                                            np.full((1, 1), token, np.int32))
        return log_probs


DEFAULT_NEW_BYTES = 200


def new_bytes_for(decoder: _Sampling, n_prompt: int, max_new_bytes: int | None) -> int:
    """``max_new_bytes``, or when None the default: `DEFAULT_NEW_BYTES`, fewer where the
    decoder's key/value cache (``max_len``) has less room after a prompt of ``n_prompt``
    bytes (at least 1, so a prompt that fills the cache gets the cache's one-line error)."""
    if max_new_bytes is not None:
        return max_new_bytes
    if isinstance(decoder, CachedDecoder):
        return max(1, min(DEFAULT_NEW_BYTES, decoder.max_len - n_prompt))
    return DEFAULT_NEW_BYTES


def decode_text(decoder: _Sampling, prompt: str, max_new_bytes: int | None,
                temperature: float = 0.0, seed: int = 0, top_k: int | None = None,
                top_p: float | None = None, tokenizer: Tokenizer | None = None,
                ) -> tuple[str, list[int]]:
    """Continues text ``prompt``; returns ``(new text, new token ids)``.

    ``tokenizer`` (default `ByteTokenizer`: a byte LM) encodes the prompt and decodes the
    continuation, so ``max_new_bytes`` counts its tokens (bytes for a byte LM).
    ``max_new_bytes=None`` continues as far as `new_bytes_for` allows (200 tokens, or what
    the cache holds after the prompt). Bytes that do not form valid UTF-8 are shown as
    U+FFFD. The new text is the decoded prompt and continuation less the decoded prompt,
    so a subword tokenizer's spaces between them are kept.
    """
    tokenizer = tokenizer or ByteTokenizer()
    tokens = [int(t) for t in tokenizer.encode(prompt)]
    new = decoder.decode(tokens, new_bytes_for(decoder, len(tokens), max_new_bytes),
                         temperature, jax.random.key(seed), top_k, top_p)
    if tokenizer.byte_level:
        return tokenizer.decode(new), new
    before, after = tokenizer.decode(tokens), tokenizer.decode(tokens + new)
    return (after[len(before):] if after.startswith(before) else tokenizer.decode(new)), new
