"""``revtrain-decode``: continues prompts with a run's language model and writes
``output_dir/decoder_out/step_<N>.jsonl``, with the tokenizer the run recorded."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from absl import flags

from revtrain.cli.bounded_flags import MAX_SEED, define_real
from revtrain.cli.cache_flags import define_cache_flags
from revtrain.cli.common import UsageError, common_flags, is_chief, run
from revtrain.cli.saved_run import read_run
from revtrain.training.run_directory import DECODER_DIR


def _decode(fv: flags.FlagValues) -> int:
    from revtrain.data import ByteTokenizer
    from revtrain.training.decode_program import (
        decode_length,
        decode_to_file,
        default_length_note,
        load_decoder,
        new_bytes_per_prompt,
    )
    from revtrain.training.decoding import check_sampling
    from revtrain.training.run_tokenizer import read_run_tokenizer

    if fv.prompts_file and fv["prompt"].present:
        raise UsageError("give --prompt or --prompts_file, not both")
    try:  # Before anything is loaded: e.g. --top_k at --temperature=0 would be ignored.
        check_sampling(fv.temperature, fv.top_k, fv.top_p, prefix="--")
    except ValueError as e:
        raise UsageError(str(e)) from e
    prompts = _read_prompts(fv.prompts_file) if fv.prompts_file else [_prompt(fv.prompt)]
    output_dir, configs, _ = read_run(fv)  # Turns the compilation cache on.
    tokenizer = read_run_tokenizer(output_dir) or ByteTokenizer()
    # The cache holds what this decode needs, not the model's max_len (maybe 2**40).
    decoder, step = load_decoder(configs["run"], output_dir, fv.step, fv.allow_random_init,
                                 fv.cache, decode_length(prompts, fv.max_new_bytes, tokenizer))
    try:  # Every prompt's length, checked before any is decoded: a flag the user fixes.
        lengths = new_bytes_per_prompt(decoder, prompts, fv.max_new_bytes, tokenizer)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if fv.max_new_bytes is None and is_chief():
        print(f"revtrain-decode: {default_length_note(decoder, lengths)}", file=sys.stderr)
    path = os.path.join(output_dir, DECODER_DIR, f"step_{step}.jsonl")
    records = decode_to_file(decoder, prompts, path, fv.max_new_bytes, fv.temperature,
                             fv.seed, fv.top_k, fv.top_p, tokenizer)
    if is_chief():
        for record in records:
            print(record["prompt"] + record["continuation"], flush=True)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _prompt(prompt: str) -> str:
    """``--prompt``, refused in one line when it is empty or not UTF-8 (argv bytes that
    are not UTF-8 arrive as surrogates), before anything is loaded."""
    if not prompt:
        raise UsageError("--prompt is empty; give text to continue (--prompt='def '), or "
                         "leave the flag out to continue a newline")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = os.fsencode(prompt)
        offset = len(os.fsencode(prompt[:e.start]))
        raise UsageError(f"--prompt is not UTF-8 text (byte 0x{raw[offset]:02x} at offset "
                         f"{offset}); pass UTF-8 text, or the prompts in a UTF-8 file with "
                         f"--prompts_file") from e
    return prompt


def _read_prompts(path: str) -> list[str]:
    """The non-blank lines of ``--prompts_file``; a usage error when there are none, so
    nothing (no ``decoder_out`` file) is written."""
    from revtrain.data.corpus import read_text_file

    try:
        text = read_text_file(path).replace("\r\n", "\n").replace("\r", "\n")
    except OSError as e:
        raise UsageError(f"--prompts_file={path}: {e.strerror or e}; give a UTF-8 file of "
                         f"prompts, one per line") from e
    except ValueError as e:  # Not UTF-8: the message gives the byte offset and the fix.
        raise UsageError(f"--prompts_file={path}: {e}") from e
    prompts = [line for line in text.split("\n") if line.strip()]
    if not prompts:
        raise UsageError(f"--prompts_file={path} holds no prompt (it is empty or blank); "
                         f"give one prompt per line")
    return prompts


def decode_main(argv: Sequence[str] | None = None) -> int:
    """``revtrain-decode``: continues prompts with a text LM; writes decoder_out/step_N.jsonl."""
    fv = common_flags("The output_dir of a revtrain-train run of a language model.")
    define_cache_flags(fv)
    flags.DEFINE_string("prompt", "\n", "Text to continue.", flag_values=fv)
    flags.DEFINE_string("prompts_file", None, "A UTF-8 file of prompts, one per line.",
                        flag_values=fv)
    flags.DEFINE_integer("max_new_bytes", None, "Bytes to generate, tokens for a run with "
                         "a subword tokenizer (default: as many as the model's key/value "
                         "cache holds after the prompt, at most 200; a note on stderr says "
                         "how many).", flag_values=fv, lower_bound=0)
    define_real("temperature", 0.0, "0 for greedy decoding, else the sampling "
                "temperature.", fv, lower=0.0)
    flags.DEFINE_integer("top_k", None, "Sample among the k most likely bytes.",
                         flag_values=fv, lower_bound=1)
    define_real("top_p", None, "Nucleus sampling: the most likely bytes of this total "
                "probability.", fv, lower=0.0, upper=1.0, lower_open=True)
    flags.DEFINE_integer("seed", 0, "Seed for sampling (prompt i uses seed + i).",
                         flag_values=fv, lower_bound=0, upper_bound=MAX_SEED)
    flags.DEFINE_integer("step", None, "Decode with this checkpoint (default: the newest).",
                         flag_values=fv, lower_bound=0)
    flags.DEFINE_boolean("allow_random_init", False, "Decode with random weights when the "
                         "run has no checkpoint.", flag_values=fv)
    flags.DEFINE_boolean("cache", True, "Use the key/value cache (--nocache recomputes "
                         "the window for every byte).", flag_values=fv)
    return run("revtrain-decode", fv, argv, _decode)


__all__ = ["decode_main"]
