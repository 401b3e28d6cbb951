"""``revtrain-decode``'s program: continue prompts with a run's checkpoint, write a file.

As Paxml's decode program, outputs go to ``<run>/decoder_out/step_<N>.jsonl``, one record
per prompt: ``{"prompt": str, "continuation": str, "tokens": [int, ...]}`` (``tokens`` are
the new token ids: bytes for a byte LM). Prompts are encoded and continuations decoded with
the tokenizer the run was trained with (`revtrain.training.run_tokenizer`). ``N`` is the
checkpoint's step, 0 for a random initialisation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

import jax

from revtrain.data.tokenizers import ByteTokenizer, Tokenizer
from revtrain.training.builder import build_model, resolve_inputs
from revtrain.training.checkpoints.checkpointer import Checkpointer
from revtrain.training.config import RunConfig
from revtrain.training.decoding import (
    DEFAULT_NEW_BYTES,
    CachedDecoder,
    Decoder,
    check_sampling,
    decode_text,
    new_bytes_for,
)
from revtrain.training.run_directory import CHECKPOINT_DIR
from revtrain.training.run_files import write_atomic
from revtrain.training.run_tokenizer import check_run_tokenizer, tokenizer_binding
from revtrain.training.write_failures import reporting_write_failures


def decode_length(prompts: Sequence[str], max_new_bytes: int | None,
                  tokenizer: Tokenizer | None = None) -> int:
    """The tokens the longest of ``prompts`` plus its continuation take: the ``length`` to
    size a decoder to (`load_decoder`). ``max_new_bytes=None`` counts `DEFAULT_NEW_BYTES`,
    the most a default continuation takes (`new_bytes_for`)."""
    tokenizer = tokenizer or ByteTokenizer()
    longest = max(len(tokenizer.encode(prompt)) for prompt in prompts)
    return longest + (DEFAULT_NEW_BYTES if max_new_bytes is None else max_new_bytes)


def load_decoder(run: RunConfig, output_dir: str, step: int | None = None,
                 allow_random_init: bool = False, cache: bool = True,
                 length: int | None = None) -> tuple[CachedDecoder | Decoder, int]:
    """The decoder of a run's checkpoint (default: the newest); returns it and the step.

    The key/value cache (or the window) holds ``min(length, max_len)`` positions, not the
    model's ``max_len``: decoding memory follows what is decoded. A model may accept
    sequences far longer than any decode (``max_len=2**40`` trains, as its positions are
    computed, not stored), whose full cache would not fit any memory. The predict-mode model
    is then built with ``max_len=`` that length (a model that declares ``max_len`` takes it
    as an argument, as the LMs of `revtrain.models` do; its weights do not depend on it).

    Args:
      run: the run's configuration (its model must be an LM on text data).
      output_dir: the run directory.
      step: the checkpoint to load; None for the newest readable one (an unreadable one
        is skipped with a warning naming it, as `Checkpointer.restore` does).
      allow_random_init: without any checkpoint, decode with the initial weights (step 0)
        instead of failing.
      cache: decode with the key/value cache (`CachedDecoder`); False recomputes a
        sliding window (`Decoder`).
      length: the longest prompt plus continuation to decode, in tokens
        (`decode_length`); None for the model's ``max_len``.

    Raises:
      ValueError: the data is not text (has no tokenizer), its tokenizer is not the one
        the run was trained with, or there is no checkpoint and random initialisation was
        not allowed.
      FileNotFoundError: there is no checkpoint of ``step``.
      CheckpointUnreadableError: no checkpoint can be read.
    """
    inputs = resolve_inputs(run.inputs)
    if inputs.tokenizer is None:
        raise ValueError(f"revtrain-decode continues text with a language model; this "
                         f"run's inputs {type(inputs).__name__} are not text (no tokenizer)")
    check_run_tokenizer(output_dir, inputs.tokenizer, tokenizer_binding(inputs))
    checkpointer = Checkpointer(os.path.join(output_dir, CHECKPOINT_DIR), max_to_keep=None,
                                read_only=True)
    try:
        saved = step is not None or checkpointer.latest_step() is not None
        if not saved and not allow_random_init:
            raise ValueError(f"no checkpoint in {checkpointer.directory}; train first, or "
                             f"pass --allow_random_init to decode with random weights")
        # With a checkpoint, shapes only: every value is read from it.
        built = build_model(run, inputs, abstract=saved)
        values = built.initial_values()
        if saved:  # Without a step, the newest readable one, as train and eval restore.
            values = checkpointer.restore_values(values, step)
            step = checkpointer.restored_step
    finally:
        checkpointer.close()
    weights, state = built.nest(values["weights"]), built.nest(values["state"])
    # The model's max_len (else the training length) for both, so they see the same context,
    # cut to what this decode needs.
    model_max_len = getattr(built.model, "max_len", None)
    max_len = model_max_len or built.batch_signature[0].shape[-1]
    size = max_len if length is None else max(1, min(length, max_len))
    if not cache:
        return Decoder(run.model(mode="eval"), weights, state, size), step or 0
    sized = {"max_len": size} if model_max_len and size < model_max_len else {}
    return (CachedDecoder(run.model(mode="predict", **sized), weights, size, max_len),
            step or 0)


def new_bytes_per_prompt(decoder: CachedDecoder | Decoder, prompts: Sequence[str],
                         max_new_bytes: int | None, tokenizer: Tokenizer | None = None,
                         ) -> list[int]:
    """How many tokens (bytes for a byte LM, the default ``tokenizer``) each prompt is
    continued by (`new_bytes_for`), every prompt checked against the decoder's limit before
    any is decoded.

    Raises:
      ValueError: in one line naming the numbers and the fixes, when a prompt plus
        ``max_new_bytes`` exceeds a `CachedDecoder`'s cache (or a prompt alone fills it).
    """
    tokenizer = tokenizer or ByteTokenizer()
    lengths = []
    for prompt in prompts:
        n_prompt = len(tokenizer.encode(prompt))
        lengths.append(new_bytes_for(decoder, n_prompt, max_new_bytes))
        decoder.check_length(n_prompt, lengths[-1])
    return lengths


def default_length_note(decoder: CachedDecoder | Decoder, lengths: Sequence[int]) -> str:
    """One line for a decode without ``--max_new_bytes``: how many bytes each prompt gets
    (``lengths``, from `new_bytes_per_prompt`) and why; e.g. ``continuing the prompt by 124
    bytes: as far as the model's key/value cache of 128 positions allows ...``."""
    low, high = min(lengths), max(lengths)
    count = f"{low} bytes" if low == high else f"{low}-{high} bytes each"
    what = "the prompt" if len(lengths) == 1 else f"{len(lengths)} prompts"
    if not isinstance(decoder, CachedDecoder):
        return (f"continuing {what} by {count} (the default), recomputing a window of "
                f"{decoder.length} positions for every byte; --max_new_bytes sets another "
                f"length")
    if high == DEFAULT_NEW_BYTES and low == high:
        return (f"continuing {what} by {count} (the default; the model's max_len of "
                f"{decoder.model_max_len} positions holds more); --max_new_bytes sets "
                f"another length")
    return (f"continuing {what} by {count}: as far as the model's key/value cache of "
            f"{decoder.max_len} positions allows after the prompt (at most "
            f"{DEFAULT_NEW_BYTES}); --max_new_bytes sets a shorter length, --nocache "
            f"decodes past the cache with a sliding window")


def decode_to_file(decoder: CachedDecoder | Decoder, prompts: Iterable[str], path: str,
                   max_new_bytes: int | None, temperature: float = 0.0, seed: int = 0,
                   top_k: int | None = None, top_p: float | None = None,
                   tokenizer: Tokenizer | None = None) -> list[dict]:
    """Decodes each prompt (prompt ``i`` with ``fold_in(key(seed), i)``); writes ``path``.

    ``tokenizer`` (default `ByteTokenizer`) encodes prompts and decodes continuations;
    ``max_new_bytes`` counts its tokens.

    ``max_new_bytes=None`` continues each prompt as far as `new_bytes_for` allows. Every
    prompt's length is checked (`new_bytes_per_prompt`) before any is decoded.

    Returns:
      The records written, ``{"prompt", "continuation", "tokens"}`` each.

    Raises:
      ValueError: ``prompts`` is empty, the sampling arguments are bad (`check_sampling`),
        or a prompt plus its new bytes exceeds the cache (``path`` is left as it was).
      RunWriteError: ``path`` could not be written (e.g. a full disk); it is left as it
        was. The message names the newest checkpoint of the run ``path`` is in
        (``<run>/decoder_out/step_<N>.jsonl``).
    """
    prompts = list(prompts)
    if not prompts:
        raise ValueError(f"no prompt to decode; {path} is left as it was")
    check_sampling(temperature, top_k, top_p)
    lengths = new_bytes_per_prompt(decoder, prompts, max_new_bytes, tokenizer)
    records = []
    for i, (prompt, n_new) in enumerate(zip(prompts, lengths, strict=True)):
        text, tokens = decode_text(decoder, prompt, n_new, temperature, seed + i, top_k,
                                   top_p, tokenizer)
        records.append({"prompt": prompt, "continuation": text, "tokens": tokens})
    if jax.process_index() == 0:
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        with reporting_write_failures(f"write {path}", os.path.join(run_dir, CHECKPOINT_DIR),
                                      then="run the same command again"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_atomic(path, "".join(json.dumps(record) + "\n" for record in records))
    return records
