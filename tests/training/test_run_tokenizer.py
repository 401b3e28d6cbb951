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
    # A long path: gin writes the binding's value on a line of its own
    # (``model_file = \\``), which reading config.gin must follow.
    folder = tmp_path_factory.mktemp("sp") / ("a_folder_with_a_long_name_" * 3)
    folder.mkdir()
    return train_sentencepiece(None, folder / "sp", vocab_size=VOCAB)


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


# ------------------------------------------------------------------------------------------
# A damaged record: rebuilt from what the run still has, or refused with the truth.

@pytest.fixture
def run_copy(sp_run, tmp_path):
    """A copy of the SentencePiece run, free to damage."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(sp_run, out)
    return out


def _one_error(capsys):
    """The one error line on stderr (the rebuild's warning may come before it)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line for line in lines if ": error: " in line] == lines[-1:], lines
    return lines[-1]


@pytest.mark.parametrize("damage", ["deleted", "truncated", "not_a_record"])
def test_a_lost_record_is_rebuilt_from_the_model_copy_never_taken_for_bytes(
        run_copy, sp_model, caplog, capsys, damage):
    record_file = run_copy / "tokenizer.json"
    original = record_file.read_text()
    {"deleted": record_file.unlink,
     "truncated": lambda: record_file.write_text(original[:20]),
     "not_a_record": lambda: record_file.write_text('{"type": "WordTokenizer"}')}[damage]()
    with caplog.at_level("WARNING"):
        tokenizer = read_run_tokenizer(str(run_copy))
    assert tokenizer.fingerprint() == json.loads(original)["fingerprint"]
    reason = {"deleted": f"{record_file} is missing",
              "truncated": f"{record_file} is not JSON",
              "not_a_record": f"{record_file} is not a tokenizer record"}[damage]
    assert reason in caplog.text
    assert (f"it is rebuilt from {run_copy}/tokenizer.model: SentencePieceTokenizer ({VOCAB} "
            f"ids, ") in caplog.text
    assert f"whose ids fit the checkpoint's embedding ({VOCAB} rows)" in caplog.text
    assert json.loads(record_file.read_text()) == json.loads(original)  # Rewritten.
    # The advice the byte assumption gave (train on with bytes) is refused, not followed.
    record_file.unlink()
    capsys.readouterr()
    assert _train(run_copy, "train.steps=4", f"ReversibleTransformerLM.vocab_size={VOCAB}"
                  ) == 1
    line = _one_error(capsys)
    assert ("TextFiles.tokenizer is ByteTokenizer (256 ids, 4739391d), but the run in "
            f"{run_copy} was trained with SentencePieceTokenizer ({VOCAB} ids, ") in line, line


def test_without_record_or_copy_a_sentencepiece_run_is_refused_with_the_truth(
        run_copy, sp_model, capsys):
    (run_copy / "tokenizer.json").unlink()
    (run_copy / "tokenizer.model").unlink()
    message = (f"{run_copy}/tokenizer.json is missing and so is {run_copy}/tokenizer.model, "
               f"but the run in {run_copy} was trained with a SentencePiece tokenizer (its "
               f"config.gin binds one), not bytes; copy {sp_model} (the model file its "
               f"config.gin names) if it is unchanged since the run to "
               f"{run_copy}/tokenizer.model (the record is rebuilt from it), or train in a "
               f"new output_dir")
    with pytest.raises(ValueError) as e:
        read_run_tokenizer(str(run_copy))
    assert str(e.value) == message
    before = _snapshot(run_copy)
    for main, argv in [(cli.eval_main, ["--one_pass", "--split=eval"]),
                       (cli.decode_main, ["--prompt=def ", "--max_new_bytes=2"])]:
        assert main(["revtrain", f"--output_dir={run_copy}", *argv]) == 1
        assert _one_error(capsys).endswith(f"UnreadableFileError: {message} (rerun with "
                                           f"--traceback for details)")
    assert _train(run_copy, "train.steps=4", f"ReversibleTransformerLM.vocab_size={VOCAB}"
                  ) == 1
    assert message in _one_error(capsys)
    assert _snapshot(run_copy) == before


def test_a_model_copy_that_does_not_fit_the_embedding_is_refused(run_copy, tmp_path):
    bigger = train_sentencepiece(None, tmp_path / "big", vocab_size=VOCAB + 100)
    (run_copy / "tokenizer.json").unlink()
    (run_copy / "tokenizer.model").write_bytes(open(bigger, "rb").read())
    with pytest.raises(ValueError, match=rf"tokenizer.json is missing, and {run_copy}/"
                                         rf"tokenizer.model cannot be the run's tokenizer: "
                                         rf"its {VOCAB + 100} ids do not fit the {VOCAB} rows"
                                         rf" of the checkpoint's embedding; copy the "):
        read_run_tokenizer(str(run_copy))
    assert not (run_copy / "tokenizer.json").exists()


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_lost_model_copy_is_restored_from_the_configs_model_file(run_copy, sp_model,
                                                                   caplog, damage):
    copy = run_copy / "tokenizer.model"
    if damage == "deleted":
        copy.unlink()
    else:
        copy.write_bytes(copy.read_bytes()[:100])
    with caplog.at_level("WARNING"):
        tokenizer = read_run_tokenizer(str(run_copy))
    assert copy.read_bytes() == open(sp_model, "rb").read()
    assert tokenizer.fingerprint() == json.loads((run_copy / "tokenizer.json").read_text())[
        "fingerprint"]
    assert f"it is restored from {sp_model} (the model file config.gin names)" in caplog.text


def test_a_lost_model_copy_without_its_model_says_which_model_to_copy_where(
        run_copy, sp_model, tmp_path, capsys):
    (run_copy / "tokenizer.model").unlink()
    other = train_sentencepiece(None, tmp_path / "other", vocab_size=VOCAB + 1)
    config = run_copy / "config.gin"
    config.write_text(config.read_text().replace(str(sp_model), str(other)))
    fingerprint = json.loads((run_copy / "tokenizer.json").read_text())["fingerprint"][:8]
    assert cli.decode_main(["revtrain-decode", f"--output_dir={run_copy}", "--prompt=def ",
                            "--max_new_bytes=2"]) == 1
    assert _one_error(capsys).endswith(
        f"the run's tokenizer copy {run_copy}/tokenizer.model is missing; copy the "
        f"SentencePiece model the run was trained with ({VOCAB} ids, fingerprint "
        f"{fingerprint}) to {run_copy}/tokenizer.model ({other}, which config.gin names, is "
        f"another model) (rerun with --traceback for details)")


def test_a_damaged_record_of_a_byte_run_is_rebuilt_as_bytes(tmp_path, caplog):
    (tmp_path / "checkpoints" / "5").mkdir(parents=True)
    (tmp_path / "tokenizer.json").write_text('{"type": "Byte')
    with caplog.at_level("WARNING"):
        assert read_run_tokenizer(str(tmp_path)) == ByteTokenizer()
    assert (f"{tmp_path}/tokenizer.json is not JSON" in caplog.text
            and "it is rebuilt from bytes (no " in caplog.text)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["type"] == "ByteTokenizer"
