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


def read_corpus(paths: PathLike | Sequence[PathLike] | None) -> bytes:
    """Reads and concatenates files in the given order, or the default corpus.

    Args:
      paths: A path, a sequence of paths, or None / empty for `default_corpus()`.

    Raises:
      FileNotFoundError: A path does not name an existing file (the message names it).
      IsADirectoryError: A path names a directory.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        return default_corpus()
    chunks = []
    for path in paths:
        if os.path.isdir(path):
            raise IsADirectoryError(f"text file {os.fspath(path)!r} is a directory; pass the "
                                    f"files in it")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"text file {os.fspath(path)!r} does not exist")
        with open(path, "rb") as f:
            chunks.append(f.read())
    return b"".join(chunks)
