"""Two local processes on CPU run revtrain-train through jax.distributed (gloo collectives).

Checks the multi-host plumbing of the loop and CLI: `jax.distributed.initialize` from
flags, each process reading its own half of the global batch, the
`sync_global_devices` barriers around checkpoint saves, eval sums combined across
processes, and only process 0 writing metrics and config.gin.
"""
import os
import re
import socket
import subprocess
import sys

import pytest

from revtrain.training import read_metrics

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs")
BINDINGS = [
    "ReversibleTransformerLM.d_model=16", "ReversibleTransformerLM.d_ff=32",
    "ReversibleTransformerLM.n_layers=1", "ReversibleTransformerLM.n_heads=2",
    "CopyTask.batch_size=4", "CopyTask.length=4", "train.steps=6", "train.eval_every=3",
    "train.checkpoint_every=3", "train.log_every=3", "train.eval_steps=2",
    "train.progress=False",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("multihost"))
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    procs = []
    for process_id in range(2):
        argv = [sys.executable, "-c", "from revtrain.cli import run_train; run_train()",
                f"--config_file={os.path.join(CONFIGS, 'copy_task.gin')}",
                f"--output_dir={out}", f"--coordinator_address=localhost:{port}",
                "--num_processes=2", f"--process_id={process_id}"]
        argv += [f"--gin_bindings={b}" for b in BINDINGS]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=240)
        results.append((proc.returncode, stdout, stderr))
    return out, results


def test_both_processes_finish_and_agree_on_eval(two_process_run):
    out, results = two_process_run
    for status, _, stderr in results:
        assert status == 0, stderr[-2000:]
        assert "saved the checkpoint of step 6" in stderr
    evals = [re.findall(r"step 6 eval: (.*)", stderr) for _, _, stderr in results]
    assert evals[0] and evals[0] == evals[1]  # Eval sums are combined across processes.
    assert "final eval at step 6" in results[0][1]
    assert "final eval" not in results[1][1]  # Only process 0 prints (gloo says hello).


def test_checkpoints_and_metrics_written_once(two_process_run):
    out, _ = two_process_run
    steps = sorted(d for d in os.listdir(os.path.join(out, "checkpoints")) if d.isdigit())
    assert steps == ["3", "6"]
    assert [r["step"] for r in read_metrics(out, "train")] == [3, 6]
    assert [r["step"] for r in read_metrics(out, "eval")] == [3, 6]
    assert os.path.isfile(os.path.join(out, "config.gin"))


def test_processes_train_one_model(two_process_run):
    _, results = two_process_run
    norms = [re.findall(r"step 6 train: .*weights_l2 (\S+)", stderr)
             for _, _, stderr in results]
    grads = [re.findall(r"step 3 train: .*gradients_l2 (\S+)", stderr)
             for _, _, stderr in results]
    assert norms[0] == norms[1] and grads[0] == grads[1]
