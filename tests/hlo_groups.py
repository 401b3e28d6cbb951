"""Reading the replica groups of a compiled program's collectives from its HLO text."""

import re

import numpy as np

_GROUPS = re.compile(r"replica_groups=(\{(?:\{[\d,\s]*\},?\s*)*\}|\[[\d,]+\]<=\[[\d,]+\]"
                     r"(?:T\([\d,]+\))?)")


def _parse(groups: str) -> list[tuple[int, ...]]:
    if groups.startswith("{"):
        return [tuple(int(i) for i in g.split(",") if i.strip())
                for g in re.findall(r"\{([\d,\s]*)\}", groups[1:-1])]
    shape, dims, perm = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                                     groups).groups()
    ids = np.arange(np.prod([int(d) for d in dims.split(",")])).reshape(
        [int(d) for d in dims.split(",")])
    if perm:
        ids = ids.transpose([int(p) for p in perm.split(",")])
    return [tuple(int(i) for i in row)
            for row in ids.reshape([int(s) for s in shape.split(",")])]


def collective_groups(hlo_text: str, op: str) -> list[list[tuple[int, ...]]]:
    """Per instance of collective ``op`` (``'all-gather'``, ``'reduce-scatter'``,
    ``'all-reduce'``; their ``-start`` forms too) in ``hlo_text``, its replica groups as
    tuples of device ids (indices into the program's device assignment: for a program on
    a mesh, positions in ``mesh.devices.flat``)."""
    found = []
    for line in hlo_text.splitlines():
        if re.search(rf"\s{re.escape(op)}(?:-start)?\(", line):
            match = _GROUPS.search(line)
            if match:
                found.append(_parse(match.group(1)))
    return found
