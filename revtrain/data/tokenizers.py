"""Tokenizers: text to token ids and back, for the language-model streams.

Two tokenizers share one interface (`Tokenizer`):

* `ByteTokenizer`: the UTF-8 bytes of the text, vocabulary 256 (revtrain's original
  behaviour, and the default of `revtrain.data.TextFiles` and `revtrain.data.TFDS`).
* `SentencePieceTokenizer`: a SentencePiece model file (Kudo and Richardson, 2018), the
  subword tokenizer of T5, Trax, Paxml and MaxText, through the ``sentencepiece`` package.

`revtrain.data.sentencepiece_training` trains models: `train_sentencepiece` writes a model
file (``revtrain-tokenizer`` on the command line), `trained_sentencepiece` returns a
tokenizer trained in memory.

Bits per byte across tokenizers: `Tokenizer.token_bytes` gives the number of UTF-8 bytes
each id stands for, so an evaluation can divide its summed loss by the bytes of the text
it scored (`revtrain.training.Evaluator`). The count is exact when decoding gives back the
text that was encoded: always for bytes, and for SentencePiece models trained by
`train_sentencepiece` (identity normalisation, whitespace kept, no dummy prefix, byte
fallback for characters outside the vocabulary). Models that normalise text (NFKC, collapsed spaces)
count the bytes of the normalised text.

References:
  Kudo, T. and Richardson, J. (2018). SentencePiece: A simple and language independent
  subword tokenizer and detokenizer for Neural Text Processing. EMNLP (demo).
  https://github.com/google/sentencepiece
"""

from __future__ import annotations

import abc
import hashlib
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from revtrain.data.corpus import PathLike

BYTE_VOCAB_SIZE = 256
# The prefix SentencePiece writes for a space (U+2581, "lower one eighth block").
_SPACE = "\u2581"


class Tokenizer(abc.ABC):
    """Text to int32 token ids in ``[0, vocab_size)`` and back.

    Attributes:
      vocab_size: number of token ids.
      byte_level: each id is one byte of UTF-8 text (so a loss per token is one per byte).
    """

    vocab_size: int
    byte_level: bool = False

    @abc.abstractmethod
    def encode(self, text: str | bytes) -> np.ndarray:
        """int32 ``[n_tokens]`` ids of ``text`` (bytes are read as UTF-8)."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""

    @abc.abstractmethod
    def token_bytes(self) -> np.ndarray:
        """int32 ``[vocab_size]``: how many UTF-8 bytes of text each id stands for (0 for
        control ids such as ``<s>`` and for unknown ids)."""

    @abc.abstractmethod
    def fingerprint(self) -> str:
        """A hex digest of everything that decides the ids of a text: two tokenizers with
        the same fingerprint encode every text alike."""

    def describe(self) -> str:
        """A short name for messages, e.g. ``SentencePieceTokenizer (2000 ids, a1b2c3d4)``."""
        return f"{type(self).__name__} ({self.vocab_size} ids, {self.fingerprint()[:8]})"


def _as_bytes(text: str | bytes) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)


class ByteTokenizer(Tokenizer):
    """The UTF-8 bytes of the text as ids in ``[0, 256)``.

    Examples:
      >>> tokenizer = ByteTokenizer()
      >>> tokenizer.encode("hé").tolist()
      [104, 195, 169]
      >>> tokenizer.decode([104, 195, 169])
      'hé'
    """

    vocab_size = BYTE_VOCAB_SIZE
    byte_level = True

    def encode(self, text: str | bytes) -> np.ndarray:
        """int32 ``[n_bytes]``: the UTF-8 bytes of ``text``."""
        return np.frombuffer(_as_bytes(text), np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """The bytes ``ids`` as UTF-8 text (invalid sequences become U+FFFD).

        Raises:
          ValueError: an id outside ``[0, 256)``.
        """
        return bytes([int(i) for i in ids]).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        """Ones: every id is one byte."""
        return np.ones(BYTE_VOCAB_SIZE, np.int32)

    def fingerprint(self) -> str:
        """The same for every `ByteTokenizer`."""
        return hashlib.sha256(b"revtrain.ByteTokenizer").hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(ByteTokenizer)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def import_sentencepiece() -> Any:
    """The ``sentencepiece`` module.

    Raises:
      ImportError: it is not installed, with the command that installs it.
    """
    try:
        import sentencepiece
    except ImportError as err:  # A dependency of revtrain; missing only in odd installs.
        raise ImportError("SentencePieceTokenizer needs the sentencepiece package; install "
                          "it with `pip install sentencepiece`") from err
    return sentencepiece


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (``.model`` file) as a tokenizer.

    Ids are the model's piece ids (``vocab_size`` = its number of pieces); text is encoded
    without ``<s>``/``</s>`` (the streams cut windows out of one long run of ids).

    Args:
      model_file: the path of a SentencePiece model file, e.g. one written by
        `train_sentencepiece` or ``revtrain-tokenizer``.

    Raises:
      FileNotFoundError: ``model_file`` does not exist (the message names the binding
        ``SentencePieceTokenizer.model_file``).
      ValueError: ``model_file`` cannot be read or is not a SentencePiece model.
    """

    def __init__(self, model_file: PathLike):
        path = os.fspath(model_file)
        binding = f"SentencePieceTokenizer.model_file={path!r}"
        fix = ("train one with revtrain-tokenizer --input=<text files> --vocab_size=8000 "
               "--model_prefix=<path>, and change the gin binding "
               "SentencePieceTokenizer.model_file")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{binding} does not exist; {fix}")
        try:
            with open(path, "rb") as f:
                serialized = f.read()
        except OSError as e:
            raise ValueError(f"{binding} cannot be read ({e.strerror or e}); {fix}") from e
        self._load(serialized, f"{binding} is not a SentencePiece model", fix)
        self.model_file = path

    @classmethod
    def from_serialized(cls, serialized: bytes, source: str = "<memory>"
                        ) -> SentencePieceTokenizer:
        """A tokenizer of a serialized model (the bytes of a ``.model`` file).

        Args:
          serialized: the model's bytes.
          source: where they came from, for messages and `model_file`.

        Raises:
          ValueError: ``serialized`` is not a SentencePiece model.
        """
        tokenizer = cls.__new__(cls)
        tokenizer._load(serialized, f"{source} is not a SentencePiece model",
                        "give the bytes of a .model file")
        tokenizer.model_file = source
        return tokenizer

    def _load(self, serialized: bytes, what: str, fix: str) -> None:
        spm = import_sentencepiece()
        if not serialized:
            raise ValueError(f"{what} (the file is empty); {fix}")
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(serialized)
        except Exception as e:  # noqa: BLE001  sentencepiece raises RuntimeError/OSError.
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ValueError(f"{what} ({reason}); {fix}") from e
        self._processor = processor
        self.serialized_model = bytes(serialized)
        self.vocab_size = int(processor.GetPieceSize())
        self._fingerprint = _model_fingerprint(self.serialized_model)

    def encode(self, text: str | bytes) -> np.ndarray:
        """int32 ``[n_tokens]`` piece ids of ``text`` (bytes are decoded as UTF-8, invalid
        sequences as U+FFFD)."""
        if not isinstance(text, str):
            text = bytes(text).decode("utf-8", errors="replace")
        return np.asarray(self._processor.EncodeAsIds(text), np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of piece ids ``ids``."""
        return self._processor.DecodeIds([int(i) for i in ids])

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes per piece: a byte piece (``<0x0A>``) is 1, a normal or user-defined
        piece is its text with U+2581 read as a space, control and unknown pieces 0."""
        processor = self._processor
        counts = np.zeros(self.vocab_size, np.int32)
        for i in range(self.vocab_size):
            if processor.IsByte(i):
                counts[i] = 1
            elif not (processor.IsControl(i) or processor.IsUnknown(i)
                      or processor.IsUnused(i)):
                piece = processor.IdToPiece(i).replace(_SPACE, " ")
                counts[i] = len(piece.encode("utf-8"))
        return counts

    def fingerprint(self) -> str:
        """sha256 of the pieces, scores, normaliser and encoding options of the model
        (not of how it was trained: file names and thread counts do not count)."""
        return self._fingerprint

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, SentencePieceTokenizer)
                and other.fingerprint() == self.fingerprint())

    def __hash__(self) -> int:
        return hash(self._fingerprint)

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(model_file={self.model_file!r})"


# Trainer options that do not change how a trained model encodes text.
_TRAINING_ONLY = ("input", "input_format", "model_prefix", "num_threads",
                  "input_sentence_size", "shuffle_input_sentence", "seed_sentencepiece_size",
                  "mining_sentence_size", "training_sentence_size")


def _model_fingerprint(serialized: bytes) -> str:
    """sha256 of a serialized ModelProto without its training-only trainer options."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(serialized)
    for field in _TRAINING_ONLY:
        model.trainer_spec.ClearField(field)
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


def check_tokenizer(tokenizer: Tokenizer | None, binding: str) -> Tokenizer:
    """``tokenizer``, or a `ByteTokenizer` for None.

    Raises:
      TypeError: ``tokenizer`` is not a `Tokenizer`, naming ``binding``.
    """
    if tokenizer is None:
        return ByteTokenizer()
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"{binding}={tokenizer!r} is not a tokenizer; bind it to "
                        f"@ByteTokenizer() or @SentencePieceTokenizer()")
    return tokenizer
