"""Tests of revtrain/training/metrics_writer.py."""
import glob
import math
import os
import struct

import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from revtrain.training import MetricsWriter, read_metrics
from revtrain.training.write_failures import RunWriteError
from tests.full_disk import fill_disk


def _scalars(logdir, tag):
    """(step, value) of ``tag`` from the TFRecord event files in ``logdir``."""
    found = []
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        data, i = open(path, "rb").read(), 0
        while i < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc.
            (n,) = struct.unpack("<Q", data[i:i + 8])
            payload = data[i + 12:i + 12 + n]
            # The CRCs TensorBoard's reader checks.
            assert struct.unpack("<I", data[i + 8:i + 12])[0] == masked_crc32c(data[i:i + 8])
            assert struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] == masked_crc32c(
                payload)
            event = event_pb2.Event.FromString(payload)
            i += 12 + n + 4
            found += [(event.step, v.simple_value) for v in event.summary.value
                      if v.tag == tag]
    return found


def test_jsonl_records_and_tensorboard_scalars(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.write(10, "train", {"loss": 2.5, "steps_per_second": 4})
    writer.write(10, "eval", {"loss": math.nan})
    writer.write(20, "train", {"loss": 2.0, "steps_per_second": 5})
    writer.close()
    records = read_metrics(str(tmp_path))
    assert [(r["step"], r["split"], r["loss"]) for r in records] == [
        (10, "train", 2.5), (10, "eval", None), (20, "train", 2.0)]
    assert _scalars(str(tmp_path / "tensorboard" / "train"), "loss") == [(10, 2.5), (20, 2.0)]


def test_disabled_writer_writes_nothing(tmp_path):
    writer = MetricsWriter(str(tmp_path / "x"), enabled=False)
    writer.write(1, "train", {"loss": 1.0})
    writer.close()
    assert not os.path.exists(tmp_path / "x")
    assert read_metrics(str(tmp_path / "x")) == []


def test_a_line_cut_short_is_skipped_with_a_warning_and_the_next_record_is_whole(tmp_path,
                                                                                 caplog):
    import logging

    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    writer.write(1, "eval", {"loss": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "split": "ev')  # A full disk cut the write short.
    writer.write(3, "eval", {"loss": 3.0})
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_metrics(str(tmp_path), "eval")] == [1, 3]
    assert f"{tmp_path}/metrics.jsonl: skipped 1 line(s) that are not metric records " \
           "(line 2)" in caplog.text


@pytest.mark.parametrize("full, what", [
    ("metrics.jsonl", "write {out}/metrics.jsonl"),
    ("tfevents", "write the TensorBoard events in {out}/tensorboard/eval"),
])
def test_a_full_disk_is_one_run_write_error_naming_the_file_and_the_intact_checkpoint(
        tmp_path, monkeypatch, full, what):
    (tmp_path / "checkpoints" / "6").mkdir(parents=True)
    writer = MetricsWriter(str(tmp_path))
    fill_disk(monkeypatch, full)
    with pytest.raises(RunWriteError) as error:
        writer.write(8, "eval", {"loss": 1.0})
    assert str(error.value) == (
        f"could not {what.format(out=tmp_path)}: the disk is full (No space left on "
        f"device); the newest checkpoint, step 6, is intact; free space and run the same "
        f"command to resume")
    writer.close()  # Nothing left to write: no second failure, no thread's traceback.


def test_event_files_are_written_on_the_calling_thread(tmp_path):
    """tensorboardX's writer thread died on a full disk and its queue then blocked the run
    forever; the event files are written by the caller, where a failure can be reported."""
    import threading

    before = threading.active_count()
    writer = MetricsWriter(str(tmp_path))
    writer.write(1, "train", {"loss": 1.0})
    writer.write_text("summary", "x", 1)
    assert threading.active_count() == before
    writer.close()
    assert _scalars(str(tmp_path / "tensorboard" / "train"), "loss") == [(1, 1.0)]
