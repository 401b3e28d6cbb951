"""Text files the tokenizer tests and docs/troubleshooting.md's rows share (not a test file).

Each is named by the placeholder the troubleshooting page uses for it.
"""
import os

# 400 lines of an English pangram and five Greek letters: 63 characters, all frequent, so
# a SentencePiece model of it needs 63 + 256 byte pieces + <unk>, <s>, </s> = 322 pieces.
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog; "
               + "".join(chr(0x3B1 + (i + k) % 24) for k in range(5)) + "\n"
               for i in range(400))
TEXT_NEEDS = 322

CONTENTS = {
    "<a text file>": TEXT.encode("utf-8"),
    "<a Latin-1 file>": "café\nnaïve\n".encode("latin-1"),  # 0xe9 at byte offset 3.
    "<a binary file>": bytes(range(256)),  # 0x80 at byte offset 128, on line 2.
    "<an empty file>": b"",
    "<a blank file>": b"  \n\n\t\r\n",
}
A_DIRECTORY = "<a directory>"


def make_text_files(directory) -> dict[str, str]:
    """Writes each file of `CONTENTS` (and an empty directory) in ``directory``; returns
    their paths by placeholder."""
    paths = {A_DIRECTORY: os.path.join(directory, "a_directory")}
    os.makedirs(paths[A_DIRECTORY])
    for i, (placeholder, data) in enumerate(CONTENTS.items()):
        paths[placeholder] = os.path.join(directory, f"file_{i}.txt")
        with open(paths[placeholder], "wb") as f:
            f.write(data)
    return paths


def fill_in(text: str, paths: dict[str, str]) -> str:
    """``text`` with each placeholder replaced by its path."""
    for placeholder, path in paths.items():
        text = text.replace(placeholder, path)
    return text
