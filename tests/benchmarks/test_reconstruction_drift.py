"""benchmarks/reconstruction_drift.py: runs end to end at tiny sizes; table and render."""
import json

import pytest

import revtrain.models
from benchmarks import reconstruction_drift

pytestmark = pytest.mark.slow

TINY = ["--quick", "--depths", "1", "--compute_dtypes", "bfloat16", "--keep_every_values",
        "2"]


def test_measures_drift_and_gradients_and_writes_outputs(tmp_path):
    payload = reconstruction_drift.main(TINY + ["--out_dir", str(tmp_path)])
    saved = json.loads((tmp_path / "reconstruction_drift.json").read_text())
    assert saved["results"] == json.loads(json.dumps(payload["results"]))
    by_keep = {r["keep_every"]: r for r in saved["results"]}
    assert set(by_keep) == {None, 2}
    for r in by_keep.values():
        assert len(r["errors"]) == 4  # One model layer: 4 reversible layers.
        assert 0 <= r["median_error"] <= r["worst_error"] < 1e-2
        assert 0 <= r["worst_gradient_error"] < 2e-2
    assert by_keep[2]["errors"][2] == 0.0 and by_keep[2]["kept_copies"] == 1
    assert by_keep[2]["kept_bytes"] > by_keep[None]["kept_bytes"] > 0
    markdown = (tmp_path / "reconstruction_drift.md").read_text()
    assert "| 1 | bfloat16 | - | 2 | 1 |" in markdown
    assert (tmp_path / "reconstruction_drift.png").read_bytes()[:4] == b"\x89PNG"
    again = reconstruction_drift.main(TINY + ["--out_dir", str(tmp_path), "--render_only"])
    assert again["results"] == saved["results"]


def test_mask_bits_reach_the_model_and_the_settings_line(tmp_path, monkeypatch):
    built = []
    make = revtrain.models.ReversibleTransformerLM

    def recording(**kwargs):
        built.append(kwargs.get("dropout_mask_bits", 16))
        return make(**kwargs)
    monkeypatch.setattr(revtrain.models, "ReversibleTransformerLM", recording)
    payload = reconstruction_drift.main(TINY + ["--out_dir", str(tmp_path), "--dropout",
                                                "0.1", "--mask_bits", "8"])
    assert built and set(built) == {8}
    assert payload["config"]["mask_bits"] == 8
    assert "dropout 0.1 (8-bit masks)" in (tmp_path / "reconstruction_drift.md").read_text()
