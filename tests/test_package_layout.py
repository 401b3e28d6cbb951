"""The package's layout: modules stay short and ``revtrain.*`` modules import no circle.

Both checks read the source with `ast` (nothing is imported). An import counts wherever it
is written: at module level, inside a function, or under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "revtrain"
MAX_LINES = 400


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES.get(name, pathlib.Path()).name == "__init__.py"


def _absolute(module: str | None, level: int, importer: str) -> str:
    """The absolute module name of ``from <level dots><module> import ...`` in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not _is_package(importer):
        base.pop()
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str) -> set[str]:
    """The ``revtrain`` modules that module ``name`` imports, anywhere in its source.

    ``from revtrain.x import y`` is module ``revtrain.x.y`` when that is a module, else
    ``revtrain.x``; a package (its ``__init__``) counts as importing what it imports.
    """
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node.module, node.level, name)
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in MODULES else module)
    return {m for m in found if m in MODULES and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle ``[a, b, ..., a]`` of ``graph``, or None (depth-first search)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path = [start], {start}
        todo = [iter(sorted(graph[start]))]
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                todo.pop()
                node = path.pop()
                on_path.discard(node)
                done.add(node)
            elif nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                todo.append(iter(sorted(graph[nxt])))
    return None


def test_no_module_is_over_400_lines():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, (f"modules over {MAX_LINES} lines (split them by job): "
                      f"{dict(sorted(long.items()))}")


def test_no_import_cycle_among_revtrain_modules():
    graph = {name: imports_of(name) for name in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {cycle}"


@pytest.mark.parametrize("graph,cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"a2"}, "a2": set(), "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
])
def test_find_cycle(graph, cycle):
    assert find_cycle(graph) == cycle


def test_from_imports_resolve_to_the_submodule_when_there_is_one():
    assert "revtrain.layers.combinators" in imports_of("revtrain.layers")
    assert "revtrain.layers" not in imports_of("revtrain.layers.combinators")


def _package_docstring_misses(package: str) -> list[str]:
    """The direct submodules and subpackages of ``package`` that its docstring does not name
    (as `` `name` `` or ``name/``), private modules aside."""
    path = MODULES[package]
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    children = sorted({m.split(".")[len(package.split("."))] for m in MODULES
                       if m.startswith(package + ".")})
    return [c for c in children if not c.startswith("_")
            and f"`{c}`" not in doc and f"{c}/" not in doc
            and f"`{package}.{c}`" not in doc]


PACKAGES = sorted(name for name in MODULES if _is_package(name) and name != "revtrain")


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_docstring_names_its_modules(package):
    missing = _package_docstring_misses(package)
    assert not missing, (f"{package}'s docstring (its map) does not name {missing}; "
                         f"add a line for each to {MODULES[package].relative_to(ROOT)}")


def test_trainers_common_does_not_import_the_floors_above_it():
    above = ("revtrain.trainers.block", "revtrain.trainers.trainer",
             "revtrain.trainers.reversible", "revtrain.trainers.memory_efficient")
    for name in MODULES:
        if name.startswith("revtrain.trainers.common"):
            bad = sorted(m for m in imports_of(name)
                         if m.startswith(above) or m == "revtrain.trainers")
            assert not bad, f"{name} imports {bad}, a floor above trainers.common"


def test_trainers_has_three_floors():
    entries = sorted(p.name for p in (PACKAGE / "trainers").iterdir()
                     if p.name != "__pycache__")
    assert entries == ["__init__.py", "block", "common", "memory_efficient.py",
                       "reversible.py", "trainer.py"]
