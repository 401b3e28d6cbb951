"""benchmarks/memory_budget.py: the accuracy part end to end at tiny sizes; the caps and
deep parts' configurations, comparisons and tables on given results."""
import json

import pytest

from benchmarks import budget_worker, harness, memory_budget, memory_budget_caps, render_tables
from revtrain.trainers import Trainer
from tests.benchmarks.conftest import cache_args

TWO = ["trainer-d2-L32-b2-default", "reversible-d2-L64-b1-lsh"]
SPLIT = ("predicted_weights_bytes", "predicted_slots_bytes", "predicted_state_bytes",
         "predicted_activation_bytes", "predicted_temp_bytes")


@pytest.mark.slow
def test_quick_accuracy_predicts_each_peak_within_ten_percent(tmp_path):
    payload = memory_budget.main(
        ["--part=accuracy", "--quick", f"--accuracy_configs={','.join(TWO)}", "--out_dir",
         str(tmp_path), *cache_args()])
    saved = json.loads((tmp_path / "memory_budget.json").read_text())
    assert saved["results"] == json.loads(json.dumps(payload["results"]))
    assert [r["id"] for r in saved["results"]] == TWO
    for r in saved["results"]:
        assert "error" not in r, r.get("error")
        assert r["method"] == "ledger" and r["peak_bytes"] > 0
        assert r["predicted_peak_bytes"] == sum(r[k] for k in SPLIT)
        assert abs(r["ratio"] - 1.0) <= memory_budget.TOLERANCE, r
        assert r["ratio"] == r["predicted_peak_bytes"] / r["peak_bytes"]
        assert r["predicted_peak_program"] and r["peak_label"]
        assert r["estimate_s"] > 0 and r["rss_after_estimate_bytes"] > 0
        assert len(r["load_before"]) == len(r["load_after"]) == 3
    assert saved["results"][1]["attention"] == "lsh"
    (target,) = saved["targets"]
    assert target["met"] and target["value"].startswith("2/2; worst ")
    assert {"date", "processor", "cpu_count", "jax"} <= set(saved["machine"])
    text = (tmp_path / "memory_budget.md").read_text()
    assert f"| {TWO[1]} | 1 |" in text and "Worst case: " in text


class _TrainerWithoutRemat(Trainer):
    """`Trainer` as it was before its ``remat`` option."""

    def __init__(self, model_with_loss, optimizer_fn, **options):
        if "remat" in options:
            raise TypeError("Trainer.__init__() got an unexpected keyword argument 'remat'")
        super().__init__(model_with_loss, optimizer_fn, **options)


def test_remat_is_estimated_and_a_trainer_refusing_it_is_skipped(monkeypatch):
    config = budget_worker.spec_config(
        budget_worker.base_config(memory_budget.QUICK_MODEL, 0, None), "trainer_remat", 2,
        16, 2, "default")
    assert budget_worker.predict(config)["predicted_peak_bytes"] > 0
    with_options = budget_worker.trainer_and_options
    monkeypatch.setattr(budget_worker, "trainer_and_options", lambda kind, n_devices=None: (
        _TrainerWithoutRemat, with_options(kind, n_devices)[1]))
    result = budget_worker.predict(config)
    assert result["skipped"] == budget_worker.NO_REMAT == "Trainer has no remat option"
    assert "remat" in result["refusal"]
    assert not budget_worker.refused_remat({}, TypeError("unexpected keyword 'remat'"))


def test_configurations_cover_the_trainers_depths_and_lengths():
    args = memory_budget.parse_flags(["--part=accuracy"])
    configs = memory_budget.accuracy_configs(args)
    assert len(configs) >= 16 and len({c["id"] for c in configs}) == len(configs)
    assert {c["trainer"] for c in configs} == set(harness.TRAINERS)
    assert {min(c["depth"] for c in configs), max(c["depth"] for c in configs)} == {2, 32}
    assert {c["seq_len"] for c in configs} >= {512, 16384, 65536}
    assert all(c["n_devices"] == (4 if c["trainer"] in harness.FSDP_KINDS else 1)
               for c in configs)
    with pytest.raises(SystemExit, match="'nope' is not one of trainer-d2-L512-b8-default"):
        memory_budget.accuracy_configs(memory_budget.parse_flags(["--accuracy_configs=nope"]))
    deep = memory_budget.deep_configs(memory_budget.parse_flags(
        ["--part=deep", "--deep_predict_only=65536x32", "--trainers=reversible"]))
    assert [(c["seq_len"], c["depth"], c["predict_only"]) for c in deep] == [
        (16384, 12, False), (16384, 32, False), (65536, 12, False), (65536, 32, True)]


def _result(id_, predicted, measured):
    return {"id": id_, "trainer": "reversible", "n_devices": 1, "predicted_peak_bytes": predicted,
            "peak_bytes": measured, "ratio": predicted / measured}


def test_the_worst_case_is_the_ratio_furthest_from_one():
    results = [_result("a", 100, 100), _result("b", 88, 100), _result("c", 108, 100),
               {"id": "d", "trainer": "trainer_remat", "skipped": budget_worker.NO_REMAT}]
    assert memory_budget.worst(results)["id"] == "b"
    (target,) = memory_budget.targets(results)
    assert target["value"] == "2/3; worst 0.880x (b)" and not target["met"]
    assert memory_budget.targets(results[:1] + results[2:])[0]["met"]
    table = memory_budget.accuracy_table({"results": results})
    assert "| b | 0.0 | 0.0 | 0.880 |" in table and "| d | — | — | skipped |" in table
    assert "Worst case: b (ReversibleSerialTrainer, 1 device)" in table


def test_caps_span_the_smallest_peak_to_trainers_largest_under_the_margin():
    caps = memory_budget_caps.choose_caps(10 * 2**20, 2**30, 3, 0.1)
    assert caps[0] * 0.9 >= 10 * 2**20 and caps[-1] * 0.9 >= 2**30 > caps[-1] * 0.8
    assert caps[1] / caps[0] == pytest.approx(caps[2] / caps[1], rel=1e-6)
    assert memory_budget_caps.choose_caps(10 * 2**20, 2**30, 1, 0.1) == [caps[-1]]


def _choice(kind, batch, fits=True, tokens=1000.0):
    return {"kind": kind, "batch_size": batch, "fits": fits, "predicted_peak_bytes": 1,
            "predicted_tokens_per_s": tokens}


def _measured(kind, batch, tokens, peak):
    return {"trainer": kind, "batch_size": batch, "tokens_per_s": tokens, "peak_bytes": peak,
            "peak_rss_bytes": 10 * peak,
            "id": f"{kind}-b{batch}", "load_before": [1.0] * 3, "load_after": [1.0] * 3}


def _planned():
    return {"caps": [
        {"cap_bytes": 1000, "pick": "memory_efficient",
         "choices": [_choice("memory_efficient", 4), _choice("reversible", 2),
                     _choice("trainer", 1, fits=False)]},
        {"cap_bytes": 5000, "pick": "trainer",
         "choices": [_choice("trainer", 8), _choice("reversible", 8)]}]}


def test_the_pick_is_compared_with_the_fastest_measured_within_the_cap():
    measured = [_measured("memory_efficient", 4, 500.0, 900),
                _measured("reversible", 2, 800.0, 950), _measured("trainer", 8, 3000.0, 5200),
                _measured("reversible", 8, 2000.0, 3000)]
    low, high = memory_budget_caps.compare(_planned(), measured)
    assert (low["measured_best"], low["pick_vs_best"]) == ("reversible", 500.0 / 800.0)
    # Trainer is faster but over the cap: the best within it is ReversibleSerialTrainer.
    assert (high["measured_best"], high["pick_vs_best"]) == ("reversible", 1.5)
    worst, within = memory_budget_caps.targets([{"caps": [low, high]}])
    assert worst["value"] == "worst 0.62x (2 caps)" and not worst["met"]
    assert within["value"] == "1/2" and not within["met"]


def test_caps_tables_and_plot_are_written_from_the_results(tmp_path, monkeypatch):
    measured = [_measured("memory_efficient", 4, 500.0, 900),
                _measured("reversible", 2, 800.0, 950), _measured("trainer", 8, 3000.0, 4000),
                _measured("reversible", 8, 2000.0, 3000)]
    settings = memory_budget_caps.ROWS["d256"] | {"kinds": list(memory_budget_caps.KINDS)}
    payload = {"benchmark": memory_budget_caps.NAME,
               "machine": {"date": "2026-12-06T00:00:00", "processor": "cpu", "cpu_count": 2,
                           "jax": "0"},
               "config": {"margin": 0.1, "steps": 3, "warmup": 1},
               "rows": [{"row": "d256", "settings": settings, "measured": measured,
                         "plan": {"skipped_kinds": {"trainer_remat": budget_worker.NO_REMAT},
                                  "caps": [{"plan_s": 2.0}]},
                         "caps": memory_budget_caps.compare(_planned(), measured)}]}
    table = memory_budget_caps.table(payload)
    assert "| 0.0 | — | b 2: 800 (1,000) | b 4: 500 (1,000) | MemoryEfficientTrainer | " \
           "ReversibleSerialTrainer | 0.62 |" in table
    assert "Trainer + remat: skipped: Trainer has no remat option. Measured / predicted " \
           "tokens/s (the planner's cost model): 0.50x to 3.00x." in table
    assert memory_budget_caps.plot(tmp_path / "caps.png", payload)
    assert (tmp_path / "caps.png").read_bytes()[:4] == b"\x89PNG"
    # The documents' table: a placeholder until the JSON exists, then the results.
    monkeypatch.setattr(render_tables, "RESULTS_DIR", tmp_path)
    assert render_tables.memory_budget_caps().startswith("Not measured yet: `python "
                                                         "benchmarks/memory_budget.py --part=caps`")
    (tmp_path / "memory_budget_caps.json").write_text(json.dumps(payload))
    monkeypatch.setattr(render_tables, "load",
                        lambda name: json.loads((tmp_path / f"{name}.json").read_text()))
    rendered = render_tables.memory_budget_caps()
    assert table.rstrip("\n") in rendered and "memory_budget_caps.json`: 2026-12-06" in rendered
