"""Tests of revtrain/data/sentencepiece_training.py: every route that trains a model
refuses bad text and options in one line that names the option, and writes nothing."""
import os

import pytest

from revtrain.data import SentencePieceTokenizer, train_sentencepiece, trained_sentencepiece
from revtrain.data.sentencepiece_training import check_sentencepiece_options
from tests.text_files import TEXT_NEEDS as NEEDS
from tests.text_files import make_text_files

NAMES = {"text": "<a text file>", "latin1": "<a Latin-1 file>", "binary": "<a binary file>",
         "empty": "<an empty file>", "blank": "<a blank file>"}


@pytest.fixture
def files(tmp_path):
    """Input files in ``tmp_path/in``; models go to ``tmp_path/out``, which starts empty."""
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    paths = make_text_files(tmp_path / "in")
    return lambda name: paths[NAMES[name]]


def _outputs(files):
    return os.listdir(os.path.join(os.path.dirname(os.path.dirname(files("text"))), "out"))


def _both_routes(paths, prefix, vocab_size=NEEDS, model_type="unigram"):
    """The errors of train_sentencepiece and trained_sentencepiece on the same input."""
    messages = []
    for train in (lambda: train_sentencepiece(paths, prefix, vocab_size, model_type),
                  lambda: trained_sentencepiece(vocab_size, paths, model_type=model_type)):
        with pytest.raises(ValueError) as error:
            train()
        messages.append(str(error.value))
    return messages


@pytest.mark.parametrize("name, offset, line, byte", [("latin1", 3, 1, "0xe9"),
                                                     ("binary", 128, 2, "0x80")])
def test_text_that_is_not_utf8_names_the_file_and_offset_and_writes_no_model(
        files, name, offset, line, byte):
    prefix = os.path.join(os.path.dirname(files("text")), "..", "out", "sp")
    direct, gin = _both_routes([files("text"), files(name)], prefix)
    assert direct.startswith(f"paths: text file {files(name)!r} is not UTF-8: byte offset "
                             f"{offset} (line {line}) holds {byte}, "), direct
    assert gin.startswith("trained_sentencepiece.paths: text file ") and "\n" not in gin
    assert _outputs(files) == []


def test_empty_or_blank_text_names_the_files_and_the_option(files):
    prefix = os.path.join(os.path.dirname(files("text")), "..", "out", "sp")
    direct, gin = _both_routes([files("empty"), files("blank")], prefix)
    assert direct == (f"paths: {files('empty')}, {files('blank')} hold no text to train a "
                      f"tokenizer on (they are empty or blank); give text with at least one "
                      f"non-blank line")
    assert gin.startswith(f"trained_sentencepiece.paths: {files('empty')}, ")
    direct, _ = _both_routes(files("blank"), prefix)
    assert direct.startswith(f"paths: {files('blank')} holds no text to train a tokenizer "
                             f"on (it is empty or blank)")
    long_line = files("text") + ".long"
    with open(long_line, "w") as f:
        f.write("x" * 70_000)
    direct, _ = _both_routes(long_line, prefix)
    assert direct == (f"paths: {long_line} holds no text to train a tokenizer on (every "
                      f"line is longer than SentencePiece's limit of 65536 bytes); break the "
                      f"text into lines")
    assert _outputs(files) == []


def test_a_vocab_size_the_text_cannot_fill_gives_the_bound_that_trains(files):
    prefix = os.path.join(os.path.dirname(files("text")), "..", "out", "sp")
    direct, gin = _both_routes(files("text"), prefix, vocab_size=NEEDS - 1)
    assert direct == (f"vocab_size={NEEDS - 1} is smaller than the {NEEDS} pieces this text "
                      f"needs (the 63 most frequent characters, covering 99.95% of it, 256 "
                      f"byte pieces and <unk>, <s>, </s>); set vocab_size to {NEEDS} or more")
    assert gin.startswith(f"trained_sentencepiece.vocab_size={NEEDS - 1} is smaller than ")
    assert gin.endswith(f"set trained_sentencepiece.vocab_size to {NEEDS} or more")
    assert "character_coverage" not in direct + gin  # Not an option revtrain has.
    assert _outputs(files) == []
    direct, _ = _both_routes(files("text"), prefix, vocab_size=100_000, model_type="bpe")
    most = int(direct.split(" or less")[0].rsplit(" ", 1)[1])
    assert direct == (f"vocab_size=100000 is more than the {most} pieces a bpe model can "
                      f"have on this text; set vocab_size to {most} or less, or give more "
                      f"text")
    assert _outputs(files) == []
    for vocab_size in (NEEDS, most):  # The bounds given are ones that train.
        model_type = "bpe" if vocab_size == most else "unigram"
        path = train_sentencepiece(files("text"), prefix, vocab_size, model_type)
        assert SentencePieceTokenizer(path).vocab_size == vocab_size


@pytest.mark.parametrize("model_prefix", ["out/", "out", "out/."])
def test_a_model_prefix_that_is_a_directory_asks_for_a_file_prefix(files, model_prefix):
    root = os.path.dirname(os.path.dirname(files("text")))
    prefix = os.path.join(root, model_prefix)
    with pytest.raises(ValueError, match=rf"^model_prefix={prefix!r} is a directory; give a "
                                         rf"file prefix such as "):
        train_sentencepiece(files("text"), prefix, NEEDS)
    assert _outputs(files) == [] and sorted(os.listdir(root)) == ["in", "out"]


@pytest.mark.parametrize("options, message", [
    (dict(model_type="word"), "model_type='word' must be 'unigram' or 'bpe'"),
    (dict(model_type="char"), "model_type='char' must be 'unigram' or 'bpe'"),
    (dict(vocab_size=100), "vocab_size=100 is smaller than 259"),
    (dict(vocab_size=300.5), "vocab_size=300.5 is not an integer"),
    (dict(vocab_size=True), "vocab_size=True is not an integer"),
])
def test_one_check_of_the_options_on_every_route(files, options, message):
    options = {"vocab_size": NEEDS, "model_type": "unigram", **options}
    with pytest.raises(ValueError, match=f"^{message}"):
        check_sentencepiece_options(**options)
    with pytest.raises(ValueError, match=f"^--{message}"):
        check_sentencepiece_options(**options, option_names={
            "vocab_size": "--vocab_size", "model_type": "--model_type"})
    prefix = os.path.join(os.path.dirname(files("text")), "..", "out", "sp")
    direct, gin = _both_routes(files("text"), prefix, **options)
    assert direct.startswith(message) and gin.startswith(f"trained_sentencepiece.{message}")
    with pytest.raises(ValueError, match=f"^trained_sentencepiece.{message}"):
        trained_sentencepiece(model_file=files("text"), **options)  # Checked with a file too.
    assert _outputs(files) == []
