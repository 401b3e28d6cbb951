"""The run directory's record of its tokenizer: ``tokenizer.json`` (+ ``tokenizer.model``).

A training run writes which tokenizer made its tokens once its inputs are validated
(`write_run_tokenizer`), next to its checkpoints: ``tokenizer.json`` holds the type, the
vocabulary size and the fingerprint (`revtrain.data.Tokenizer.fingerprint`), and a
SentencePiece model is copied to ``tokenizer.model``. ``revtrain-eval`` and
``revtrain-decode`` read the copy (`read_run_tokenizer`), so they encode and decode with the
run's own tokenizer whether or not the original model file still exists, with no flag.

A resumed run must tokenize as the run it continues: `check_run_tokenizer` compares the
configured tokenizer with the record before anything is written, and a difference is one
line naming the binding. Train, eval and decode all read the record through
`read_run_record`, which rebuilds a damaged one as ``checkpoints/retention.json`` is
rebuilt -- with a warning naming the file, and rewritten -- from what the run still has:

- ``tokenizer.json`` missing, cut short or not a record, and ``tokenizer.model`` there:
  the record is rebuilt from the copy, checked against the checkpoint's embedding (its
  ids must fit its rows). A byte tokenizer is never assumed for a run with a model copy.
- neither file, checkpoints, and the run's ``config.gin`` binds a SentencePiece tokenizer:
  refused in one line that says so and which model file to copy to ``tokenizer.model``.
- no ``tokenizer.json`` and no copy, checkpoints, and a ``config.gin`` that binds no
  SentencePiece tokenizer: a run from before runs recorded their tokenizer, when every run was
  byte-level; it counts as `ByteTokenizer` (a damaged record there is rebuilt as one).
  Without checkpoints nothing was trained: there is no record to keep.
- ``tokenizer.model`` missing or damaged under a good record: the copy is restored from
  the model file the run's ``config.gin`` names when that file has the recorded
  fingerprint (training rewrites it from its configured tokenizer anyway); otherwise one
  line says which model (ids, fingerprint) to copy where.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import gin
from gin import config_parser

from revtrain.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, Tokenizer
from revtrain.training.checkpoints import Checkpointer
from revtrain.training.run_directory import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    TOKENIZER_FILE,
    TOKENIZER_MODEL_FILE,
)
from revtrain.training.run_files import UnreadableFileError, read_json, write_atomic
from revtrain.training.write_failures import (
    checkpoint_steps,
    reporting_write_failures,
    short_reason,
)

logger = logging.getLogger(__name__)

_TYPES = {"ByteTokenizer": ByteTokenizer, "SentencePieceTokenizer": SentencePieceTokenizer}
# How an operative config.gin binds a SentencePiece tokenizer, and the model file it names.
_SENTENCEPIECE = re.compile(r"@(?:SentencePieceTokenizer|trained_sentencepiece)\b")
EMBEDDING = "weights/0/0"  # The flat path of a revtrain language model's token embedding.


def tokenizer_record(tokenizer: Tokenizer) -> dict[str, Any]:
    """The JSON record of ``tokenizer``: ``{'type', 'vocab_size', 'fingerprint'}`` (plus
    ``'model_file'``, the copy's name, for SentencePiece)."""
    record = {"type": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size,
              "fingerprint": tokenizer.fingerprint()}
    if isinstance(tokenizer, SentencePieceTokenizer):
        record["model_file"] = TOKENIZER_MODEL_FILE
    return record


def _configured_sentencepiece(output_dir: str) -> tuple[bool, str | None]:
    """Whether the run's ``config.gin`` binds a SentencePiece tokenizer, and the
    ``SentencePieceTokenizer.model_file`` it names (None: none, or no readable config).

    The file is read with gin's own parser, nothing applied: gin writes a long value on
    the line after its binding (``model_file = \\``), which a line-wise match misses.
    """
    try:
        with open(os.path.join(output_dir, CONFIG_FILE), encoding="utf-8",
                  errors="replace") as f:
            text = f.read()
    except OSError:
        return False, None
    model_file = None
    try:
        for statement in config_parser.ConfigParser(
                text, gin.config.ParserDelegate(skip_unknown=True)):
            if (isinstance(statement, config_parser.BindingStatement)
                    and statement.selector == "SentencePieceTokenizer"
                    and statement.arg_name == "model_file"
                    and isinstance(statement.value, str)):
                model_file = statement.value
    except (SyntaxError, ValueError):  # A damaged config: no file named.
        model_file = None
    return bool(_SENTENCEPIECE.search(text)), model_file


def embedding_rows(output_dir: str) -> int | None:
    """Rows of the token embedding (``weights/0/0``, ``[vocab_size, d_model]``) in the
    newest readable checkpoint of the run, from its metadata; None when there is none."""
    directory = os.path.join(output_dir, CHECKPOINT_DIR)
    if not checkpoint_steps(directory):
        return None
    checkpointer = Checkpointer(directory, max_to_keep=None, read_only=True)
    try:
        for step in reversed(checkpointer.all_steps()):
            try:
                shape = checkpointer.saved_signatures(step).get(EMBEDDING, ((),))[0]
            except Exception:  # noqa: BLE001  A damaged step: the one before it.
                continue
            return shape[0] if len(shape) == 2 else None
        return None
    finally:
        checkpointer.close()


def _load_copy(path: str) -> SentencePieceTokenizer:
    """The SentencePiece model in ``path``.

    Raises:
      FileNotFoundError: there is no ``path``.
      UnreadableFileError: it cannot be read or is not a SentencePiece model.
    """
    try:
        with open(path, "rb") as f:
            return SentencePieceTokenizer.from_serialized(f.read(), path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        reason = str(e).split("; give the bytes")[0]
        raise UnreadableFileError(f"the run's tokenizer copy {path} cannot be read "
                                  f"({reason})") from e


def _rewrite(path: str, data: str | bytes) -> str:
    """Writes a rebuilt file; says how that went (a reader may not be able to write)."""
    try:
        write_atomic(path, data)
    except OSError as e:
        return f"; it could not be rewritten ({short_reason(e)})"
    return ""


def _rebuilt_record(output_dir: str, damage: str | None) -> dict[str, Any] | None:
    """The record of a run whose ``tokenizer.json`` is missing (``damage`` None) or
    damaged (``damage`` says how), from what the run still has (the module docstring).

    Raises:
      UnreadableFileError: the run's tokenizer cannot be known; says what to copy where.
    """
    record_path = os.path.join(output_dir, TOKENIZER_FILE)
    model_path = os.path.join(output_dir, TOKENIZER_MODEL_FILE)
    what = damage or f"{record_path} is missing"
    sentencepiece, model_file = _configured_sentencepiece(output_dir)
    if os.path.exists(model_path):
        try:
            tokenizer: Tokenizer = _load_copy(model_path)
        except UnreadableFileError as e:
            raise UnreadableFileError(f"{what}, and {e}; copy the SentencePiece model the "
                                      f"run was trained with to {model_path}") from e
        source = model_path
    elif not checkpoint_steps(os.path.join(output_dir, CHECKPOINT_DIR)):
        return None  # Nothing trained yet: the run writes its record again.
    elif sentencepiece:
        model = (f"{model_file} (the model file its {CONFIG_FILE} names) if it is unchanged "
                 f"since the run" if model_file else "the SentencePiece model it was "
                 "trained with")
        raise UnreadableFileError(
            f"{what} and so is {model_path}, but the run in {output_dir} was trained with a "
            f"SentencePiece tokenizer (its {CONFIG_FILE} binds one), not bytes; copy "
            f"{model} to {model_path} (the record is rebuilt from it), or train in a new "
            f"output_dir")
    elif damage is None:  # A run from before runs recorded their tokenizer.
        return tokenizer_record(ByteTokenizer())
    else:
        tokenizer, source = ByteTokenizer(), f"bytes (no {model_path}, and {CONFIG_FILE} " \
                                             f"binds no SentencePiece tokenizer)"
    rows = embedding_rows(output_dir)
    if rows is not None and tokenizer.vocab_size > rows:
        raise UnreadableFileError(
            f"{what}, and {source} cannot be the run's tokenizer: its {tokenizer.vocab_size}"
            f" ids do not fit the {rows} rows of the checkpoint's embedding; copy the "
            f"SentencePiece model the run was trained with to {model_path}, or train in a "
            f"new output_dir")
    record = tokenizer_record(tokenizer)
    fits = "" if rows is None else f", whose ids fit the checkpoint's embedding ({rows} rows)"
    rewritten = _rewrite(record_path, json.dumps(record, indent=1) + "\n")
    logger.warning("%s; it is rebuilt from %s: %s%s%s", what, source, tokenizer.describe(),
                   fits, rewritten)
    return record


def read_run_record(output_dir: str) -> dict[str, Any] | None:
    """The run's tokenizer record, rebuilt (with a warning) when ``tokenizer.json`` is
    missing or damaged (the module docstring); None for a directory without a run.

    Raises:
      UnreadableFileError: the record cannot be rebuilt; one line saying what to do.
    """
    path = os.path.join(output_dir, TOKENIZER_FILE)
    try:
        record = read_json(path)
    except FileNotFoundError:
        return _rebuilt_record(output_dir, None)
    except UnreadableFileError as e:
        return _rebuilt_record(output_dir, str(e))
    if not isinstance(record, dict) or record.get("type") not in _TYPES:
        return _rebuilt_record(output_dir, f"{path} is not a tokenizer record (type must be "
                                           f"one of {sorted(_TYPES)})")
    return record


def read_run_tokenizer(output_dir: str) -> Tokenizer | None:
    """The tokenizer a run was trained with (the copy in its directory), or None.

    A missing or damaged copy is restored from the model file the run's ``config.gin``
    names when that has the recorded fingerprint.

    Raises:
      UnreadableFileError: the record or the copy cannot be read or rebuilt; one line
        saying which model to copy where.
    """
    record = read_run_record(output_dir)
    if record is None:
        return None
    if record["type"] == "ByteTokenizer":
        return ByteTokenizer()
    path = os.path.join(output_dir, record.get("model_file", TOKENIZER_MODEL_FILE))
    try:
        tokenizer = _load_copy(path)
        if tokenizer.fingerprint() == record.get("fingerprint"):
            return tokenizer
        problem = (f"the run's tokenizer copy {path} does not match "
                   f"{os.path.join(output_dir, TOKENIZER_FILE)}")
    except FileNotFoundError:
        problem = f"the run's tokenizer copy {path} is missing"
    except UnreadableFileError as e:
        problem = str(e)
    return _restored_copy(output_dir, record, path, problem)


def _restored_copy(output_dir: str, record: dict[str, Any], path: str,
                   problem: str) -> SentencePieceTokenizer:
    """The run's model from the file its ``config.gin`` names, written back to ``path``,
    when its fingerprint is the record's.

    Raises:
      UnreadableFileError: ``problem``, and which model (ids, fingerprint) to copy where.
    """
    _, model_file = _configured_sentencepiece(output_dir)
    fingerprint = str(record.get("fingerprint"))
    other = ""
    if model_file is not None and os.path.isfile(model_file):
        try:
            source = _load_copy(model_file)
        except UnreadableFileError:
            source = None
        if source is not None and source.fingerprint() == fingerprint:
            rewritten = _rewrite(path, source.serialized_model)
            logger.warning("%s; it is restored from %s (the model file %s names), which has "
                           "the recorded fingerprint %s%s", problem, model_file, CONFIG_FILE,
                           fingerprint[:8], rewritten)
            return source
        other = f" ({model_file}, which {CONFIG_FILE} names, is another model)"
    raise UnreadableFileError(f"{problem}; copy the SentencePiece model the run was trained "
                              f"with ({record.get('vocab_size')} ids, fingerprint "
                              f"{fingerprint[:8]}) to {path}{other}")


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
