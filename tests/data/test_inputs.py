"""Tests for revtrain.data.inputs: the Inputs contract and StreamInputs."""

import itertools
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import revtrain.data
from revtrain.data import inputs as inputs_lib


def _constant_batches(value, start_step=0):
    for step in itertools.count(start_step):
        x = np.full((2, 3), value + step, np.int32)
        yield x, x, np.ones((2, 3), np.float32)


def test_inputs_is_abstract():
    with pytest.raises(TypeError):
        inputs_lib.Inputs()


def test_stream_inputs_forwards_start_step_and_attributes():
    inputs = inputs_lib.StreamInputs(
        lambda start: _constant_batches(0, start),
        lambda: _constant_batches(100),
        vocab_size=10,
    )
    assert int(next(inputs.train_stream(start_step=4))[0][0, 0]) == 4
    assert int(next(inputs.eval_stream())[0][0, 0]) == 100
    assert (inputs.vocab_size, inputs.n_classes) == (10, None)


def test_stream_inputs_evaluates_on_train_data_without_eval_stream():
    inputs = inputs_lib.StreamInputs(lambda start: _constant_batches(0, start), n_classes=3)
    assert int(next(inputs.eval_stream())[0][0, 0]) == 0
    assert inputs.n_classes == 3


def test_public_api_is_explicit():
    assert sorted(revtrain.data.__all__) == sorted(
        [
            "Batch",
            "ByteTokenizer",
            "CopyTask",
            "Inputs",
            "ProcessSlice",
            "SentencePieceTokenizer",
            "StreamInputs",
            "SyntheticSequences",
            "TFDS",
            "TextFiles",
            "Tokenizer",
            "default_corpus",
            "lm_batch",
            "train_sentencepiece",
            "trained_sentencepiece",
        ]
    )
    for name in revtrain.data.__all__:
        assert getattr(revtrain.data, name) is not None


def test_import_does_not_need_tensorflow():
    root = pathlib.Path(inputs_lib.__file__).resolve().parents[2]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    code = (
        "import sys, revtrain.data; "
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported'; "
        "assert 'tensorflow_datasets' not in sys.modules, 'tensorflow_datasets imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
