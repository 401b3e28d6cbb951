"""Tests of revtrain/training/decode_program.py: decoding a run to decoder_out files."""
import functools
import json
import logging
import os
import shutil

import jax
import pytest

from revtrain.data import TextFiles
from revtrain.models import ReversibleTransformerLM
from revtrain.training import CheckpointConfig, EvalConfig, LogConfig, RunConfig, build_loop
from revtrain.training.decode_program import (
    decode_length,
    decode_to_file,
    default_length_note,
    load_decoder,
    new_bytes_per_prompt,
)
from revtrain.training.decoding import CachedDecoder, Decoder
from revtrain.training.write_failures import RunWriteError
from tests.full_disk import fill_disk
from tests.tree_utils import assert_trees_close


def _run(tmp_path, max_len=32):
    path = tmp_path / "corpus.txt"
    path.write_text("def f(x):\n    return x + 1\n" * 20)
    model = functools.partial(ReversibleTransformerLM, vocab_size=256, d_model=8, d_ff=16,
                              n_layers=1, n_heads=2, max_len=max_len, dropout=0.0)
    return RunConfig(model=model, inputs=TextFiles(paths=[str(path)], sequence_length=8,
                                                   batch_size=4), schedule=1e-3)


def test_random_init_only_when_allowed_then_checkpoint_and_file(tmp_path):
    run, out = _run(tmp_path), str(tmp_path / "run")
    with pytest.raises(ValueError, match="no checkpoint in .*pass --allow_random_init"):
        load_decoder(run, out)
    decoder, step = load_decoder(run, out, allow_random_init=True)
    assert step == 0
    with build_loop(run, EvalConfig(steps=0), CheckpointConfig(), LogConfig(progress=False),
                    out) as loop:
        loop.run(2)
    for cache in (True, False):
        decoder, step = load_decoder(run, out, cache=cache)
        path = str(tmp_path / "run" / "decoder_out" / f"step_{step}.jsonl")
        records = decode_to_file(decoder, ["def ", "x"], path, 6, temperature=0.8, seed=3)
        with open(path) as f:
            assert [json.loads(line) for line in f] == records
        assert step == 2 and [r["prompt"] for r in records] == ["def ", "x"]
        assert all(len(r["tokens"]) == 6 for r in records)
        if cache:
            first = records
    assert records == first  # Cached and uncached sampling agree for the same seed.


@pytest.mark.parametrize("damage", ["metadata removed", "empty step directory"])
def test_a_damaged_newest_checkpoint_is_skipped_named_and_the_previous_one_decoded(
        tmp_path, caplog, damage):
    run, out = _run(tmp_path), str(tmp_path / "run")
    with build_loop(run, EvalConfig(steps=0), CheckpointConfig(every=1, max_to_keep=None),
                    LogConfig(progress=False), out) as loop:
        loop.run(1)
        trained, _ = loop.model_values()
        loop.run(2)
    newest = os.path.join(out, "checkpoints", "2")
    if damage == "metadata removed":
        os.remove(os.path.join(newest, "default", "_METADATA"))
    else:
        shutil.rmtree(newest)
        os.makedirs(newest)
    with caplog.at_level(logging.WARNING):
        decoder, step = load_decoder(run, out, cache=False)
    assert step == 1
    assert_trees_close(decoder._values[0], trained, rtol=0, atol=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"skipping the checkpoint {newest}: it cannot be read (FileNotFoundError: "), warnings
    assert warnings[0].endswith("; trying the previous one")  # Not orbax's own warning.


def test_a_model_of_huge_max_len_decodes_with_a_cache_of_what_the_decode_needs(tmp_path):
    """max_len=2**40 trains (positions are computed); its full cache would be TiBs."""
    huge, out = _run(tmp_path, max_len=2**40), str(tmp_path / "run")
    with build_loop(huge, EvalConfig(steps=0), CheckpointConfig(), LogConfig(progress=False),
                    out) as loop:
        loop.run(1)
    prompts = ["def ", "x = "]
    length = decode_length(prompts, 6)
    assert length == 10
    decoded = {}
    for name, run in (("huge", huge), ("small", _run(tmp_path, max_len=32))):
        for cache in (True, False):
            decoder, _ = load_decoder(run, out, cache=cache, length=length)
            assert (decoder.max_len if cache else decoder.length) == length
            path = str(tmp_path / name / "decoder_out" / f"step_{cache}.jsonl")
            decoded[name, cache] = decode_to_file(decoder, prompts, path, 6, temperature=0.8)
    assert decoded["huge", True] == decoded["small", True] == decoded["huge", False]
    assert decoder.length == 10
    cached, _ = load_decoder(huge, out, length=decode_length(["def "], None))
    assert cached.max_len == 204 and default_length_note(cached, [200]).startswith(
        "continuing the prompt by 200 bytes (the default; the model's max_len of "
        "1099511627776 positions holds more)")


def test_a_checkpoints_decoder_builds_the_model_from_shapes_only(tmp_path, monkeypatch):
    run, out = _run(tmp_path), str(tmp_path / "run")
    with build_loop(run, EvalConfig(steps=0), CheckpointConfig(), LogConfig(progress=False),
                    out) as loop:
        loop.run(1)
        trained, _ = loop.model_values()
    from revtrain.training import decode_program
    built = []
    build = decode_program.build_model
    monkeypatch.setattr(decode_program, "build_model",
                        lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    decoder, step = load_decoder(run, out, cache=False)
    assert step == 1
    assert all(isinstance(leaf, jax.ShapeDtypeStruct)
               for leaf in jax.tree.leaves(built[0].model.weights))
    assert_trees_close(decoder._values[0], trained, rtol=0, atol=0)


def test_every_prompt_is_checked_before_any_is_decoded_and_the_note_says_how_far():
    model_fn = functools.partial(ReversibleTransformerLM, vocab_size=256, d_model=8, d_ff=16,
                                 n_layers=1, n_heads=2, max_len=16, dropout=0.0)
    model = model_fn(mode="train")
    model.init(jax.ShapeDtypeStruct((1, 16), jax.numpy.int32), rng=jax.random.key(0))
    cached = CachedDecoder(model_fn(mode="predict"), model.weights, 16)
    assert new_bytes_per_prompt(cached, ["The ", "ab"], None) == [12, 14]
    assert default_length_note(cached, [12, 14]).startswith(
        "continuing 2 prompts by 12-14 bytes each: as far as the model's key/value cache of "
        "16 positions allows after the prompt (at most 200)")
    with pytest.raises(ValueError, match="prompt of 17 tokens plus 1 new ones"):
        new_bytes_per_prompt(cached, ["ok", "x" * 17], None)  # The second prompt is too long.
    decoded = []
    cached.decode = lambda *args, **kwargs: decoded.append(args)
    with pytest.raises(ValueError, match="prompt of 4 tokens plus 13 new ones"):
        decode_to_file(cached, ["ab", "The "], "unused.jsonl", 13)
    assert not decoded  # The first prompt would fit: nothing ran before the check.
    uncached = Decoder(model_fn(mode="eval"), model.weights, model.state, 16)
    assert new_bytes_per_prompt(uncached, ["The "], None) == [200]
    assert default_length_note(uncached, [200]) == (
        "continuing the prompt by 200 bytes (the default), recomputing a window of 16 "
        "positions for every byte; --max_new_bytes sets another length")


def test_a_full_disk_while_writing_the_output_is_one_line_and_the_old_file_is_kept(
        tmp_path, monkeypatch):
    model_fn = functools.partial(ReversibleTransformerLM, vocab_size=256, d_model=8, d_ff=16,
                                 n_layers=1, n_heads=2, max_len=16, dropout=0.0)
    model = model_fn(mode="train")
    model.init(jax.ShapeDtypeStruct((1, 16), jax.numpy.int32), rng=jax.random.key(0))
    decoder = Decoder(model_fn(mode="eval"), model.weights, model.state, 16)
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    path = tmp_path / "decoder_out" / "step_2.jsonl"
    decode_to_file(decoder, ["a"], str(path), 2)
    before = path.read_text()
    fill_disk(monkeypatch, "step_2.jsonl")
    with pytest.raises(RunWriteError) as error:
        decode_to_file(decoder, ["b"], str(path), 2)
    assert str(error.value) == (
        f"could not write {path}: the disk is full (No space left on device); the newest "
        f"checkpoint, step 2, is intact; free space and run the same command again")
    assert path.read_text() == before
