"""The run directory's record of its tokenizer: ``tokenizer.json`` (+ ``tokenizer.model``).

A training run writes which tokenizer made its tokens once its inputs are validated
(`write_run_tokenizer`), next to its checkpoints: ``tokenizer.json`` holds the type, the
vocabulary size and the fingerprint (`revtrain.data.Tokenizer.fingerprint`), and a
SentencePiece model is copied to ``tokenizer.model``. ``revtrain-eval`` and
``revtrain-decode`` read the copy (`read_run_tokenizer`), so they encode and decode with the
run's own tokenizer whether or not the original model file still exists, with no flag.

A resumed run must tokenize as the run it continues: `check_run_tokenizer` compares the
configured tokenizer with the record before anything is written, and a difference is one
line naming the binding. A run directory with checkpoints and no record was written before
runs recorded their tokenizer, when every run was byte-level: it counts as `ByteTokenizer`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from revtrain.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, Tokenizer
from revtrain.training.run_directory import (
    CHECKPOINT_DIR,
    TOKENIZER_FILE,
    TOKENIZER_MODEL_FILE,
)
from revtrain.training.run_files import UnreadableFileError, read_json, write_atomic
from revtrain.training.write_failures import reporting_write_failures

_TYPES = {"ByteTokenizer": ByteTokenizer, "SentencePieceTokenizer": SentencePieceTokenizer}


def tokenizer_record(tokenizer: Tokenizer) -> dict[str, Any]:
    """The JSON record of ``tokenizer``: ``{'type', 'vocab_size', 'fingerprint'}`` (plus
    ``'model_file'``, the copy's name, for SentencePiece)."""
    record = {"type": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size,
              "fingerprint": tokenizer.fingerprint()}
    if isinstance(tokenizer, SentencePieceTokenizer):
        record["model_file"] = TOKENIZER_MODEL_FILE
    return record


def _has_checkpoints(output_dir: str) -> bool:
    directory = os.path.join(output_dir, CHECKPOINT_DIR)
    return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def read_run_record(output_dir: str) -> dict[str, Any] | None:
    """The run's tokenizer record; a `ByteTokenizer`'s for a run with checkpoints and no
    record (older runs); None for a run without either.

    Raises:
      UnreadableFileError: ``tokenizer.json`` is damaged.
    """
    path = os.path.join(output_dir, TOKENIZER_FILE)
    if os.path.isfile(path):
        record = read_json(path)
        if not isinstance(record, dict) or record.get("type") not in _TYPES:
            raise UnreadableFileError(f"{path} is not a tokenizer record (type must be one "
                                      f"of {sorted(_TYPES)})")
        return record
    return tokenizer_record(ByteTokenizer()) if _has_checkpoints(output_dir) else None


def read_run_tokenizer(output_dir: str) -> Tokenizer | None:
    """The tokenizer a run was trained with (the copy in its directory), or None.

    Raises:
      UnreadableFileError: the record or its model copy is damaged or missing.
    """
    record = read_run_record(output_dir)
    if record is None:
        return None
    if record["type"] == "ByteTokenizer":
        return ByteTokenizer()
    path = os.path.join(output_dir, record.get("model_file", TOKENIZER_MODEL_FILE))
    try:
        with open(path, "rb") as f:
            tokenizer = SentencePieceTokenizer.from_serialized(f.read(), path)
    except (OSError, ValueError) as e:
        raise UnreadableFileError(f"the run's tokenizer copy {path} cannot be read "
                                  f"({e})") from e
    if tokenizer.fingerprint() != record.get("fingerprint"):
        raise UnreadableFileError(f"the run's tokenizer copy {path} does not match "
                                  f"{os.path.join(output_dir, TOKENIZER_FILE)}")
    return tokenizer


def check_run_tokenizer(output_dir: str | None, tokenizer: Tokenizer | None,
                        binding: str) -> None:
    """Checks ``tokenizer`` is the one the run in ``output_dir`` was trained with.

    Passes when there is no directory, no tokenizer (non-text data) or no record.

    Args:
      output_dir: the run directory.
      tokenizer: the configured data's tokenizer.
      binding: the gin binding that sets it, e.g. ``'TextFiles.tokenizer'``.

    Raises:
      ValueError: one line naming ``binding``, both tokenizers and the fixes.
    """
    if output_dir is None or tokenizer is None:
        return
    record = read_run_record(output_dir)
    if record is None or record.get("fingerprint") == tokenizer.fingerprint():
        return
    recorded = (f"{record['type']} ({record.get('vocab_size')} ids, "
                f"{str(record.get('fingerprint'))[:8]})")
    copy = (f" (its copy: {os.path.join(output_dir, TOKENIZER_MODEL_FILE)})"
            if record["type"] == "SentencePieceTokenizer" else "")
    raise ValueError(f"{binding} is {tokenizer.describe()}, but the run in {output_dir} was "
                     f"trained with {recorded}{copy}; bind {binding} to the run's "
                     f"tokenizer, or train in a new output_dir")


def write_run_tokenizer(output_dir: str, tokenizer: Tokenizer | None) -> None:
    """Writes ``tokenizer.json`` (and ``tokenizer.model`` for SentencePiece), each whole
    or not at all; nothing for data without a tokenizer. The model copy is written
    first, so a record never names a missing copy.

    Raises:
      RunWriteError: a file could not be written (e.g. a full disk); one line, as every
        file of a run (`revtrain.training.write_failures`).
    """
    if tokenizer is None:
        return
    checkpoints = os.path.join(output_dir, CHECKPOINT_DIR)
    if isinstance(tokenizer, SentencePieceTokenizer):
        path = os.path.join(output_dir, TOKENIZER_MODEL_FILE)
        with reporting_write_failures(f"write {path}", checkpoints):
            write_atomic(path, tokenizer.serialized_model)
    path = os.path.join(output_dir, TOKENIZER_FILE)
    with reporting_write_failures(f"write {path}", checkpoints):
        write_atomic(path, json.dumps(tokenizer_record(tokenizer), indent=1) + "\n")


def tokenizer_binding(inputs: Any) -> str:
    """The gin binding of an `Inputs`' tokenizer, e.g. ``'TextFiles.tokenizer'``."""
    return f"{type(inputs).__name__}.tokenizer"
