"""A full disk for chosen files, without root: their writes raise ENOSPC (not a test file).

`fill_disk` patches ``open``: a file opened for writing whose name contains one of the
given parts is returned wrapped, and every ``write``/``flush`` of it raises
``OSError(ENOSPC)``, as writing to a full file system does (``close`` still closes it).
"""
import builtins
import errno
import os


def no_space() -> OSError:
    """The error a write to a full disk raises."""
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullFile:
    def __init__(self, file):
        self._file = file

    def write(self, data):
        raise no_space()

    def flush(self):
        raise no_space()

    def close(self):
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __getattr__(self, name):
        return getattr(self._file, name)


def fill_disk(monkeypatch, *parts: str) -> None:
    """Makes writes to files whose name contains any of ``parts`` fail with ENOSPC."""
    real_open = builtins.open

    def full_open(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        name = os.path.basename(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else ""
        if any(c in mode for c in "wax+") and any(part in name for part in parts):
            return _FullFile(file)
        return file

    monkeypatch.setattr(builtins, "open", full_open)
