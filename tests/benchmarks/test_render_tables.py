"""benchmarks/render_tables.py: every benchmark table in the README and docs/ is the one
the committed results give, and every committed result set is shown somewhere."""
import json

import pytest

from benchmarks import render_tables
from benchmarks.harness import RESULTS_DIR

pytestmark = pytest.mark.slow


def test_no_document_table_differs_from_the_results():
    assert render_tables.stale() == [], (
        "a benchmark table differs from benchmarks/results; run "
        "python benchmarks/render_tables.py")


def test_a_changed_figure_is_found_and_rewritten(tmp_path):
    fresh = render_tables.render("# Page\n<!-- table: summary -->\n<!-- end table -->\n")
    assert "| ReversibleSerialTrainer |" in fresh and "memory_vs_depth.json" in fresh
    doc = tmp_path / "page.md"
    doc.write_text(fresh)
    assert render_tables.stale([doc]) == []
    doc.write_text(fresh.replace("| ReversibleSerialTrainer | ", "| ReversibleSerialTrainer | 1"))
    assert render_tables.stale([doc]) == [str(doc)]
    assert render_tables.render(doc.read_text()) == fresh


def test_every_table_is_used_and_every_result_set_feeds_one(monkeypatch):
    assert render_tables.used_tables() == set(render_tables.TABLES)
    read = set()
    load = render_tables.load
    monkeypatch.setattr(render_tables, "load", lambda name: read.add(name) or load(name))
    for table in render_tables.TABLES.values():
        table()
    committed = {str(p.relative_to(RESULTS_DIR).with_suffix("")) for p in
                 RESULTS_DIR.rglob("*.json") if "tmp" not in p.relative_to(RESULTS_DIR).parts}
    assert committed == read, "result sets that no table shows: render them or remove them"


def test_each_result_set_records_date_machine_and_settings():
    for path in RESULTS_DIR.rglob("*.json"):
        payload = json.loads(path.read_text())
        assert {"date", "processor", "cpu_count", "jax"} <= set(payload["machine"]), path
        assert payload["config"], path


@pytest.mark.parametrize("text, message", [
    ("<!-- table: nonesuch -->\n<!-- end table -->\n", "unknown table 'nonesuch'"),
    ("<!-- table: summary -->\nno end\n", "'summary' has no '<!-- end table -->'"),
])
def test_bad_markers_are_one_line_errors(text, message):
    with pytest.raises(ValueError, match=message):
        render_tables.render(text, "page.md")
