"""``revtrain-tokenizer``: trains a SentencePiece model on local text (see `revtrain.cli`).

``revtrain-tokenizer --input=a.txt [--input=...] --vocab_size=8000 --model_prefix=out/sp``
writes ``out/sp.model`` with `revtrain.data.train_sentencepiece` (the embedded corpus
without ``--input``). Errors are one line, ``revtrain-tokenizer: error: <message>``, exit
status 2, as the other tools', naming the flag to change; they come before SentencePiece
runs where they can (a file that is not UTF-8 or holds no text, a ``--model_prefix`` that
is a directory), and no model file is written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from absl import flags

from revtrain.cli.common import UsageError, add_tool_flags, is_chief, run

# How a user of this program sets each option of `revtrain.data.train_sentencepiece`.
_FLAGS = {"paths": "--input", "model_prefix": "--model_prefix", "vocab_size": "--vocab_size",
          "model_type": "--model_type"}


def _train_tokenizer(fv: flags.FlagValues) -> int:
    from revtrain.data import train_sentencepiece

    if not fv.model_prefix:
        raise UsageError("--model_prefix is required (the model goes to "
                         "<model_prefix>.model)")
    for path in fv.input:
        if not os.path.isfile(path):
            raise UsageError(f"--input={path}: no such file; give UTF-8 text files")
    try:
        path = train_sentencepiece(fv.input or None, fv.model_prefix, fv.vocab_size,
                                   fv.model_type, option_names=_FLAGS)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e
    if is_chief():
        print(f"wrote {path}", flush=True)
    return 0


def tokenizer_main(argv: Sequence[str] | None = None) -> int:
    """``revtrain-tokenizer``: trains a SentencePiece model; returns the exit status."""
    fv = flags.FlagValues()
    flags.DEFINE_multi_string("input", [], "A UTF-8 text file to train on; repeat for "
                              "several (default: the embedded corpus).", flag_values=fv)
    flags.DEFINE_string("model_prefix", None, "Output path without '.model'.",
                        flag_values=fv)
    # No absl bound: the one option check (`check_sentencepiece_options`) refuses a small
    # value with the reason (the byte pieces) before anything is read or written.
    flags.DEFINE_integer("vocab_size", 8000, "Number of pieces (at least 259: 256 byte "
                         "pieces and <unk>, <s>, </s>).", flag_values=fv)
    flags.DEFINE_enum("model_type", "unigram", ["unigram", "bpe"], "SentencePiece's model "
                      "type.", flag_values=fv)
    add_tool_flags(fv)
    return run("revtrain-tokenizer", fv, argv, _train_tokenizer)
