"""Memory budgets as a user writes them: ``12GiB``, ``512MiB``, ``16GB``.

A budget is a positive number followed at once by a unit: binary ``KiB``, ``MiB``, ``GiB``,
``TiB`` (powers of 1024, what accelerator memory is sized in) or decimal ``KB``, ``MB``,
``GB``, ``TB`` (powers of 1000, what vendors print), or ``B``. A bare number, a space
before the unit (``12 GB``), zero, a negative or a non-finite value is refused: a budget is
what the planner keeps every candidate under, and a unit left to guess would make it
wrong by a factor of a thousand.
"""

from __future__ import annotations

import math
import re

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_PATTERN = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([A-Za-z]+)")


def parse_memory_budget(text: str, name: str = "--memory_budget") -> int:
    """The byte count of a budget such as ``'12GiB'`` (units in the module docstring).

    Args:
      text: the budget as written.
      name: the flag or binding that gave it, for the error.

    Returns:
      A positive int, in bytes (rounded down).

    Raises:
      ValueError: one line naming the value and the accepted form, for anything else.
    """
    fix = f"write a positive number and a unit with no space, e.g. {name}=12GiB"
    if not isinstance(text, str):
        raise ValueError(f"{name}={text!r} is not a budget; {fix}")
    match = _PATTERN.fullmatch(text.strip())
    unit = match and _UNITS.get(match.group(2).upper())
    if not match or unit is None:
        raise ValueError(f"{name}={text!r} is not a budget; {fix} (units: B, KiB, MiB, "
                         f"GiB, TiB, KB, MB, GB, TB)")
    value = float(match.group(1)) * unit
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{name}={text!r} is not a positive number of bytes; {fix}")
    return int(value)


__all__ = ["parse_memory_budget"]
