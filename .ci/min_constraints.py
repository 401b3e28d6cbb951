"""Prints a pip constraints file pinning the ``>=`` lower bounds that setup.cfg declares.

Reads ``install_requires`` and the extras named on the command line, following extras that
name other extras (``revtrain[tfds-cpu,bench]``); with no extras named, every extra is read.
A requirement without a lower bound is left free, and one whose environment marker
excludes this interpreter is skipped; names and extras compare as pip normalises them
(``tfds_cpu`` is ``tfds-cpu``). Only the distributions an install of ``.[EXTRAS]`` pulls
in are printed, so every printed pin can be checked against what was installed. Usage::

    python .ci/min_constraints.py [setup.cfg] [--extras test,docs] > constraints.txt
"""

import argparse
import configparser

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
    declared = {canonicalize_name(name): value.splitlines()
                for name, value in config["options.extras_require"].items()}
    pending = [canonicalize_name(e) for e in (declared if extras is None else extras)]
    seen: set[str] = set()
    requirements = [(Requirement(line), "") for line in _lines(
        config["options"]["install_requires"])]
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        if extra not in declared:
            raise ValueError(f"extra {extra!r} is not declared in {setup_cfg} "
                             f"(it has {sorted(declared)}); name one of those")
        seen.add(extra)
        for line in _lines(declared[extra]):
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) == PACKAGE:
                pending.extend(canonicalize_name(e) for e in requirement.extras)
            else:
                requirements.append((requirement, extra))
    bounds: dict[str, tuple[str, str]] = {}  # canonical name -> (name as written, version)
    for requirement, extra in requirements:
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        key = canonicalize_name(requirement.name)
        for spec in requirement.specifier:
            if spec.operator == ">=":
                name, version = bounds.setdefault(key, (requirement.name, spec.version))
                if version != spec.version:
                    raise ValueError(f"{requirement.name} has two lower bounds in "
                                     f"{setup_cfg}: {version} and {spec.version}; keep one")
    return {name: version for name, version in bounds.values()}


def _lines(text: str | list[str]) -> list[str]:
    lines = text.splitlines() if isinstance(text, str) else text
    return [line.strip() for line in lines if line.strip()]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setup_cfg", nargs="?", default="setup.cfg")
    parser.add_argument("--extras", default=None,
                        help="comma-separated extras installed (default: all)")
    args = parser.parse_args()
    names = None if args.extras is None else [e for e in args.extras.split(",") if e]
    for name, version in lower_bounds(args.setup_cfg, names).items():
        print(f"{name}=={version}")
