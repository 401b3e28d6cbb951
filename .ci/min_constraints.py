"""Prints a pip constraints file pinning every ``>=`` lower bound declared in setup.cfg.

Reads ``install_requires`` and every extra of ``[options.extras_require]``; a requirement
without a lower bound (or naming revtrain itself) is left free. Usage::

    python .ci/min_constraints.py [setup.cfg] > constraints.txt
"""

import configparser
import sys

from packaging.requirements import Requirement


def lower_bounds(setup_cfg: str) -> dict[str, str]:
    """``{distribution name: lowest allowed version}`` from ``setup_cfg``.

    Raises:
      ValueError: when one distribution is given two different lower bounds.
    """
    config = configparser.ConfigParser()
    config.read(setup_cfg)
    lines = config["options"]["install_requires"].splitlines()
    for extra in config["options.extras_require"].values():
        lines += extra.splitlines()
    bounds: dict[str, str] = {}
    for line in filter(None, (line.strip() for line in lines)):
        requirement = Requirement(line)
        for spec in requirement.specifier:
            if spec.operator == ">=" and requirement.name != "revtrain":
                if bounds.setdefault(requirement.name, spec.version) != spec.version:
                    raise ValueError(f"{requirement.name} has two lower bounds in "
                                     f"{setup_cfg}: {bounds[requirement.name]} and "
                                     f"{spec.version}; keep one")
    return bounds


if __name__ == "__main__":
    for name, version in lower_bounds(sys.argv[1] if len(sys.argv) > 1 else "setup.cfg").items():
        print(f"{name}=={version}")
