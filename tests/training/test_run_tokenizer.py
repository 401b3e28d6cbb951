"""Tests of revtrain/training/run_tokenizer.py through the tools: the run directory's
tokenizer record, eval/decode with the run's tokenizer, and the fail-fast errors."""
import json
import math
import os

import pytest

from revtrain import cli
from revtrain.data import ByteTokenizer, default_corpus, train_sentencepiece
from revtrain.training.run_tokenizer import (
    check_run_tokenizer,
    read_run_tokenizer,
    write_run_tokenizer,
)

SHRINK = ["ReversibleTransformerLM.d_model=16", "ReversibleTransformerLM.d_ff=32",
          "ReversibleTransformerLM.n_heads=2", "ReversibleTransformerLM.n_layers=1",
          "TextFiles.sequence_length=16", "TextFiles.batch_size=4", "EvalConfig.steps=1",
          "LogConfig.progress=False", "CheckpointConfig.every=0"]
VOCAB = 400


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return train_sentencepiece(None, tmp_path_factory.mktemp("sp") / "sp", vocab_size=VOCAB)


def _train(output_dir, *bindings):
    argv = ["revtrain-train", "--config_file=reversible_lm.gin", f"--output_dir={output_dir}"]
    return cli.train_main(argv + [f"--gin_bindings={b}" for b in [*SHRINK, *bindings]])


def _sp(model_file, vocab=VOCAB):
    return ["TextFiles.tokenizer=@SentencePieceTokenizer()",
            f"SentencePieceTokenizer.model_file='{model_file}'",
            f"ReversibleTransformerLM.vocab_size={vocab}"]


def _snapshot(directory):
    """Every file under ``directory`` with its size and modification time."""
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            stat = os.stat(os.path.join(root, name))
            found[os.path.join(root, name)] = (stat.st_size, stat.st_mtime_ns)
    return found


@pytest.fixture(scope="module")
def sp_run(tmp_path_factory, sp_model):
    """A two-step run with the SentencePiece model, whose original file is then moved."""
    out = tmp_path_factory.mktemp("run")
    assert _train(out, "train.steps=2", *_sp(sp_model)) == 0
    return out


def test_the_run_records_its_tokenizer_and_keeps_a_copy(sp_run, sp_model):
    record = json.loads((sp_run / "tokenizer.json").read_text())
    assert record["type"] == "SentencePieceTokenizer" and record["vocab_size"] == VOCAB
    assert (sp_run / "tokenizer.model").read_bytes() == open(sp_model, "rb").read()
    assert read_run_tokenizer(str(sp_run)).fingerprint() == record["fingerprint"]
    metrics = [json.loads(line) for line in (sp_run / "metrics.jsonl").read_text().splitlines()]
    final = [m for m in metrics if m["split"] == "eval"][-1]
    # Bits per token over bytes per token (> 1 byte per subword token).
    assert final["bits_per_byte"] < final["loss"] / math.log(2)


def test_eval_and_decode_use_the_runs_copy_without_a_flag(sp_run, sp_model, capsys,
                                                          tmp_path):
    moved = tmp_path / "moved.model"
    os.rename(sp_model, moved)  # The config's model file is gone: the copy is used.
    try:
        assert cli.eval_main(["revtrain-eval", f"--output_dir={sp_run}", "--one_pass",
                              "--split=eval", "--step=2"]) == 0
        assert cli.decode_main(["revtrain-decode", f"--output_dir={sp_run}",
                                "--prompt=def f(x):", "--max_new_bytes=3"]) == 0
    finally:
        os.rename(moved, sp_model)
    record = json.loads((sp_run / "decoder_out" / "step_2.jsonl").read_text())
    assert len(record["tokens"]) == 3 and all(0 <= t < VOCAB for t in record["tokens"])
    assert record["continuation"] == read_run_tokenizer(str(sp_run)).decode(
        read_run_tokenizer(str(sp_run)).encode("def f(x):").tolist()
        + record["tokens"])[len("def f(x):"):]


@pytest.mark.parametrize("case", ["vocab_too_small", "missing_model", "unreadable_model",
                                  "other_tokenizer_on_resume"])
def test_bad_tokenizer_input_is_one_line_and_writes_nothing(sp_run, sp_model, tmp_path,
                                                            capsys, case):
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00\x01 nonsense")
    out, bindings, message = {
        "vocab_too_small": (tmp_path / "new", _sp(sp_model, vocab=256),
                            "ReversibleTransformerLM.vocab_size=256 is smaller than the "
                            "vocabulary of the tokenizer of TextFiles"),
        "missing_model": (tmp_path / "new", _sp(tmp_path / "none.model"),
                          "SentencePieceTokenizer.model_file="),
        "unreadable_model": (tmp_path / "new", _sp(garbage),
                             "is not a SentencePiece model"),
        "other_tokenizer_on_resume": (sp_run, ["ReversibleTransformerLM.vocab_size=400"],
                                      "TextFiles.tokenizer is ByteTokenizer (256 ids"),
    }[case]
    before = _snapshot(out)
    capsys.readouterr()
    assert _train(out, "train.steps=4", *bindings) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert err[0].startswith("revtrain-train: error:")
    assert _snapshot(out) == before
    assert os.path.isdir(out) == (case == "other_tokenizer_on_resume")


def test_a_run_without_a_record_counts_as_bytes(tmp_path):
    (tmp_path / "checkpoints" / "5").mkdir(parents=True)
    assert read_run_tokenizer(str(tmp_path)) == ByteTokenizer()
    check_run_tokenizer(str(tmp_path), ByteTokenizer(), "TextFiles.tokenizer")
    assert read_run_tokenizer(str(tmp_path / "nothing")) is None
    write_run_tokenizer(str(tmp_path), ByteTokenizer())
    assert not (tmp_path / "tokenizer.model").exists()
    assert json.loads((tmp_path / "tokenizer.json").read_text())["type"] == "ByteTokenizer"


def test_revtrain_tokenizer_trains_a_model_and_reports_errors_in_one_line(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_bytes(default_corpus()[:200_000])
    prefix = tmp_path / "out" / "sp"
    (tmp_path / "out").mkdir()
    assert cli.tokenizer_main(["revtrain-tokenizer", f"--input={text}", "--vocab_size=500",
                               f"--model_prefix={prefix}"]) == 0
    assert f"wrote {prefix}.model" in capsys.readouterr().out
    from revtrain.data import SentencePieceTokenizer
    assert SentencePieceTokenizer(f"{prefix}.model").vocab_size == 500
    assert cli.tokenizer_main(["revtrain-tokenizer", f"--input={tmp_path / 'no.txt'}",
                               f"--model_prefix={prefix}"]) == 2
    assert cli.tokenizer_main(["revtrain-tokenizer", f"--input={text}", "--vocab_size=100",
                               f"--model_prefix={prefix}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("revtrain-tokenizer: error: --input=") and "no such file" in err[0]
    assert "vocab_size=100 is smaller than 259" in err[1] and len(err) == 2


@pytest.mark.parametrize("full", ["tokenizer.model", "tokenizer.json"])
def test_a_full_disk_under_the_tokenizer_record_is_the_one_write_failure_line(
        tmp_path, capsys, monkeypatch, sp_model, full):
    from tests.full_disk import fill_disk

    out = tmp_path / "run"
    fill_disk(monkeypatch, full)
    assert _train(out, "train.steps=2", *_sp(sp_model)) == 1
    monkeypatch.undo()
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"revtrain-train: error: RunWriteError: could not write {out}/{full}: "
                    f"the disk is full (No space left on device); no checkpoint is saved yet;"
                    f" free space and run the same command to resume (rerun with --traceback "
                    f"for details)"), line
    assert not (out / "checkpoints").exists()  # Not left behind empty.
    assert not (out / "tokenizer.json").exists()
