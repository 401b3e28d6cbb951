"""Two local processes on CPU run revtrain-train through jax.distributed (gloo collectives).

Checks the multi-host plumbing of the loop and CLI: `jax.distributed.initialize` from
flags, each process reading its own half of the global batch, the
`sync_global_devices` barriers around checkpoint saves, eval sums combined across
processes, and only process 0 writing metrics and config.gin. And the invariance: two
processes of two devices each train exactly what one process of four devices and one
device train on the same global batches (losses, gradient norms, checkpointed weights) --
also with ``RunConfig.fsdp=True`` on 2 x 2 devices (a wider model, so its kernels are
sharded across the processes and each process saves only its shards), against one process
of 4 devices without it. The FSDP runs are parametrised by trainer; a trainer that does
not take ``fsdp`` is not run and its test is skipped, naming it.
"""
import os
import re
import socket
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from revtrain.training import read_metrics

pytestmark = pytest.mark.multiprocess

# A self-contained copy-task run with plain SGD at a constant rate and no dropout, so a
# gradient scaled by the process or device count would show in the weights directly.
CONFIG = """
RunConfig.model = @ReversibleTransformerLM
ReversibleTransformerLM.vocab_size = 32
ReversibleTransformerLM.d_model = 16
ReversibleTransformerLM.d_ff = 32
ReversibleTransformerLM.n_layers = 1
ReversibleTransformerLM.n_heads = 2
ReversibleTransformerLM.max_len = 64
ReversibleTransformerLM.dropout = 0.0
RunConfig.inputs = @CopyTask
CopyTask.vocab_size = 32
CopyTask.length = 4
CopyTask.batch_size = 8
CopyTask.seed = 0
RunConfig.trainer_class = @ReversibleSerialTrainer
RunConfig.loss = @CrossEntropyLoss
RunConfig.optimizer = @optimizer_fn
optimizer_fn.name = 'sgd'
optimizer_fn.clip_gradient_norm = 1.0
RunConfig.schedule = 0.5
train.steps = 6
EvalConfig.every = 3
CheckpointConfig.every = 3
LogConfig.every = 3
EvalConfig.steps = 2
LogConfig.progress = False
"""


FSDP_TRAINERS = ("Trainer", "ReversibleSerialTrainer", "MemoryEfficientTrainer")
# d_model 64: the embedding and kernels have >= 1024 elements, so FSDP shards them.
WIDE = ("ReversibleTransformerLM.d_model=64", "ReversibleTransformerLM.d_ff=128")



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# gRPC's words when the coordinator's port was taken between `_free_port` and its bind.
_PORT_TAKEN = re.compile(r"(?i)address already in use|failed to add port|failed to bind")
# Groups run at once: each process compiles on the CPU, and 13 processes started together
# on a loaded 2-core machine made the slowest ones time out.
_GROUPS_AT_ONCE = 2


def _start(config: str, out: str, devices_per_process: int, extra_args=(), bindings=()):
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
               JAX_NUM_CPU_DEVICES=str(devices_per_process))
    argv = [sys.executable, "-c", "from revtrain.cli import run_train; run_train()",
            f"--config_file={config}", f"--output_dir={out}", *extra_args]
    argv += [f"--gin_bindings={b}" for b in bindings]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _two_processes(config: str, out: str, bindings=()):
    """Starts a 2 x 2 run: ``port -> [process 0, process 1]``."""
    def start(port):
        return [_start(config, out, 2, [f"--coordinator_address=localhost:{port}",
                                        "--num_processes=2", f"--process_id={i}"], bindings)
                for i in range(2)]
    return start


def _run_groups(groups):
    """Runs ``{name: port -> [Popen]}`` a few groups at a time; a group whose coordinator
    port was taken meanwhile (by anything on the machine) is rerun on another port.
    Returns ``{name: [(returncode, stdout, stderr), ...]}``."""
    results, pending = {}, list(groups.items())
    while pending:
        batch, pending = pending[:_GROUPS_AT_ONCE], pending[_GROUPS_AT_ONCE:]
        started = [(name, start, start(_free_port())) for name, start in batch]
        for name, start, group in started:
            for attempt in range(3):
                done = []
                for p in group:
                    out, err = p.communicate(timeout=600)
                    done.append((p.returncode, out, err))
                    if p.returncode and _PORT_TAKEN.search(err):
                        for other in group:  # Would wait for the coordinator in vain.
                            other.kill()
                taken = any(code and _PORT_TAKEN.search(err) for code, _, err in done)
                if attempt == 2 or not taken:
                    break
                group = start(_free_port())
            results[name] = done
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{name: (output_dir, [(returncode, stdout, stderr), ...])}`` of three runs of the
    same global batches: 2 processes x 2 devices, 1 process x 4 devices, 1 x 1."""
    root = tmp_path_factory.mktemp("multihost")
    config = str(root / "sgd_copy.gin")
    with open(config, "w") as f:
        f.write(CONFIG)
    one = lambda out, *bindings: lambda port: [_start(config, out, 4, bindings=bindings)]
    groups = {"2x2": _two_processes(config, str(root / "2x2")),
              "1x4": one(str(root / "1x4"), "RunConfig.n_devices=4"),
              "1x1": one(str(root / "1x1"), "RunConfig.n_devices=1")}
    for trainer in FSDP_TRAINERS:
        wide = [*WIDE, f"RunConfig.trainer_class=@{trainer}"]
        groups[f"2x2-fsdp-{trainer}"] = _two_processes(
            config, str(root / f"2x2-fsdp-{trainer}"), [*wide, "RunConfig.fsdp=True"])
        groups[f"1x4-{trainer}"] = one(str(root / f"1x4-{trainer}"), *wide,
                                       "RunConfig.n_devices=4")
    return {name: (str(root / name), done) for name, done in _run_groups(groups).items()}

@pytest.fixture(scope="module")
def two_process_run(runs):
    return runs["2x2"]


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


def _checkpoint(out: str, step: int) -> dict:
    """The flat ``{path: numpy array}`` checkpoint of ``step``, read with orbax directly
    (into host arrays: the shardings it was saved with name another run's devices)."""
    path = os.path.join(out, "checkpoints", str(step), "default")
    checkpointer = ocp.StandardCheckpointer()
    metadata = checkpointer.metadata(path)
    metadata = getattr(metadata, "item_metadata", metadata)
    metadata = getattr(metadata, "tree", metadata)
    return checkpointer.restore(path, {k: np.zeros(m.shape, m.dtype)
                                       for k, m in metadata.items()})


def _assert_same_training(runs, name, reference):
    for run in (name, reference):
        for status, _, stderr in runs[run][1]:
            assert status == 0, f"{run}: {stderr[-2000:]}"
    (out, _), (ref_out, _) = runs[name], runs[reference]
    for split in ("train", "eval"):
        records, expected = read_metrics(out, split), read_metrics(ref_out, split)
        assert [r["step"] for r in records] == [r["step"] for r in expected] == [3, 6]
        for got, want in zip(records, expected, strict=True):
            for key in ("loss", "gradients_l2", "weights_l2", "accuracy"):
                if key in want:
                    assert got[key] == pytest.approx(want[key], rel=1e-5), (split, key)
    got, want = _checkpoint(out, 6), _checkpoint(ref_out, 6)
    weights = sorted(k for k in want if k.startswith("weights/"))
    assert weights and sorted(k for k in got if k.startswith("weights/")) == weights
    for key in weights:
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=1e-5,
                                   atol=1e-5, err_msg=key)


@pytest.mark.parametrize("reference", ["1x4", "1x1"])
def test_two_processes_train_what_one_process_trains(runs, reference):
    _assert_same_training(runs, "2x2", reference)


@pytest.mark.parametrize("trainer", FSDP_TRAINERS)
def test_two_processes_with_fsdp_train_what_one_process_trains_without(runs, trainer):
    _assert_same_training(runs, f"2x2-fsdp-{trainer}", f"1x4-{trainer}")
