"""Tests of revtrain/data/tokenizers.py: bytes and a real SentencePiece model."""
import numpy as np
import pytest

from revtrain.data import (
    ByteTokenizer,
    SentencePieceTokenizer,
    TextFiles,
    train_sentencepiece,
    trained_sentencepiece,
)

TEXT = "def f(x):\n    return x  # naïve — 中文 ok\n\tdone.\n"
VOCAB = 400


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A 400-piece unigram model trained by SentencePiece on the embedded corpus."""
    prefix = tmp_path_factory.mktemp("sp") / "corpus"
    return train_sentencepiece(None, prefix, vocab_size=VOCAB)


def test_bytes_round_trip_ids_and_byte_counts():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(TEXT)
    assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < 256
    assert ids.tolist() == list(TEXT.encode("utf-8"))
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode([0xE4]) == "\ufffd"  # Half a character: U+FFFD, no error.
    assert tokenizer.token_bytes().tolist() == [1] * 256
    assert tokenizer == ByteTokenizer() and tokenizer.byte_level


def test_sentencepiece_round_trip_ids_in_range_and_exact_byte_counts(sp_model):
    tokenizer = SentencePieceTokenizer(sp_model)
    assert tokenizer.vocab_size == VOCAB and not tokenizer.byte_level
    ids = tokenizer.encode(TEXT)
    assert ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < VOCAB
    assert len(ids) < len(TEXT.encode("utf-8"))  # Subwords: fewer tokens than bytes.
    assert tokenizer.decode(ids) == TEXT  # Lossless: spaces, tabs, newlines, Unicode.
    assert tokenizer.token_bytes()[ids].sum() == len(TEXT.encode("utf-8"))
    assert tokenizer.token_bytes()[:3].tolist() == [0, 0, 0]  # <unk>, <s>, </s>.
    assert tokenizer.encode(TEXT.encode("utf-8")).tolist() == ids.tolist()


def test_training_is_deterministic_and_the_fingerprint_ignores_the_file_name(sp_model,
                                                                             tmp_path):
    again = train_sentencepiece(None, tmp_path / "other_name", vocab_size=VOCAB)
    assert SentencePieceTokenizer(again) == SentencePieceTokenizer(sp_model)
    in_memory = trained_sentencepiece(vocab_size=VOCAB)
    assert in_memory.fingerprint() == SentencePieceTokenizer(sp_model).fingerprint()
    assert trained_sentencepiece(model_file=sp_model) == in_memory
    smaller = trained_sentencepiece(vocab_size=VOCAB - 20)
    assert smaller != in_memory and smaller.vocab_size == VOCAB - 20


def test_missing_and_unreadable_model_files_name_the_binding(tmp_path):
    missing = tmp_path / "missing.model"
    with pytest.raises(FileNotFoundError, match=r"^SentencePieceTokenizer.model_file='.*"
                                                r"missing.model' does not exist; train one "
                                                r"with revtrain-tokenizer"):
        SentencePieceTokenizer(missing)
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match=r"^SentencePieceTokenizer.model_file='.*garbage"
                                         r".model' is not a SentencePiece model \("):
        SentencePieceTokenizer(garbage)
    empty = tmp_path / "empty.model"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is not a SentencePiece model .the file is empty"):
        SentencePieceTokenizer(empty)
    with pytest.raises(ValueError, match="cannot be read"):
        SentencePieceTokenizer(tmp_path)  # A directory.


def test_training_refuses_a_vocabulary_below_the_byte_pieces(tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size=100 is smaller than 259"):
        train_sentencepiece(None, tmp_path / "m", vocab_size=100)
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        train_sentencepiece(None, tmp_path / "no" / "m", vocab_size=300)


def test_text_files_with_sentencepiece_keep_the_byte_split(sp_model):
    tokenizer = SentencePieceTokenizer(sp_model)
    common = dict(sequence_length=16, batch_size=4, process_index=0, process_count=1)
    data = TextFiles(tokenizer=tokenizer, **common)
    by_bytes = TextFiles(**common)
    assert data.vocab_size == VOCAB and data.tokenizer is tokenizer and not data.byte_level
    assert by_bytes.vocab_size == 256 and by_bytes.byte_level
    assert by_bytes.tokenizer == ByteTokenizer()
    # The same text on each side of the cut (it falls on a character boundary here).
    assert data.eval_bytes.tobytes() == by_bytes.eval_bytes.tobytes()
    assert tokenizer.decode(data.eval_tokens) == data.eval_bytes.tobytes().decode("utf-8")
    inputs, targets, weights = next(data.train_stream())
    assert inputs.shape == (4, 16) and inputs.max() < VOCAB
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    n_windows = (len(data.eval_tokens) - 1) // 16
    scored = sum(int(w.sum()) for _, _, w in data.eval_pass())
    assert scored == n_windows * 16


def test_text_files_refuse_something_that_is_not_a_tokenizer():
    with pytest.raises(TypeError, match=r"^TextFiles.tokenizer='bytes' is not a tokenizer"):
        TextFiles(tokenizer="bytes", process_index=0, process_count=1)


def test_text_files_with_a_subword_tokenizer_refuse_text_that_is_not_utf8(sp_model,
                                                                           tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café naïve\n".encode("latin-1") * 20)
    common = dict(paths=[latin1], sequence_length=4, batch_size=4, process_index=0,
                  process_count=1)
    with pytest.raises(ValueError, match=rf"^text file '{latin1}' is not UTF-8: byte offset "
                                         rf"3 \(line 1\) holds 0xe9"):
        TextFiles(tokenizer=SentencePieceTokenizer(sp_model), **common)
    assert TextFiles(**common).train_bytes[3] == 0xE9  # Bytes are tokens: any bytes do.
