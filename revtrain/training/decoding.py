"""Autoregressive decoding of a byte-level LM by recomputing the prefix each step.

Every new byte runs the eval-mode model on a fixed window of ``length`` tokens (the newest
``length`` tokens, right-padded with 0 while the text is shorter) and reads the output at
the last real position. A causal model's output there does not depend on the padding, and
the fixed shape means one compilation. Costs ``O(length)`` model work per byte -- fine for
a demo; a cache of attention keys and values (Trax's ``predict`` mode) would avoid it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from revtrain.layers import Layer


class Decoder:
    """Greedy or sampled decoding with an eval-mode LM.

    Args:
      model: an initialised eval-mode LM, ``int32[1, length] -> float32[1, length, vocab]``
        logits or log-probabilities.
      length: window length (at most the model's ``max_len``; usually the training
        sequence length).
    """

    def __init__(self, model: Layer, length: int):
        if length < 1:
            raise ValueError(f"length={length} must be >= 1")
        self.model = model
        self.length = int(length)

        def next_logits(weights, state, tokens, position):
            output, _ = model.pure_fn(tokens, weights, state, jax.random.key(0))
            return jax.nn.log_softmax(output[0, position].astype(jnp.float32))

        self._next_logits = jax.jit(next_logits)

    def decode(self, prompt: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
               rng: jax.Array | None = None) -> list[int]:
        """Returns ``max_new_tokens`` new token ids continuing ``prompt``.

        Args:
          prompt: token ids (bytes for a byte LM); must not be empty.
          max_new_tokens: how many tokens to generate.
          temperature: 0 for greedy (argmax) decoding; otherwise sample from
            ``softmax(log_probs / temperature)``.
          rng: key for sampling; default ``jax.random.key(0)``.

        Raises:
          ValueError: for an empty prompt or a negative temperature.
        """
        if len(prompt) == 0:
            raise ValueError("prompt is empty; give at least one token to continue")
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy)")
        rng = jax.random.key(0) if rng is None else rng
        tokens = [int(t) for t in prompt]
        weights, state = self.model.weights, self.model.state
        new = []
        for i in range(max_new_tokens):
            window = tokens[-self.length:]
            buffer = np.zeros((1, self.length), np.int32)
            buffer[0, :len(window)] = window
            log_probs = self._next_logits(weights, state, buffer, len(window) - 1)
            if temperature == 0:
                token = int(jnp.argmax(log_probs))
            else:
                key = jax.random.fold_in(rng, i)
                token = int(jax.random.categorical(key, log_probs / temperature))
            tokens.append(token)
            new.append(token)
        return new


def decode_text(decoder: Decoder, prompt: str, max_new_bytes: int, temperature: float = 0.0,
                seed: int = 0) -> str:
    """Continues UTF-8 text ``prompt`` with a byte LM; returns the new text.

    Bytes that do not form valid UTF-8 are shown as U+FFFD.
    """
    new = decoder.decode(list(prompt.encode("utf-8")), max_new_bytes, temperature,
                         jax.random.key(seed))
    return bytes(new).decode("utf-8", errors="replace")
