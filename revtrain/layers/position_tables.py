"""The sinusoidal position table, whole or at given positions.

`sinusoidal_encoding` is the fixed table of Vaswani et al. (2017), section 3.5, computed in
float64 on the host and stored as float32 (the trained table's initial value).
`sinusoidal_rows` gives its rows at traced positions, which is how `PositionalEncoding`
adds them (at every length, under a sequence split, `revtrain.layers.sequence_parallel`,
and when decoding), without a ``[length, d]`` table in the program: with ``p = hi * base + lo``
(``base = ceil(sqrt(length))``) it takes the sines and cosines of ``hi * base * w`` and of
``lo * w`` from two small float64-computed tables and combines them by the angle-addition
formulas, ``sin(a + b) = sin a cos b + cos a sin b`` and ``cos(a + b) = cos a cos b - sin a
sin b``. Computing ``sin(p * w)`` directly in float32 would lose about ``p * 2**-24``
radians (1e-3 at position 16,384); the factorised rows agree with the table to a few float32
rounding errors (about 2e-7) and take ``2 sqrt(length) x d`` floats instead of ``length x d``.

References: Vaswani et al., 2017, "Attention Is All You Need", section 3.5.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def _frequencies(d_feature: int) -> np.ndarray:
    """float64 ``[ceil(d / 2)]``: ``1 / 10000^(2i / d)``."""
    return np.exp(np.arange(0, d_feature, 2, dtype=np.float64)
                  * -(math.log(10000.0) / d_feature))


def sinusoidal_encoding(length: int, d_feature: int) -> np.ndarray:
    """Returns the fixed float32 ``[length, d_feature]`` table of Vaswani et al. (2017).

    ``pe[pos, 2i] = sin(pos / 10000^(2i / d))`` and ``pe[pos, 2i + 1] = cos(pos / 10000^(2i /
    d))``; an odd ``d_feature`` drops the last cosine column.
    """
    position = np.arange(length, dtype=np.float64)[:, None]
    div_term = _frequencies(d_feature)
    table = np.zeros((length, d_feature), dtype=np.float64)
    table[:, 0::2] = np.sin(position * div_term)
    table[:, 1::2] = np.cos(position * div_term)[:, :d_feature // 2]
    return table.astype(np.float32)


def sinusoidal_rows(positions: jax.Array, d_feature: int, length: int) -> jax.Array:
    """Rows ``positions`` of ``sinusoidal_encoding(length, d_feature)``, float32.

    Args:
      positions: int ``[n]`` positions in ``[0, length)`` (may be traced).
      d_feature: the table's width.
      length: an upper bound on the positions (sets the factor tables' sizes).

    Returns:
      float32 ``[n, d_feature]``, equal to the table's rows to about 2e-7. A row depends
      only on its position, ``d_feature`` and ``length``, whichever other positions are
      asked for (up to the float32 rounding of the program's fusion: FMA or not).
      Traced positions cannot be checked: callers check that they lie in ``[0,
      length)``.
    """
    base = max(1, math.isqrt(length - 1) + 1)
    n_high = -(-length // base)
    w = _frequencies(d_feature)
    high = (np.arange(n_high, dtype=np.float64) * base)[:, None] * w
    low = np.arange(base, dtype=np.float64)[:, None] * w
    tables = [jnp.asarray(f(a), jnp.float32) for a in (high, low) for f in (np.sin, np.cos)]
    positions = jnp.asarray(positions).astype(jnp.int32)
    sin_h, cos_h = (jnp.take(t, positions // base, axis=0) for t in tables[:2])
    sin_l, cos_l = (jnp.take(t, positions % base, axis=0) for t in tables[2:])
    sin = sin_h * cos_l + cos_h * sin_l
    cos = cos_h * cos_l - sin_h * sin_l
    rows = jnp.stack([sin, cos], axis=-1).reshape(positions.shape[0], 2 * w.shape[0])
    return rows[:, :d_feature]


__all__ = ["sinusoidal_encoding", "sinusoidal_rows"]
