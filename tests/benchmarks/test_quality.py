"""benchmarks/quality.py: a tiny run end to end (bytes and SentencePiece), its flags, the
sized plain model, Trax's initial weights, and (with REVTRAIN_TRAX_PYTHON, a Python with
Trax 1.4.1) both frameworks on the same batches. The documents' table is checked with the
others (test_render_tables.py); the rule, targets and merge in test_quality_report.py."""
import json
import os

import pytest

from benchmarks import harness, quality, render_tables
from benchmarks import quality_report as qr
from benchmarks import quality_variants as qv
from benchmarks import quality_worker as worker
from tests.benchmarks.conftest import cache_args

TRAX_PYTHON = os.environ.get("REVTRAIN_TRAX_PYTHON")


@pytest.mark.slow
def test_a_tiny_run_writes_curves_bits_per_byte_and_outputs(tmp_path):
    payload = quality.main(["--quick", "--seeds", "1", "--steps", "2", "--eval_every", "1",
                            "--group", "tokenizer", *cache_args(),
                            "--out_dir", str(tmp_path)])
    saved = json.loads((tmp_path / "quality.json").read_text())
    assert saved["results"] == json.loads(json.dumps(payload["results"]))
    rows = {r["variant"]: r for r in saved["results"]}
    for r in rows.values():
        assert "error" not in r, r.get("error")
        assert [p["step"] for p in r["curve"]] == [1, 2] and r["train_s"] > 0
        assert r["curve"][-1]["bits_per_byte"] == r["bits_per_byte"] > 0
        assert r["method"] == "ledger" and r["peak_bytes"] > 0
    assert rows["bytes_alone"]["vocab_size"] == 256
    assert rows["bytes_alone"]["bytes_per_token"] == 1
    assert rows["sentencepiece"]["vocab_size"] == 400
    assert rows["sentencepiece"]["bytes_per_token"] > 1
    text = (tmp_path / "quality.md").read_text()
    assert "SentencePiece vs bytes at equal wall time" in text
    assert "(one seed: no spread)" in text and "± 0.0000" not in text
    assert (tmp_path / "quality.png").read_bytes()[:4] == b"\x89PNG"
    assert "Not converged (budget)" in text and "**no**" not in text
    for r in rows.values():
        assert len(r["load_avg"]) == 2 and r["measured"] and r["host"]
        assert r["commit"] == harness.machine_info()["commit"]


@pytest.mark.slow
def test_two_workers_at_once_give_the_same_bits_per_byte_and_say_so(tmp_path):
    # Two workers on disjoint CPUs train the same batches from the same key: the rows
    # equal one run alone, and the table marks their wall times as not idle ones.
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    argv = ["--quick", *cache_args(), "--seeds", "1", "--steps", "2", "--eval_every", "1",
            "--configurations", "plain,rev_trainer"]
    alone = quality.main([*argv, "--out_dir", str(tmp_path / "alone")])
    both = quality.main([*argv, "--jobs", "2", "--out_dir", str(tmp_path / "both")])
    for a, b in zip(alone["results"], both["results"], strict=True):
        assert (a["variant"], a["jobs"], b["jobs"]) == (b["variant"], 1, 2)
        assert b["bits_per_byte"] == pytest.approx(a["bits_per_byte"], abs=1e-6)
    assert "(2 workers at once)" in (tmp_path / "both" / "quality.md").read_text()
    assert "workers at once" not in (tmp_path / "alone" / "quality.md").read_text()


def test_cpu_slots_deal_the_cpus_into_disjoint_sets():
    cpus = sorted(os.sched_getaffinity(0))
    assert harness.cpu_slots(1) is None
    slots = harness.cpu_slots(len(cpus))
    assert sorted(c for slot in slots for c in slot) == cpus and all(slots)
    with pytest.raises(ValueError, match=f"--jobs={len(cpus) + 1}: this process may use"):
        harness.cpu_slots(len(cpus) + 1)


def _row(variant, seed, bpb, train_s=10.0, curve=None):
    return {"variant": variant, "seed": seed, "bits_per_byte": bpb, "train_s": train_s,
            "peak_rss_bytes": 1, "peak_bytes": 1, "n_params": 10,
            "curve": curve or [{"step": 1, "train_s": train_s, "bits_per_byte": bpb}]}


def test_targets_compare_means_and_report_the_seed_spread():
    results = [_row("plain_params", 0, 3.00), _row("plain_params", 1, 3.02),
               _row("rev_reversible", 0, 3.005), _row("rev_reversible", 1, 3.025),
               _row("lsh8", 0, 3.02), _row("lsh8", 1, 3.03),
               _row("lsh2", 0, 3.10), _row("lsh2", 1, 3.12),
               _row("abl_pos_trained", 0, 3.005), _row("abl_pos_trained", 1, 3.025),
               _row("trax_full", 0, 2.98), _row("trax_full", 1, 2.99)]
    checks = {c["target"]: c for c in qr.targets(results)}
    exact = checks["Reversible + ReversibleSerialTrainer within 0.01 bpb of the plain "
                   "Transformer at equal parameters"]
    assert exact["met"] and exact["value"].startswith("+0.0050 (3.0150 ± 0.0141")
    assert checks["LSH-8 within 0.02 bpb of exact attention"]["met"]
    assert not checks["LSH-2 within 0.05 bpb of exact attention"]["met"]
    assert not checks["revtrain, trained positions within 0.02 bpb of Trax ReformerLM "
                      "full (matched but the random draws)"]["met"]
    assert "LSH-4 gap to exact attention (reported)" not in checks  # No rows: no check.


def test_equal_wall_time_reads_the_subword_curve_at_the_byte_runs_time():
    curve = [{"step": 1, "train_s": 5.0, "bits_per_byte": 4.0},
             {"step": 2, "train_s": 15.0, "bits_per_byte": 2.0}]
    assert qr.at_wall_time(curve, 10.0) == pytest.approx(3.0)
    assert qr.at_wall_time(curve, 1.0) == 4.0 and qr.at_wall_time(curve, 99) == 2.0
    results = [_row("bytes_alone", 0, 3.5, train_s=10.0),
               _row("sentencepiece", 0, 2.0, train_s=15.0, curve=curve)]
    wall = qr.equal_wall_time(results)
    assert wall["seconds"] == 10.0 and wall["difference"] == pytest.approx(-0.5)
    [check] = [c for c in qr.targets(results) if "wall time" in c["target"]]
    assert check["value"].startswith("SentencePiece by 0.5000 bpb at 10 s")
    assert check["value"].endswith("; 1 seed)") and wall["seeds"] == 1
    # A row that shared the machine with another worker has no comparable seconds.
    assert qr.equal_wall_time([results[0] | {"jobs": 2}, results[1]]) is None


@pytest.mark.parametrize("argv, message", [
    (["--configurations", "plain,lsh3"], "unknown 'lsh3'"),
    (["--configurations", "trax_full"], "trax_full needs Trax: pass --trax_python"),
    (["--group", "main", "--configurations", "plain"], "--group and --configurations"),
    (["--lsh_chunk_len", "64", "--long_seq_len", "64"], "--lsh_chunk_len=64 covers"),
    (["--group", "tokenizer", "--jobs", "2"], "--jobs=2: bytes_alone is timed"),
    (["--jobs", "4096"], "--jobs=4096: this process may use"),
])
def test_bad_settings_are_refused_before_anything_runs(argv, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        quality.main(["--quick", "--out_dir", str(tmp_path), *argv])
    assert not list(tmp_path.iterdir())


def test_update_refuses_other_settings_before_training(tmp_path):
    (tmp_path / "quality.json").write_text(json.dumps(
        {"config": {"steps": 999}, "results": [], "machine": {}}))
    with pytest.raises(ValueError, match="other settings"):
        quality.main(["--quick", "--update", "--configurations", "plain",
                      "--out_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="does not exist"):
        quality.main(["--quick", "--update", "--out_dir", str(tmp_path / "none")])


def test_the_pilot_file_sets_the_steps_and_groups_set_the_configurations(tmp_path):
    (tmp_path / quality.PILOT).write_text(json.dumps({"steps": 1234}))
    args = quality.parse_flags(["--quick", "--group", "lsh", "--out_dir", str(tmp_path)])
    assert args.steps == args.pilot_steps == 1234
    assert args.configurations == qv.GROUPS["lsh"]
    configs = quality.configurations(args)
    assert len(configs) == 2 * len(qv.GROUPS["lsh"]) and configs[0]["long_seq_len"] == 64
    args = quality.parse_flags(["--quick", "--steps", "7", "--out_dir", str(tmp_path)])
    assert args.steps == 7 and args.pilot_steps is None
    assert args.configurations == qv.DEFAULT_VARIANTS


def test_the_sized_plain_model_matches_the_reversible_ones_parameters_within_1_percent():
    config = quality.configurations(quality.parse_flags(["--quick"]))[0]
    spec = qv.VARIANTS["plain_params"]
    d_ff = worker.sized_d_ff(config, spec, 256)
    rev = worker.n_params(worker.model_fn(config, qv.VARIANTS["rev_reversible"], 256), 32)
    plain = worker.n_params(worker.model_fn(config, spec, 256, d_ff), 32)
    assert d_ff > config["d_ff"] and abs(plain - rev) <= 0.01 * rev
    wide = worker.n_params(worker.model_fn(config, qv.VARIANTS["plain"], 256), 32)
    assert abs(wide - rev) > 0.01 * rev  # Equal width is not equal parameters here.


def test_lsh_rows_run_at_the_long_length_with_chunks_shorter_than_it():
    config = quality.configurations(quality.parse_flags(["--quick"]))[0]
    spec = qv.VARIANTS["lsh2"]
    assert worker.seq_len(config, spec) == 64 > config["chunk_len"]
    assert worker.batch_size(config, spec) * 64 == config["batch_size"] * config["seq_len"]
    defaults = quality.DEFAULTS
    assert defaults["long_seq_len"] >= 512 and defaults["chunk_len"] == 64


def test_trax_initial_weights_of_another_shape_are_refused_naming_the_leaf(tmp_path):
    import numpy as np

    class Built:
        flat_layers = ()

        @staticmethod
        def initial_values():
            return {"weights": ((np.zeros((4, 2)),), (np.zeros(2), np.zeros(3)))}

    np.savez(tmp_path / "w.npz", np.zeros((4, 2)), np.zeros(2), np.zeros(5))
    with pytest.raises(ValueError, match="first difference at leaf 2"):
        worker.load_initial_weights(Built, str(tmp_path / "w.npz"))


def test_the_committed_results_render_their_own_verdict():
    # The table says what the results file holds: the convergence rule's verdict, and
    # targets judged only on a converged run, each with its seed spread.
    payload = json.loads((render_tables.RESULTS_DIR / "quality.json").read_text())
    converged = qr.convergence(payload)["converged"]
    table = render_tables.quality()
    assert ("Converged: " if converged else "Not converged (budget): ") in table
    target_rows = [line for line in table.splitlines() if line.startswith("| ")
                   and line.rstrip().endswith(("| yes |", "| **no** |",
                                               "| not converged (budget) |"))]
    assert target_rows
    assert converged == ("not converged (budget)" not in table)
    for row in target_rows:
        if "within" in row:
            assert "per seed" in row, row


@pytest.mark.slow
@pytest.mark.skipif(not TRAX_PYTHON, reason="set REVTRAIN_TRAX_PYTHON to a Python with Trax")
def test_trax_from_the_same_initial_weights_tracks_revtrain(tmp_path):
    """Same batches, same initial weights, same optimizer: the two frameworks' train
    losses and held-out bits per byte agree to float32 rounding (about 5e-6 at the quick
    size). Before the worker dropped ReformerLM's ShiftRight, Trax predicted the byte
    after next on the same batches, and its losses differed."""
    payload = quality.main(["--quick", "--seeds", "1", "--steps", "6", "--eval_every", "3",
                            "--configurations", "abl_init_trax,trax_full",
                            "--trax_python", TRAX_PYTHON, "--out_dir", str(tmp_path)])
    rows = {r["variant"]: r for r in payload["results"]}
    for r in rows.values():
        assert "error" not in r, r.get("error")
    ours, theirs = rows["abl_init_trax"], rows["trax_full"]
    assert ours["n_params"] == theirs["n_params"]
    for a, b in zip(ours["curve"], theirs["curve"], strict=True):
        assert abs(a["bits_per_byte"] - b["bits_per_byte"]) < 1e-3
    for a, b in zip(ours["train_losses"], theirs["train_losses"], strict=True):
        assert abs(a - b) < 1e-3


def _fake_run(curve_values):
    def run_one(args, config, tmp, cpus=None):
        curve = [{"step": (i + 1) * args.eval_every, "bits_per_byte": v, "train_s": 1.0 + i,
                  "loss": v} for i, v in enumerate(curve_values)]
        return config | {"curve": curve, "bits_per_byte": curve[-1]["bits_per_byte"],
                         "train_s": 3.0, "n_params": 5, "peak_bytes": 1,
                         "peak_rss_bytes": 1, "load_avg": [0.5, 0.7], "measured": "now",
                         "host": "cpu"}
    return run_one


def test_the_pilot_writes_the_step_count_at_which_the_plain_curve_flattened(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setattr(quality, "run_one", _fake_run([4.0, 3.0, 2.5, 2.45, 2.44, 2.44,
                                                       2.435, 2.43]))
    pilot = quality.main(["--quick", "--pilot", "--out_dir", str(tmp_path)])
    saved = json.loads((tmp_path / quality.PILOT).read_text())
    assert saved["steps"] == pilot["steps"] == 10  # eval_every 2: flat from the 5th point.
    assert quality.parse_flags(["--quick", "--out_dir", str(tmp_path)]).steps == 10
    assert saved["config"]["variant"] == "plain" and saved["config"]["seed"] == 0
    line = quality.pilot_settings(saved)  # The line under the quality table.
    assert "flattened at 10 steps, the budget of a converged run" in line, line


def test_update_runs_merge_into_one_file_and_a_converged_run_judges_its_targets(
        tmp_path, monkeypatch):
    flat = [4.0, 3.0, 2.5, 2.45, 2.44]
    monkeypatch.setattr(quality, "run_one", _fake_run(flat))
    common = ["--quick", "--steps", "10", "--seeds", "2", "--out_dir", str(tmp_path)]
    quality.main([*common, "--configurations", "plain,plain_params"])
    payload = quality.main([*common, "--update", "--configurations", "rev_reversible"])
    assert sorted({r["variant"] for r in payload["results"]}) == [
        "plain", "plain_params", "rev_reversible"]
    assert len(payload["runs"]) == 2 and payload["convergence"]["converged"]
    text = (tmp_path / "quality.md").read_text()
    assert "Converged: the last 20% of the steps" in text
    assert "| Reversible + ReversibleSerialTrainer within 0.01 bpb of the plain Transformer " \
           "at equal parameters | +0.0000" in text and qr.NOT_CONVERGED not in text


def test_a_group_split_by_seed_merges_into_the_file_of_one_run(tmp_path, monkeypatch):
    """``--seed=K --seeds=1`` runs seed K alone; merged by --update, the rows are those of
    one run over all the seeds (a row depends only on its configuration and seed)."""
    def run_one(args, config, tmp, cpus=None):
        bits = 2.0 + config["seed"] / 10 + len(config["variant"]) / 100
        return _fake_run([bits])(args, config, tmp, cpus)

    monkeypatch.setattr(quality, "run_one", run_one)
    common = ["--quick", "--steps", "2", "--configurations", "plain,rev_reversible"]
    whole = quality.main([*common, "--seeds", "3", "--out_dir", str(tmp_path / "whole")])
    split = tmp_path / "split"
    quality.main([*common, "--seeds", "1", "--out_dir", str(split)])
    for seed in ("2", "1"):
        merged = quality.main([*common, "--update", "--seed", seed, "--seeds", "1",
                               "--out_dir", str(split)])

    def rows(payload):
        return sorted((r["variant"], r["seed"], r["bits_per_byte"])
                      for r in payload["results"])

    assert rows(merged) == rows(whole) and len(rows(whole)) == 6


def test_the_readme_table_leaves_out_the_rows_that_only_measure_an_ablation_factor(
        tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "run_one", _fake_run([3.0, 2.5]))
    payload = quality.main(["--quick", "--steps", "2", "--seeds", "1", "--out_dir",
                            str(tmp_path), "--configurations", "rev_reversible,abl_eps"])
    ablation_row = f"| {qv.VARIANTS['abl_eps'].label} |"
    assert ablation_row not in quality.summary_tables(payload)
    assert f"| {qv.VARIANTS['rev_reversible'].label} |" in quality.summary_tables(payload)
    assert ablation_row in quality.tables(payload)  # docs/benchmarks.md: every row.
    assert "abl_eps" in qv.ABLATION_ONLY and "trax_full" not in qv.ABLATION_ONLY
    # Trax's row keeps its closest revtrain match beside it in the README.
    assert "abl_init_trax" not in qv.ABLATION_ONLY and "abl_pos_trained" in qv.ABLATION_ONLY
    assert "abl_lsh8_pos_trained" not in qv.ABLATION_ONLY
    assert "abl_long_pos_trained" in qv.ABLATION_ONLY
