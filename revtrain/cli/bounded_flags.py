"""Numeric flags of the command-line tools that refuse what their program would refuse later.

absl's bounded float flags admit ``nan`` (every comparison with it is false) and cannot
exclude an end of their interval, so ``--top_p=0.0`` or ``--temperature=nan`` used to pass
parsing and fail only after the model was loaded. `define_real` is a float flag that is
finite and inside an interval whose ends may be open; a bad value is refused while the
flags are parsed, in absl's one line naming the flag and the value (``flag --top_p=0.0:
must be a finite number in (0, 1]``), with exit status 2.
"""

from __future__ import annotations

import inspect
import math

from absl import flags

# The largest ``--seed``: sampling keys take ``seed + i`` for prompt ``i``, and a seed past
# 64 bits fails in ``jax.random.key`` after the model loaded; 32 bits as numpy's seeds.
MAX_SEED = 2**32 - 1


class _RealParser(flags.FloatParser):
    """A float in ``[lower, upper]`` (``(lower, ...`` when ``lower_open``), never nan/inf."""

    def __init__(self, lower: float | None, upper: float | None, lower_open: bool):
        super().__init__()
        self._range = (lower, upper, lower_open)
        low = "-inf" if lower is None else f"{lower:g}"
        high = "inf" if upper is None else f"{upper:g}"
        if upper is None and lower is not None:
            self.syntactic_help = f"a finite number {'>' if lower_open else '>='} {low}"
        else:
            self.syntactic_help = (f"a finite number in {'(' if lower_open else '['}{low}, "
                                   f"{high}{']' if upper is not None else ')'}")

    def parse(self, argument: str | float) -> float:
        value = self.convert(argument)
        lower, upper, lower_open = self._range
        if not math.isfinite(value) or (lower is not None and (
                value < lower or (lower_open and value == lower))) or (
                upper is not None and value > upper):
            raise ValueError(f"must be {self.syntactic_help}")
        return value


def define_real(name: str, default: float | None, help_text: str, fv: flags.FlagValues,
                lower: float | None = None, upper: float | None = None,
                lower_open: bool = False) -> None:
    """Defines ``--name``: a finite float in ``[lower, upper]`` (``(lower, upper]`` with
    ``lower_open``; a None end is unbounded), checked when the flags are parsed.

    Raises (at parsing):
      flags.IllegalFlagValueError: ``flag --<name>=<value>: must be a finite number in
        ...`` for nan, inf or a value outside the interval.
    """
    caller = inspect.currentframe().f_back  # --help lists the flag under its tool's module.
    flags.DEFINE(_RealParser(lower, upper, lower_open), name, default, help_text,
                 flag_values=fv, serializer=flags.ArgumentSerializer(),
                 module_name=caller.f_globals["__name__"])
