"""Prints a pip constraints file pinning the ``>=`` lower bounds that setup.cfg declares.

Reads ``install_requires`` and the extras named on the command line, following extras that
name other extras (``revtrain[tfds-cpu,bench]``); with no extras named, every extra is read.
A requirement without a lower bound is left free. Only the distributions an install of
``.[EXTRAS]`` pulls in are printed, so every printed pin can be checked against what was
installed. Usage::

    python .ci/min_constraints.py [setup.cfg] [--extras test,docs] > constraints.txt
"""

import argparse
import configparser

from packaging.requirements import Requirement

PACKAGE = "revtrain"


def lower_bounds(setup_cfg: str, extras: list[str] | None = None) -> dict[str, str]:
    """``{distribution name: lowest allowed version}`` for an install of ``.[extras]``.

    Args:
      setup_cfg: path of the setup.cfg to read.
      extras: the extras installed (``None``: all of them). An extra that names
        ``revtrain[...]`` brings in the extras it names.

    Raises:
      ValueError: when one distribution is given two different lower bounds, or an extra
        that setup.cfg does not declare is named.
    """
    config = configparser.ConfigParser()
    config.read(setup_cfg)
    declared = {name: value.splitlines()
                for name, value in config["options.extras_require"].items()}
    pending = list(declared if extras is None else extras)
    seen: set[str] = set()
    lines = config["options"]["install_requires"].splitlines()
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        if extra not in declared:
            raise ValueError(f"extra {extra!r} is not declared in {setup_cfg} "
                             f"(it has {sorted(declared)}); name one of those")
        seen.add(extra)
        for line in filter(None, (line.strip() for line in declared[extra])):
            requirement = Requirement(line)
            if requirement.name == PACKAGE:
                pending.extend(requirement.extras)
            else:
                lines.append(line)
    bounds: dict[str, str] = {}
    for line in filter(None, (line.strip() for line in lines)):
        requirement = Requirement(line)
        for spec in requirement.specifier:
            if spec.operator == ">=":
                if bounds.setdefault(requirement.name, spec.version) != spec.version:
                    raise ValueError(f"{requirement.name} has two lower bounds in "
                                     f"{setup_cfg}: {bounds[requirement.name]} and "
                                     f"{spec.version}; keep one")
    return bounds


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setup_cfg", nargs="?", default="setup.cfg")
    parser.add_argument("--extras", default=None,
                        help="comma-separated extras installed (default: all)")
    args = parser.parse_args()
    names = None if args.extras is None else [e for e in args.extras.split(",") if e]
    for name, version in lower_bounds(args.setup_cfg, names).items():
        print(f"{name}=={version}")
