"""Training SentencePiece models on local text, and the one check of their options.

Every route that trains a model comes here: ``revtrain-tokenizer`` and the Python function
`train_sentencepiece` (a model file), and `trained_sentencepiece` (a tokenizer trained in
memory; gin's ``@trained_sentencepiece()``). Each checks its options with
`check_sentencepiece_options` and its text with `revtrain.data.corpus.check_utf8` before
SentencePiece runs, and nothing is written before the model is trained, so a bad option
or file is one line that names it, and leaves no model file.

The models are lossless (identity normalisation, whitespace kept, no dummy prefix, byte
fallback for the rarest 0.05% of characters), so `revtrain.data.Tokenizer.token_bytes`
counts the bytes of the text exactly.
"""

from __future__ import annotations

import io
import numbers
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from revtrain.data.corpus import PathLike, default_corpus, read_text_file
from revtrain.data.tokenizers import (
    BYTE_VOCAB_SIZE,
    SentencePieceTokenizer,
    import_sentencepiece,
)

# The model types revtrain trains: both decode back to the text they encoded. A 'word'
# model does not (spaces come back as U+2581), and 'char' has no subwords.
MODEL_TYPES = ("unigram", "bpe")
# The 256 byte pieces of byte fallback and <unk>, <s>, </s>.
MIN_VOCAB_SIZE = BYTE_VOCAB_SIZE + 3
# The share of the text's characters that get a piece of their own (SentencePiece's
# ``character_coverage``); the rest are spelled with byte pieces.
CHARACTER_COVERAGE = 0.9995
# SentencePiece skips lines longer than this many bytes.
MAX_SENTENCE_BYTES = 1 << 16

_TOO_SMALL = re.compile(r"smaller than required_chars\. *(\d+) vs (\d+)")
_TOO_LARGE = re.compile(r"too high \((\d+)\)\. *Please set it to a value <= (\d+)")

Label = Callable[[str], str]


def _labeller(option_names: Mapping[str, str] | None) -> Label:
    names = dict(option_names or {})
    return lambda option: names.get(option, option)


def check_sentencepiece_options(vocab_size: Any, model_type: Any,
                                option_names: Mapping[str, str] | None = None) -> None:
    """Checks the options of a model to train; every training route calls it first.

    Args:
      vocab_size: number of pieces: an int, at least `MIN_VOCAB_SIZE` (259).
      model_type: one of `MODEL_TYPES`, ``'unigram'`` or ``'bpe'``.
      option_names: how the caller's user sets each option, for messages, e.g.
        ``{'vocab_size': '--vocab_size'}`` (default: the argument names).

    Raises:
      ValueError: one line naming the option, its value and the fix.
    """
    label = _labeller(option_names)
    vocab = label("vocab_size")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        raise ValueError(f"{vocab}={vocab_size!r} is not an integer; set {vocab} to a "
                         f"whole number of pieces, at least {MIN_VOCAB_SIZE}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"{vocab}={vocab_size} is smaller than {MIN_VOCAB_SIZE}: the 256 "
                         f"byte pieces of byte fallback and <unk>, <s>, </s>; set {vocab} "
                         f"to {MIN_VOCAB_SIZE} or more")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{label('model_type')}={model_type!r} must be 'unigram' or 'bpe', "
                         f"the SentencePiece model types that decode back to the text they "
                         f"encode (a 'word' model gives spaces back as U+2581)")


def _sentences(paths: PathLike | Sequence[PathLike] | None, label: Label) -> list[str]:
    """The training sentences: the non-blank lines of the UTF-8 files (or of the embedded
    corpus), concatenated in order, at most `MAX_SENTENCE_BYTES` long.

    Raises:
      FileNotFoundError, IsADirectoryError: a path is not a file.
      ValueError: a file is not UTF-8, or the files hold no line to train on.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    try:
        texts = ([read_text_file(path) for path in paths] if paths
                 else [default_corpus().decode("utf-8")])
    except ValueError as e:  # Not UTF-8: name the option that gave the file.
        raise ValueError(f"{label('paths')}: {e}") from e
    # The files as one text, as before runs recorded their tokenizer: the same sentences,
    # so a resumed run trains the same model.
    lines = [line for line in "".join(texts).split("\n") if line.strip()]
    sentences = [line for line in lines if len(line.encode("utf-8")) <= MAX_SENTENCE_BYTES]
    if not sentences:
        raise _no_text(paths, bool(lines), label)
    return sentences


def _no_text(paths: Sequence[PathLike] | None, long_lines: bool, label: Label
             ) -> ValueError:
    """The error for files that give no sentence: blank, or only ``long_lines``."""
    several = len(paths or [None]) > 1
    if long_lines:
        reason = (f"every line is longer than SentencePiece's limit of {MAX_SENTENCE_BYTES} "
                  f"bytes")
        fix = "break the text into lines"
    else:
        reason = f"{'they are' if several else 'it is'} empty or blank"
        fix = "give text with at least one non-blank line"
    files = ", ".join(os.fspath(path) for path in paths or ["<the embedded corpus>"])
    return ValueError(f"{label('paths')}: {files} {'hold' if several else 'holds'} no text "
                      f"to train a tokenizer on ({reason}); {fix}")


def _trainer_options(vocab_size: int, model_type: str) -> dict[str, Any]:
    """Options of a lossless model: decoding gives back the encoded text exactly."""
    return dict(vocab_size=int(vocab_size), model_type=model_type,
                character_coverage=CHARACTER_COVERAGE, byte_fallback=True,
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                # No U+2581 before the first word of a text: decoding gives it back as is.
                add_dummy_prefix=False,
                split_digits=True, max_sentence_length=MAX_SENTENCE_BYTES,
                # One thread: the trainer's result then depends only on its input.
                num_threads=1, minloglevel=2)


def _training_error(reason: str, vocab_size: int, model_type: str, label: Label
                    ) -> ValueError:
    """SentencePiece's complaint about ``vocab_size`` as one line naming its option."""
    vocab = label("vocab_size")
    too_small, too_large = _TOO_SMALL.search(reason), _TOO_LARGE.search(reason)
    if too_small:
        need = int(too_small.group(2))
        return ValueError(
            f"{vocab}={vocab_size} is smaller than the {need} pieces this text needs (the "
            f"{need - MIN_VOCAB_SIZE} most frequent characters, covering "
            f"{CHARACTER_COVERAGE:.2%} of it, 256 byte pieces and <unk>, <s>, </s>); set "
            f"{vocab} to {need} or more")
    if too_large:
        most = int(too_large.group(2))
        return ValueError(
            f"{vocab}={vocab_size} is more than the {most} pieces a {model_type} model can "
            f"have on this text; set {vocab} to {most} or less, or give more text")
    return ValueError(f"SentencePiece could not train a {model_type} model with "
                      f"{vocab}={vocab_size}: {reason}")


def _train_serialized(sentences: list[str], vocab_size: int, model_type: str,
                      label: Label) -> bytes:
    """Trains a model on ``sentences`` with SentencePiece's trainer; returns its bytes.

    Raises:
      ValueError: ``vocab_size`` does not suit the text, naming ``label('vocab_size')``.
    """
    spm = import_sentencepiece()
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model,
                                       **_trainer_options(vocab_size, model_type))
    except RuntimeError as e:
        reason = " ".join(str(e).split())
        raise _training_error(reason, vocab_size, model_type, label) from e
    return model.getvalue()


def _model_path(model_prefix: PathLike, label: Label) -> str:
    """``<model_prefix>.model``, once the prefix is known to name a file in a directory
    that exists."""
    prefix, name = os.fspath(model_prefix), label("model_prefix")
    if os.path.isdir(prefix) or os.path.basename(prefix) in ("", ".", ".."):
        raise ValueError(f"{name}={prefix!r} is a directory; give a file prefix such as "
                         f"{os.path.join(prefix, 'sp')!r} (the model goes to "
                         f"<model_prefix>.model)")
    directory = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{name}={prefix!r}: the directory {directory} does not "
                                f"exist; create it first")
    return f"{prefix}.model"


def train_sentencepiece(paths: PathLike | Sequence[PathLike] | None, model_prefix: PathLike,
                        vocab_size: int = 8000, model_type: str = "unigram", *,
                        option_names: Mapping[str, str] | None = None) -> str:
    """Trains a SentencePiece model on local text files; writes ``<model_prefix>.model``.

    Each non-blank line of the files is one training sentence. The model is lossless (see
    the module docstring). Training runs on one thread, so the same text and options give
    the same model. Everything is checked before SentencePiece runs, and the file is
    written whole once the model is trained: a bad input writes nothing.

    Args:
      paths: text files (UTF-8), or None for the embedded default corpus
        (`revtrain.data.default_corpus`).
      model_prefix: output path without the ``.model`` suffix, e.g. ``'out/sp'``; its
        directory must exist.
      vocab_size: number of pieces, at least 259 (256 bytes and 3 control pieces).
      model_type: SentencePiece's ``'unigram'`` (its default) or ``'bpe'``.
      option_names: how the caller's user sets each option (``paths``, ``model_prefix``,
        ``vocab_size``, ``model_type``), for messages, e.g. a program's flags (default:
        the argument names).

    Returns:
      The path of the model file, ``<model_prefix>.model``.

    Raises:
      FileNotFoundError: an input file or the output directory does not exist.
      IsADirectoryError: an input path names a directory.
      ValueError: a bad option (`check_sentencepiece_options`), a ``model_prefix`` that
        names a directory, a file that is not UTF-8 or holds no text, or a ``vocab_size``
        that does not suit the text (the message gives the bound).
    """
    label = _labeller(option_names)
    check_sentencepiece_options(vocab_size, model_type, option_names)
    path = _model_path(model_prefix, label)
    serialized = _train_serialized(_sentences(paths, label), vocab_size, model_type, label)
    temporary = f"{path}.tmp-{os.getpid()}"
    try:  # Whole or not at all: a crash never leaves half a model file.
        with open(temporary, "wb") as f:
            f.write(serialized)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return path


def trained_sentencepiece(vocab_size: int = 2048, paths: PathLike | Sequence[PathLike]
                          | None = None, model_file: PathLike | None = None,
                          model_type: str = "unigram") -> SentencePieceTokenizer:
    """A SentencePiece tokenizer: ``model_file`` when given, else one trained on the text.

    Without ``model_file`` the model is trained in memory (`train_sentencepiece`'s options,
    about a second on the 465 KB embedded corpus), deterministically, so a resumed run
    trains the same model again; the run directory keeps a copy (``tokenizer.model``).
    Messages name the options as gin bindings, ``trained_sentencepiece.vocab_size``.

    Args:
      vocab_size: pieces of a trained model, at least 259 (ignored with ``model_file``).
      paths: UTF-8 text files to train on; None for the embedded default corpus.
      model_file: an existing model; no training.
      model_type: ``'unigram'`` or ``'bpe'`` for a trained model.

    Raises:
      FileNotFoundError, IsADirectoryError, ValueError: as `SentencePieceTokenizer` and
        `train_sentencepiece`.
    """
    names = {option: f"trained_sentencepiece.{option}"
             for option in ("vocab_size", "paths", "model_type")}
    check_sentencepiece_options(vocab_size, model_type, names)
    if model_file is not None:
        return SentencePieceTokenizer(model_file)
    label = _labeller(names)
    serialized = _train_serialized(_sentences(paths, label), vocab_size, model_type, label)
    where = "the embedded corpus" if not paths else "the given files"
    return SentencePieceTokenizer.from_serialized(
        serialized, f"<trained on {where}, vocab_size={vocab_size}>")
