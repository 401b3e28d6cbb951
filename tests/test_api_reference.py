"""The documentation site's API reference covers every public name, and the site's pages
are all reachable (mkdocs.yml); `mkdocs build --strict` itself runs in .ci/run."""
import importlib
import re
from pathlib import Path

import pytest

from docs import make_api_reference as ref

ROOT = Path(__file__).resolve().parents[1]
DIRECTIVE = re.compile(r"^::: (\S+)$", re.M)


def _directives() -> set[str]:
    return {target for page in (ROOT / "docs" / "reference").glob("*.md")
            for target in DIRECTIVE.findall(page.read_text(encoding="utf-8"))}


def test_reference_pages_are_up_to_date():
    for name, text in ref.pages().items():
        path = ref.OUTPUT / name
        assert path.exists() and path.read_text(encoding="utf-8") == text, (
            f"docs/reference/{name} is stale; run python docs/make_api_reference.py")


def test_every_subpackage_with_a_public_api_has_a_page():
    with_all = {".".join(p.parent.relative_to(ROOT).parts)
                for p in (ROOT / "revtrain").rglob("__init__.py")
                if "__all__" in p.read_text(encoding="utf-8")}
    assert with_all == {package for package, _, _ in ref.PACKAGES}


@pytest.mark.parametrize("package", [package for package, _, _ in ref.PACKAGES])
def test_every_name_in_all_is_in_the_reference(package):
    module = importlib.import_module(package)
    assert ref.public_names(package) == list(module.__all__)
    missing = [name for name in module.__all__ if f"{package}.{name}" not in _directives()]
    assert not missing, f"{package}.__all__ names missing from docs/reference: {missing}"


def test_every_directive_names_an_object_that_exists():
    for target in sorted(_directives()):
        module, _, name = target.rpartition(".")
        try:
            importlib.import_module(target)
        except ModuleNotFoundError:
            assert hasattr(importlib.import_module(module), name), target


def test_the_nav_lists_every_page_and_only_pages_that_exist():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = set(re.findall(r"^\s+-\s+(?:[^:\n]+:\s+)?(\S+\.md)$", config, re.M))
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert nav == pages


def test_the_docs_extra_installs_the_site_tools_and_no_runtime_dependency_needs_them():
    setup = (ROOT / "setup.cfg").read_text(encoding="utf-8")
    extra = re.search(r"^docs =\n((?:    .+\n)+)", setup, re.M)
    assert extra, "setup.cfg lacks the docs extra"
    assert {"mkdocs", "mkdocstrings[python]"} <= {
        re.split(r"[<>=!~ ]", line.strip())[0] for line in extra.group(1).splitlines()}
    runtime = setup.split("install_requires =", 1)[1].split("\n\n", 1)[0]
    assert "mkdocs" not in runtime
