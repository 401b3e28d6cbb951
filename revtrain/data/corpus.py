"""The text corpus of the language-model streams: local files, or the embedded default.

The default corpus ships with Python itself: the documentation topics in the standard
library module `pydoc_data.topics` (about 465 KB of English prose and code), so the default
run needs no download.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

PathLike = str | os.PathLike


def default_corpus() -> bytes:
    """The default corpus: `pydoc_data.topics.topics` values in sorted-key order, UTF-8.

    Raises:
      ImportError: This Python build lacks `pydoc_data` (some distributions split it into
        a separate package); pass text files instead.
    """
    try:
        from pydoc_data import topics
    except ImportError as err:
        raise ImportError(
            "the default corpus needs the standard library module pydoc_data, which this "
            "Python lacks; pass TextFiles(paths=[...]) with your own text files"
        ) from err
    return "".join(topics.topics[key] for key in sorted(topics.topics)).encode("utf-8")


def check_utf8(data: bytes, source: str) -> str:
    """The text of ``data``, which must be UTF-8: the one check of every text file that
    revtrain reads as UTF-8 (tokenizer training, subword `TextFiles`, prompts files).

    Args:
      data: the file's bytes.
      source: the file's name, for the message.

    Returns:
      ``data`` decoded as UTF-8.

    Raises:
      ValueError: ``data`` is not UTF-8; one line naming ``source``, the byte offset (from
        0) and line (from 1) of the first byte that is not, and the fix.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"text file {source!r} is not UTF-8: byte offset {e.start} (line {line}) holds "
            f"0x{data[e.start]:02x}, {e.reason}; convert the file to UTF-8 (e.g. iconv -f "
            f"LATIN1 -t UTF-8 for Latin-1 text) or give a UTF-8 text file") from None


def read_text_file(path: PathLike) -> str:
    """The text of the UTF-8 file ``path`` (`check_utf8`'s check).

    Raises:
      FileNotFoundError: ``path`` does not name an existing file (the message names it).
      IsADirectoryError: ``path`` names a directory.
      ValueError: the file is not UTF-8 (the message names the file and the byte offset).
    """
    return check_utf8(_read_file(path), os.fspath(path))


def _read_file(path: PathLike) -> bytes:
    if os.path.isdir(path):
        raise IsADirectoryError(f"text file {os.fspath(path)!r} is a directory; pass the "
                                f"files in it")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text file {os.fspath(path)!r} does not exist")
    with open(path, "rb") as f:
        return f.read()


def read_corpus(paths: PathLike | Sequence[PathLike] | None, utf8: bool = False) -> bytes:
    """Reads and concatenates files in the given order, or the default corpus.

    Args:
      paths: A path, a sequence of paths, or None / empty for `default_corpus()`.
      utf8: Check that each file is UTF-8 text (`check_utf8`): for readers that decode the
        text (subword tokenizers); byte-level streams take any bytes.

    Raises:
      FileNotFoundError: A path does not name an existing file (the message names it).
      IsADirectoryError: A path names a directory.
      ValueError: With ``utf8``, a file that is not UTF-8 (the message names it and the
        byte offset).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        return default_corpus()
    chunks = []
    for path in paths:
        chunks.append(_read_file(path))
        if utf8:
            check_utf8(chunks[-1], os.fspath(path))
    return b"".join(chunks)
