"""Tests of revtrain/training/validation.py: batches that do not fit the model."""
import numpy as np
import pytest

from revtrain.data import CopyTask
from revtrain.models import ReversibleTransformerLM, RevNet
from revtrain.training.validation import (
    check_arguments,
    check_batch_divides,
    check_first_batch,
)

LM = ReversibleTransformerLM(vocab_size=8, d_model=8, d_ff=8, n_layers=1, n_heads=2,
                             max_len=16)
DATA = CopyTask(vocab_size=8, length=4, batch_size=4)
IDS = np.zeros((4, 8), np.int32)
MASK = np.ones((4, 8), np.float32)


@pytest.mark.parametrize("batch, message", [
    ((IDS, IDS), r"is a tuple of 2; a batch must be a tuple \(inputs, targets, weights\)"),
    ({"inputs": IDS}, r"is a dict; a batch must be a tuple"),
    ((IDS, IDS, None), r"weights is not an array with a batch axis \(got NoneType\)"),
    ((IDS, IDS, MASK[:, :4]), r"weights must have the targets' shape"),
    ((IDS, IDS, MASK.astype(np.int32)), r"weights are int32; the loss mask must be a float"),
    ((MASK, IDS, MASK), r"inputs are float32\[4, 8\]; ReversibleTransformerLM takes integer "
                        r"token ids \[batch, length\]"),
    ((IDS - 1, IDS, MASK), r"id -1 in the inputs is outside \[0, 8\) of "
                           r"ReversibleTransformerLM.vocab_size=8; ids must be >= 0"),
    ((IDS, IDS + 8, MASK), r"id 8 in the targets is outside \[0, 8\) of "
                           r"ReversibleTransformerLM.vocab_size=8; set "
                           r"ReversibleTransformerLM.vocab_size=9"),
    ((IDS, MASK, MASK), r"targets are float32; ReversibleTransformerLM needs integer ids"),
])
def test_batch_that_does_not_fit_the_model_is_named(batch, message):
    with pytest.raises(ValueError, match=r"^the first train batch of CopyTask.*" + message):
        check_first_batch(batch, LM, DATA)


def test_fitting_batches_pass_for_lm_and_classifier():
    check_first_batch((IDS + 7, IDS, MASK), LM, DATA)
    images = np.zeros((4, 8, 8, 3), np.float32)
    labels = np.array([0, 1, 2, 9], np.int32)
    check_first_batch((images, labels, np.ones(4, np.float32)), RevNet(n_classes=10), DATA)
    with pytest.raises(ValueError, match=r"id 10 in the targets is outside \[0, 10\) of "
                                         r"RevNet.n_classes=10"):
        check_first_batch((images, labels + 1, np.ones(4, np.float32)), RevNet(), DATA)


@pytest.mark.parametrize("prefix, arguments, message", [
    ("train", {"steps": 2.5}, "train.steps=2.5 must be an integer; change the gin binding "
                              "train.steps"),
    ("train", {"steps": True}, "train.steps=True must be an integer"),
    ("CheckpointConfig", {"every": -1}, "CheckpointConfig.every=-1 must be >= 0"),
    ("EvalConfig", {"steps": -2}, "EvalConfig.steps=-2 must be >= 0 or None"),
    ("LogConfig", {"every": 0}, "LogConfig.every=0 must be >= 1 or None"),
    ("CheckpointConfig", {"keep_time_interval": 0},
     "CheckpointConfig.keep_time_interval=0 must be > 0 or None"),
    ("CheckpointConfig", {"keep_time_interval": float("inf")},
     "CheckpointConfig.keep_time_interval=inf must be > 0"),
    ("RunConfig", {"n_devices": 0}, "RunConfig.n_devices=0 must be >= 1 or None"),
    ("RunConfig", {"schedule": float("nan")}, "RunConfig.schedule=nan must be a finite "
                                              "number > 0"),
    ("RunConfig", {"schedule": 1e39}, r"RunConfig.schedule=1e\+39 must be a finite number > 0"),
])
def test_out_of_range_arguments_are_one_line_errors(prefix, arguments, message):
    with pytest.raises(ValueError, match="^" + message.replace(".", r"\.")):
        check_arguments(arguments, prefix)


def test_in_range_arguments_and_none_pass():
    check_arguments({"steps": 1}, "train")
    check_arguments({"every": 0, "max_to_keep": None, "keep_period": None,
                     "keep_time_interval": 0.5}, "CheckpointConfig")
    check_arguments({"n_devices": 4, "schedule": lambda step: 0.1}, "RunConfig")
    check_arguments({"every": None}, "LogConfig")
    check_arguments({"steps": None}, "EvalConfig")


def test_batch_must_divide_over_devices():
    check_batch_divides(8, 4, DATA)
    with pytest.raises(ValueError, match="CopyTask's batch size 6 is not divisible by "
                                         "n_devices=4"):
        check_batch_divides(6, 4, DATA)
