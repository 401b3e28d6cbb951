"""The one check that a batch splits evenly, shared by the trainers, data and training.

It imports nothing from revtrain, so every subpackage can use it without depending on
another.
"""

from __future__ import annotations


def check_divisible(batch_size: int, n_devices: int, what: str = "batch size", *,
                    by: str = "n_devices", fix: str | None = None) -> None:
    """Raises unless ``batch_size`` rows split evenly into ``n_devices`` parts.

    Args:
      batch_size: rows of the batch (a batch of 0 rows never splits).
      n_devices: how many parts (devices, or processes with ``by='process_count'``).
      what: how the error names the batch size (e.g. ``'eval batch size'``).
      by: how the error names ``n_devices``.
      fix: the error's advice; default ``'use a non-empty global batch that is a
        multiple of {n_devices}'``.

    Raises:
      ValueError: one line, ``f"{what} {batch_size} is not divisible by
        {by}={n_devices}; {fix}"``; or for ``n_devices < 1``.

    >>> check_divisible(8, 4)
    >>> check_divisible(6, 4, fix="use 8")
    Traceback (most recent call last):
    ...
    ValueError: batch size 6 is not divisible by n_devices=4; use 8
    """
    if n_devices < 1:
        raise ValueError(f"{by}={n_devices} must be positive; split over at least one")
    if batch_size < 1 or batch_size % n_devices:
        fix = fix or f"use a non-empty global batch that is a multiple of {n_devices}"
        raise ValueError(f"{what} {batch_size} is not divisible by {by}={n_devices}; {fix}")
