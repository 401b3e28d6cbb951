"""benchmarks/sequence_length.py: runs end to end at tiny sizes; targets. The documents'
table is checked against the committed results with the others (test_render_tables.py)."""
import json
from pathlib import Path

import pytest

from benchmarks import harness, sequence_length
from tests.benchmarks.conftest import cache_args

pytestmark = pytest.mark.slow


def test_runs_each_variant_in_a_worker_and_writes_outputs(tmp_path):
    payload = sequence_length.main(["--quick", *cache_args(), "--lengths", "256", "--steps", "1",
                                    "--out_dir", str(tmp_path)])
    saved = json.loads((tmp_path / "sequence_length.json").read_text())
    assert saved["results"] == json.loads(json.dumps(payload["results"]))
    rows = {(r["variant"], r["seq_len"]): r for r in saved["results"]}
    assert set(rows) == {(v, n) for v in sequence_length.VARIANTS for n in (256,)}
    for r in rows.values():
        assert "error" not in r, r.get("error")
        assert r["method"] == "ledger" and r["peak_bytes"] > 0 and r["step_s"] > 0
        assert 0 < r["fraction_of_matmul"] < 1 and r["model_flops"] > 0
    # Blockwise holds no 256 x 256 buffers: below the full path at the longer length.
    assert rows[("blockwise", 256)]["peak_bytes"] < rows[("full", 256)]["peak_bytes"]
    text = (tmp_path / "sequence_length.md").read_text()
    assert "| 256 | blockwise |" in text and "position table" in text
    for r in rows.values():
        assert r["build_s"] > 0
        per_dim = sequence_length.per_token_dim(r["peak_bytes"], r)
        assert f"{per_dim:.1f} (" in text   # B/tok/dim beside the floor
    assert (tmp_path / "sequence_length.png").read_bytes()[:4] == b"\x89PNG"


def _row(variant, length, peak_mib, rss_mib, step=1.0):
    return {"variant": variant, "seq_len": length, "peak_bytes": peak_mib * harness.MIB,
            "peak_rss_bytes": rss_mib * harness.MIB, "step_s": step, "method": "ledger",
            "d_model": 128, "n_heads": 4, "batch_size": 1, "first_step_s": 5.0}


def test_targets_use_the_runs_own_trax_rows():
    results = [_row("default", 16384, 200, 900), _row("default", 65536, 600, 1600),
               _row("trax_lsh", 65536, 0, 1500), _row("default", 8192, 100, 700),
               _row("full", 8192, 4000, 7000), _row("trax_full", 8192, 0, 5000)]
    checks = {c["target"]: c for c in sequence_length.targets(results)}
    assert not checks["64K peak device memory <= 512 MiB"]["met"]
    assert not checks["64K peak RSS <= Trax LSH's (1,500 MiB)"]["met"]
    assert checks["linear: 64K peak <= 4.5x 16K peak"]["value"] == "3.00x"
    assert checks["8K default peak <= 0.15x the full path's 4,180 MiB before"]["met"]
    assert checks["8K full path peak RSS <= Trax full attention's"]["value"] == "1.40x"


def test_lsh_targets_compare_with_trax_in_the_same_run_and_check_linearity():
    results = [_row("lsh", 16384, 160, 900, step=4.0), _row("lsh", 65536, 600, 1600, step=13.0),
               _row("trax_lsh", 65536, 0, 1700, step=20.0),
               _row("lsh", 524288, 3000, 9000, step=120.0)]
    checks = {c["target"]: c for c in sequence_length.targets(results)}
    assert not checks["LSH 64K peak device memory <= 512 MiB"]["met"]
    assert checks["LSH 64K step <= Trax LSH's step"]["value"] == "13.00 s vs 20.00 s (0.65x)"
    assert checks["LSH 64K peak RSS <= Trax LSH's (1,700 MiB)"]["met"]
    assert checks["LSH linear: 64K step time <= 4.5x 16K's"]["value"] == "3.25x"
    assert checks["LSH linear: 64K peak <= 4.5x 16K's"]["value"] == "3.75x"
    assert checks["LSH 512K: a step completes, peak device memory <= 4 GiB"]["met"]


def _mesh_row(kind, shape, peak_mib, step=1.0, values=(0.5, 1.0), round_=0):
    return {"kind": kind, "mesh": dict(zip(("data", "fsdp", "seq"), shape, strict=True)),
            "seq_len": 65536 if kind == "sequence" else 4096, "batch_size": 1,
            "peak_bytes": peak_mib * harness.MIB, "method": "ledger", "step_s": step,
            "device_values_bytes": values[0] * harness.MIB,
            "unsharded_values_bytes": values[1] * harness.MIB, "round": round_}


def test_mesh_targets_compare_seq_4_with_seq_1_and_the_hybrid_mesh_with_fsdp_4():
    from benchmarks import sequence_mesh
    results = [_mesh_row("sequence", (1, 1, 1), 600), _mesh_row("sequence", (1, 1, 4), 150),
               _mesh_row("hybrid", (2, 2, 1), 50, step=1.0, values=(0.52, 1.0)),
               _mesh_row("hybrid", (1, 4, 1), 40, step=1.2, values=(0.26, 1.0)),
               _mesh_row("hybrid", (2, 2, 1), 50, step=3.0, round_=1),
               _mesh_row("hybrid", (1, 4, 1), 40, step=1.1, round_=1)]
    checks = {c["target"]: c for c in sequence_mesh.targets(results)}
    seq = checks["length 65,536: per-device peak with seq=4 <= 0.3x seq=1's"]
    assert seq["value"] == "0.250x" and seq["met"]
    assert checks["(2,2,1): weights + slots per device = 0.5x unsharded"]["met"]
    step = checks["(2,2,1) step time <= (1,4,1)'s (fsdp=4), interleaved"]
    assert step["value"].startswith("2.000 s vs 1.150 s") and not step["met"]


def test_mesh_render_only_rewrites_the_markdown_without_running_a_worker(tmp_path, monkeypatch):
    from benchmarks import sequence_mesh
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    payload = json.loads((results / "sequence_mesh.json").read_text())
    (tmp_path / "sequence_mesh.json").write_text(json.dumps(payload))

    def no_worker(*args, **kwargs):
        raise AssertionError("--render_only ran a worker")

    monkeypatch.setattr(harness, "run_worker", no_worker)
    sequence_length.main(["--mesh", "--render_only", "--out_dir", str(tmp_path)])
    assert (tmp_path / "sequence_mesh.md").read_text() == sequence_mesh.markdown(payload)


def test_mesh_update_reruns_the_asked_runs_and_keeps_the_others(tmp_path, monkeypatch):
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    before = json.loads((results / "sequence_mesh.json").read_text())
    (tmp_path / "sequence_mesh.json").write_text(json.dumps(before))
    ran = []

    def worker(script, config, timeout):
        ran.append(config)
        return config | {"peak_bytes": harness.MIB, "method": "ledger", "step_s": 0.5,
                         "device_values_bytes": 1.0, "unsharded_values_bytes": 2.0}

    monkeypatch.setattr(harness, "run_worker", worker)
    payload = sequence_length.main(["--mesh", "--quick", "--mesh_runs=hybrid",
                                    "--mesh_rounds=1", "--update", "--out_dir", str(tmp_path)])
    assert {r["kind"] for r in ran} == {"hybrid"} and len(ran) == 2
    kept = [r for r in before["results"] if r["kind"] == "sequence"]
    assert len(kept) == 2
    got = payload["results"]
    assert [{k: v for k, v in r.items() if k not in ("measured", "processor")}
            for r in got[:2]] == kept
    assert all(r["measured"] == before["machine"]["date"] for r in got[:2])
    assert [r["kind"] for r in got[2:]] == ["hybrid", "hybrid"]
    assert json.loads((tmp_path / "sequence_mesh.json").read_text())["results"] == got


def test_floor_is_the_issues_23_bytes_per_token_and_dimension():
    config = {"seq_len": 65536, "d_model": 128, "n_heads": 4, "batch_size": 1}
    floor = sequence_length.floor_bytes(config)
    assert sequence_length.per_token_dim(floor, config) == 23.0
    assert round(floor / harness.MIB) == 184


def test_long_rows_run_one_step_and_only_lsh_above_the_exact_limit():
    args = sequence_length.parse_flags(["--lengths", "65536,1048576", "--trax_python",
                                        "python"])
    configs = {(c["variant"], c["seq_len"]): c for c in sequence_length.configurations(args)}
    assert {v for v, n in configs if n == 1048576} == {"lsh"}
    assert (configs[("lsh", 1048576)]["warmup"], configs[("lsh", 1048576)]["steps"]) == (0, 1)
    assert configs[("lsh", 65536)]["warmup"] == 1
    assert configs[("trax_lsh", 65536)]["trax_d_attention"] == 32   # matched: 128 // 4


def test_floor_targets_read_bytes_per_token_and_dimension():
    results = [_row("lsh", 65536, 250, 1200, step=10.0), _row("default", 65536, 300, 1300),
               _row("trax_lsh", 65536, 0, 1600, step=12.0),
               _row("lsh", 1048576, 3900, 5000, step=200.0)]
    checks = {c["target"]: c for c in sequence_length.targets(results)}
    assert checks["LSH + ff chunks 64K ledger <= 32 B/tok/dim"]["value"] == "31.2"
    assert not checks["default + ff chunks 64K ledger <= 32 B/tok/dim"]["met"]
    assert checks["LSH 1M: ledger <= 4 GiB, RSS <= 5.5 GiB"]["met"]
    assert checks["LSH 64K RSS <= 0.8x Trax LSH's"]["value"] == "0.75x"
