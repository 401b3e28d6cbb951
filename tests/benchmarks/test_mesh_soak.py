"""benchmarks/mesh_soak.py: issue 40's mesh soak runs end to end at a tiny size, beside a
busy process, and says in one line why it failed when it does."""
import json
import os
import subprocess
import sys

from benchmarks import mesh_soak

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_mesh_that_deadlocked_trains_beside_a_busy_process(tmp_path):
    # Two meshes: (1, 2, 2), the one that deadlocked on a loaded machine before
    # `revtrain.parallel.cpu_collectives`, and one device, whose losses the check compares it
    # with. `.ci/run` runs the script itself on every mesh after the suite.
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "mesh_soak.py"), "--steps", "2",
         "--d_model", "16", "--seq_len", "16", "--vocab_size", "32", "--neighbours", "1",
         "--max_seconds", "600", "--trainers", "ReversibleSerialTrainer",
         "--meshes", "1x1x1,1x2x2",
         "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    runs = json.loads(out.read_text())
    assert [tuple(r["mesh"]) for r in runs] == [(1, 1, 1), (1, 2, 2)]
    assert all(len(r["losses"]) == 2 for r in runs)
    assert "2 runs beside 1 busy processes" in run.stdout


def test_the_check_names_what_went_wrong():
    run = {"mesh": [1, 2, 2], "trainer": "Trainer", "losses": [2.0, 1.0]}
    assert mesh_soak._check([run], 1, 1e-3) is None
    assert mesh_soak._check([run], 2, 1e-3) == "1 of 2 runs finished"
    nan = dict(run, losses=[2.0, float("nan")])
    assert "non-finite loss on mesh [1, 2, 2]" in mesh_soak._check([nan], 1, 1e-3)
    apart = dict(run, losses=[2.0, 1.1])
    assert "final losses differ by 0.1" in mesh_soak._check([run, apart], 2, 1e-3)
    stderr = ("F1204 rendezvous.cc:161] [id=0] Termination timeout for `all reduce` of 40 "
              "seconds exceeded.\n    @     0x7f  xla::cpu::AllReduceThunk::Execute()\n")
    assert mesh_soak._last_error(stderr).endswith("40 seconds exceeded.")
