"""benchmarks/quality.py: a tiny run end to end (bytes and SentencePiece), and the targets
and summaries on made-up rows. The documents' table is checked with the others
(test_render_tables.py)."""
import json

import pytest

from benchmarks import quality

pytestmark = pytest.mark.slow


def test_a_tiny_run_writes_curves_bits_per_byte_and_outputs(tmp_path):
    payload = quality.main(["--quick", "--seeds", "1", "--steps", "2", "--eval_every", "1",
                            "--configurations", "rev_reversible,sentencepiece",
                            "--out_dir", str(tmp_path)])
    saved = json.loads((tmp_path / "quality.json").read_text())
    assert saved["results"] == json.loads(json.dumps(payload["results"]))
    rows = {r["variant"]: r for r in saved["results"]}
    for r in rows.values():
        assert "error" not in r, r.get("error")
        assert [p["step"] for p in r["curve"]] == [1, 2] and r["train_s"] > 0
        assert r["curve"][-1]["bits_per_byte"] == r["bits_per_byte"] > 0
        assert r["method"] == "ledger" and r["peak_bytes"] > 0
    assert rows["rev_reversible"]["vocab_size"] == 256
    assert rows["rev_reversible"]["bytes_per_token"] == 1
    assert rows["sentencepiece"]["vocab_size"] == 400
    assert rows["sentencepiece"]["bytes_per_token"] > 1
    text = (tmp_path / "quality.md").read_text()
    assert "SentencePiece vs bytes at equal wall time" in text
    assert (tmp_path / "quality.png").read_bytes()[:4] == b"\x89PNG"


def _row(variant, seed, bpb, train_s=10.0, curve=None):
    return {"variant": variant, "seed": seed, "bits_per_byte": bpb, "train_s": train_s,
            "peak_rss_bytes": 1, "peak_bytes": 1, "n_params": 10,
            "curve": curve or [{"step": 1, "train_s": train_s, "bits_per_byte": bpb}]}


def test_targets_compare_means_and_report_the_seed_spread():
    results = [_row("plain", 0, 3.00), _row("plain", 1, 3.02),
               _row("rev_reversible", 0, 3.005), _row("rev_reversible", 1, 3.025),
               _row("lsh8", 0, 3.02), _row("lsh8", 1, 3.03),
               _row("lsh2", 0, 3.10), _row("lsh2", 1, 3.12),
               _row("trax_full", 0, 2.98), _row("trax_full", 1, 2.99)]
    checks = {c["target"]: c for c in quality.targets(results)}
    exact = checks["Reversible + ReversibleSerialTrainer within 0.01 bpb of the plain "
                   "Transformer"]
    assert exact["met"] and exact["value"].startswith("+0.0050 (3.0150 ± 0.0141")
    assert checks["LSH-8 within 0.02 bpb of exact attention"]["met"]
    assert not checks["LSH-2 within 0.05 bpb of exact attention"]["met"]
    assert not checks["Reversible + ReversibleSerialTrainer within 0.02 bpb of Trax "
                      "ReformerLM full"]["met"]
    assert "LSH-4 gap to exact attention (reported)" not in checks  # No rows: no check.


def test_equal_wall_time_reads_the_subword_curve_at_the_byte_runs_time():
    curve = [{"step": 1, "train_s": 5.0, "bits_per_byte": 4.0},
             {"step": 2, "train_s": 15.0, "bits_per_byte": 2.0}]
    assert quality.at_wall_time(curve, 10.0) == pytest.approx(3.0)
    assert quality.at_wall_time(curve, 1.0) == 4.0 and quality.at_wall_time(curve, 99) == 2.0
    results = [_row("rev_reversible", 0, 3.5, train_s=10.0),
               _row("sentencepiece", 0, 2.0, train_s=15.0, curve=curve)]
    wall = quality.equal_wall_time(results)
    assert wall["seconds"] == 10.0 and wall["difference"] == pytest.approx(-0.5)
    [check] = [c for c in quality.targets(results) if "wall time" in c["target"]]
    assert check["value"].startswith("SentencePiece by 0.5000 bpb at 10 s")
