"""Tests of revtrain/data/corpus.py: reading text files, and the one UTF-8 check."""
import pytest

from revtrain.data.corpus import check_utf8, read_corpus, read_text_file

LATIN1 = "naïve\ncafé\n".encode("latin-1")  # 0xef at offset 2: not UTF-8.


def test_utf8_text_is_decoded_and_anything_else_names_the_file_offset_and_line(tmp_path):
    assert check_utf8("naïve 中文\n".encode(), "a.txt") == "naïve 中文\n"
    with pytest.raises(ValueError, match=r"^text file 'a.txt' is not UTF-8: byte offset 2 "
                                         r"\(line 1\) holds 0xef, invalid continuation "
                                         r"byte; convert the file to UTF-8"):
        check_utf8(LATIN1, "a.txt")
    with pytest.raises(ValueError, match=r"byte offset 9 \(line 2\) holds 0xe9"):
        check_utf8(b"ok\nabcdef\xe9", "a.txt")  # Half a character at the end.
    with pytest.raises(ValueError, match=r"byte offset 0 \(line 1\) holds 0xff, invalid "
                                         r"start byte"):
        check_utf8(b"\xff\xfeb\x00", "a.txt")  # UTF-16 with a byte order mark.
    path = tmp_path / "latin1.txt"
    path.write_bytes(LATIN1)
    with pytest.raises(ValueError, match=rf"^text file '{path}' is not UTF-8"):
        read_text_file(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_text_file(tmp_path / "missing.txt")


def test_read_corpus_checks_utf8_only_when_asked_and_names_the_file_that_is_not(tmp_path):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.bin"
    good.write_text("héllo\n", encoding="utf-8")
    bad.write_bytes(LATIN1)
    assert read_corpus([good, bad]) == good.read_bytes() + LATIN1  # Bytes: any bytes.
    assert read_corpus([good], utf8=True) == good.read_bytes()
    with pytest.raises(ValueError, match=rf"^text file '{bad}' is not UTF-8: byte offset 2"):
        read_corpus([good, bad], utf8=True)  # The offset is within the file named.
