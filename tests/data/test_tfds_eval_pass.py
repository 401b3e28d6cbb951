"""Tests for `revtrain.data.TFDS.eval_pass`: one exact pass over a finite TFDS split.

TFDS mock data (10 examples, no network) for the pass on one process and through the train
and eval programs; a small dataset written with `store_as_tfds_dataset` where the per-process slices
matter, since mock data ignores the split it is asked for.
"""

import dataclasses
import functools
import importlib.resources
import json
import os
import socket
import subprocess
import sys
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # Before TensorFlow is first imported.

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from revtrain import cli, configurables  # noqa: E402
from revtrain import layers as tl  # noqa: E402
from revtrain.data import tfds as tfds_lib  # noqa: E402
from revtrain.training import Checkpointer, Evaluator, read_metrics  # noqa: E402
from revtrain.training.builder import (  # noqa: E402
    build_evaluator,
    build_model,
    resolve_inputs,
)
from revtrain.training.run_directory import CHECKPOINT_DIR  # noqa: E402
from tests.cli_helpers import COPY_TASK, TINY  # noqa: E402

N_EXAMPLES = 10
LENGTH = 8


@pytest.fixture
def tfds():
    module = pytest.importorskip("tensorflow_datasets")
    with module.testing.mock_data(num_examples=N_EXAMPLES):
        yield module


def _mean_target(output, targets, weights):
    del output
    weights = jnp.broadcast_to(weights, targets.shape)
    return jnp.sum(targets * weights) / jnp.sum(weights)


def _mean_of_targets(batches, n_devices):
    """The evaluator's weighted mean of the targets (the model is the identity)."""
    evaluator = Evaluator(tl.Fn("Identity", lambda x: x),
                          {"mean": tl.Fn("MeanTarget", _mean_target)}, n_devices=n_devices)
    return evaluator.evaluate((), (), batches)["mean"]


def _test_texts(tfds, name="lm1b"):
    return [ex["text"] for ex in tfds.as_numpy(tfds.load(name, split="test"))]


@pytest.mark.parametrize("n_devices", [1, 4])
def test_exact_pass_counts_each_image_once(tfds, n_devices):
    """10 images in batches of 4: 3 batches, the last with 2 rows of weight 0."""
    data = tfds_lib.TFDS("mnist", batch_size=4, process_index=0, process_count=1)
    batches = list(data.eval_pass())
    assert [b[0].shape for b in batches] == [(4, 28, 28, 1)] * 3
    np.testing.assert_array_equal(np.concatenate([b[2] for b in batches]),
                                  [1.0] * N_EXAMPLES + [0.0] * 2)
    labels = [ex["label"] for ex in tfds.as_numpy(tfds.load("mnist", split="test"))]
    assert len(labels) == N_EXAMPLES
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches])[:N_EXAMPLES],
                                  labels)  # File order, each image once.
    assert _mean_of_targets(batches, n_devices) == pytest.approx(np.mean(labels), rel=1e-6)


@pytest.mark.parametrize("n_devices", [1, 4])
def test_exact_pass_counts_each_byte_once(tfds, n_devices):
    """Every byte after an example's first is a target exactly once, whatever the windows."""
    texts = _test_texts(tfds)
    data = tfds_lib.TFDS("lm1b", sequence_length=LENGTH, batch_size=4, process_index=0,
                         process_count=1)
    batches = list(data.eval_pass())
    n_windows = sum(-(-(len(t) - 1) // LENGTH) for t in texts if len(t) > 1)
    assert len(batches) == -(-n_windows // 4)
    weights = np.concatenate([b[2] for b in batches])
    assert weights.sum() == sum(max(len(t) - 1, 0) for t in texts)
    assert not weights[n_windows:].any()  # The padding rows of the last batch.
    hand = sum(sum(t[1:]) for t in texts) / sum(max(len(t) - 1, 0) for t in texts)
    assert _mean_of_targets(batches, n_devices) == pytest.approx(hand, rel=1e-6)


def test_short_slices_wait_for_the_others_with_all_masked_batches(tfds, monkeypatch):
    """While another process still has data, a process past its end yields weight-0 batches."""
    others_left = iter([True, True, True, True, True, False])  # Another process: 5 batches.
    monkeypatch.setattr(tfds_lib, "_any_process", lambda flag: next(others_left) or flag)
    batches = list(tfds_lib.TFDS("mnist", batch_size=4, process_index=0,
                                 process_count=1).eval_pass())
    assert [b[2].tolist() for b in batches] == ([[1.0] * 4] * 2 + [[1.0, 1.0, 0.0, 0.0]]
                                                + [[0.0] * 4] * 2)
    assert all(b[0].shape == (4, 28, 28, 1) for b in batches)
    assert not batches[-1][0].any() and not batches[-1][1].any()


TEXTS = [bytes(range(65, 65 + n)) for n in (3, 12, 20, 2, 9, 30, 5, 17, 8, 11)]


def _store_texts(data_dir, monkeypatch):
    tfds = pytest.importorskip("tensorflow_datasets")
    import tensorflow as tf

    # tensorflow-datasets' builders import the `importlib_resources` backport on every
    # Python, but only depend on it before 3.9; the standard module is the same API.
    monkeypatch.setitem(sys.modules, "importlib_resources", importlib.resources)
    tfds.dataset_builders.store_as_tfds_dataset(
        name="revtrain_eval_texts", version="1.0.0", data_dir=str(data_dir),
        features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
        split_datasets={split: tf.data.Dataset.from_tensor_slices({"text": TEXTS})
                        for split in ("train", "test")})


def _passes_in_threads(make, n_processes, monkeypatch):
    """Each simulated process's pass, run in step as real processes run (one thread each)."""
    barrier, flags = threading.Barrier(n_processes), [False] * n_processes

    def any_process(flag):  # What `multihost_utils.process_allgather` does across hosts.
        flags[int(threading.current_thread().name)] = flag
        barrier.wait()
        result = any(flags)
        barrier.wait()
        return result

    monkeypatch.setattr(tfds_lib, "_any_process", any_process)
    streams = [make(i) for i in range(n_processes)]
    passes = [None] * n_processes

    def run(i):
        passes[i] = list(streams[i].eval_pass())

    threads = [threading.Thread(target=run, args=(i,), name=str(i))
               for i in range(n_processes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return passes


def _real_rows(batches):
    return sorted((tuple(x), tuple(w)) for b in batches for x, w in zip(b[1], b[2],
                                                                           strict=True)
                  if w.any())


def test_process_slices_cover_the_split_once_in_the_same_number_of_batches(
        tmp_path, monkeypatch):
    _store_texts(tmp_path, monkeypatch)
    make = functools.partial(tfds_lib.TFDS, "revtrain_eval_texts", data_dir=str(tmp_path),
                             sequence_length=4, batch_size=8)
    single = list(make(process_index=0, process_count=1).eval_pass())
    passes = _passes_in_threads(lambda i: make(process_index=i, process_count=4), 4,
                                monkeypatch)
    # Each process read only its slice: its own batches hold a part of the windows...
    own = [sum(1 for b in p if b[2].any()) for p in passes]
    assert len(set(own)) > 1, "the slices should end after different numbers of batches"
    # ...and all ran as many batches as the longest, the rest all-masked.
    assert [len(p) for p in passes] == [max(own)] * 4
    assert all(b[0].shape == (2, 4) for p in passes for b in p)
    assert all(not b[2].any() for p, n in zip(passes, own, strict=True) for b in p[n:])
    # Together, every window once: exactly the one-process pass's rows.
    assert _real_rows(b for p in passes for b in p) == _real_rows(single)
    total = sum(b[2].sum() for p in passes for b in p)
    assert total == sum(len(t) - 1 for t in TEXTS)


_PROCESS = """
import json, sys
import jax
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                           process_id=int(sys.argv[2]))
from revtrain.data.tfds import TFDS
data = TFDS("revtrain_eval_texts", data_dir=sys.argv[3], sequence_length=4, batch_size=8)
batches = list(data.eval_pass())
print(json.dumps({"batches": len(batches), "real": [
    [x.tolist(), w.tolist()] for b in batches for x, w in zip(b[1], b[2]) if w.any()]}))
"""


def test_two_real_processes_run_the_same_number_of_batches(tmp_path, monkeypatch):
    """Two JAX processes (gloo on CPU) agree on the pass's end through `_any_process`."""
    _store_texts(tmp_path, monkeypatch)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        address = f"localhost:{s.getsockname()[1]}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1",
               TF_CPP_MIN_LOG_LEVEL="3")
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, address, str(i),
                               str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_, stderr) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, stderr[-2000:]
    results = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]
    own = [-(-len(r["real"]) // 4) for r in results]  # Batches of 4 rows with real data.
    assert own[0] != own[1], "the two slices should end after different numbers of batches"
    assert [r["batches"] for r in results] == [max(own)] * 2
    rows = sorted(tuple(map(tuple, row)) for r in results for row in r["real"])
    single = tfds_lib.TFDS("revtrain_eval_texts", data_dir=str(tmp_path), sequence_length=4,
                           batch_size=8, process_index=0, process_count=1)
    assert rows == sorted((tuple(x), tuple(w)) for b in single.eval_pass()
                          for x, w in zip(b[1].tolist(), b[2].tolist(), strict=True)
                          if any(w))


def _hand_windows(texts):
    """The split's windows, each once and unpadded: a batch ``(inputs, targets, weights)``."""
    windows, masks = [], []
    for text in texts:
        for start in range(0, max(len(text) - 1, 0), LENGTH):
            chunk = list(text[start:start + LENGTH + 1])
            windows.append(chunk + [0] * (LENGTH + 1 - len(chunk)))
            masks.append([1] * len(chunk) + [0] * (LENGTH + 1 - len(chunk)))
    windows, masks = np.array(windows, np.int32), np.array(masks, np.float32)
    return windows[:, :-1], windows[:, 1:], masks[:, 1:]


def test_train_and_eval_programs_score_a_tfds_split_in_one_exact_pass(tfds, tmp_path,
                                                                      capsys):
    """A gin config with TFDS inputs: the loop's final evaluation and revtrain-eval
    --one_pass both score the split's windows once each."""
    out = str(tmp_path)
    bindings = TINY + ["ReversibleTransformerLM.vocab_size=256", "RunConfig.inputs=@TFDS",
                       "TFDS.dataset_name='lm1b'", f"TFDS.sequence_length={LENGTH}",
                       "TFDS.batch_size=4", "train.steps=1", "EvalConfig.steps=None"]
    assert cli.train_main(["revtrain-train", f"--config_file={COPY_TASK}",
                           f"--output_dir={out}",
                           *[f"--gin_bindings={b}" for b in bindings]]) == 0
    [during_training] = read_metrics(out, "eval")
    os.rename(os.path.join(out, "metrics.jsonl"), os.path.join(out, "train_metrics.jsonl"))
    assert cli.eval_main(["revtrain-eval", f"--output_dir={out}", "--one_pass"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("eval at step 1:")
    [evaluated] = read_metrics(out, "eval")
    # The same model on the split's windows as one unpadded batch, on one device.
    run = configurables.run_configs()["run"]  # The run's config.gin, as revtrain-eval read it.
    inputs = resolve_inputs(run.inputs)
    built = build_model(run, inputs)
    checkpoints = Checkpointer(os.path.join(out, CHECKPOINT_DIR))
    values = checkpoints.restore_values(built.initial_values(), 1)
    checkpoints.close()
    one_device = build_evaluator(dataclasses.replace(run, n_devices=1), built, inputs)
    expected = one_device.evaluate(built.nest(values["weights"]), built.nest(values["state"]),
                                   [_hand_windows(_test_texts(tfds))])
    for name in ("loss", "accuracy", "bits_per_byte"):
        assert during_training[name] == pytest.approx(expected[name], rel=1e-5)
        assert evaluated[name] == pytest.approx(expected[name], rel=1e-5)
