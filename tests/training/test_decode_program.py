"""Tests of revtrain/training/decode_program.py: decoding a run to decoder_out files."""
import functools
import json

import jax
import pytest

from revtrain.data import TextFiles
from revtrain.models import ReversibleTransformerLM
from revtrain.training import CheckpointConfig, EvalConfig, LogConfig, RunConfig, build_loop
from revtrain.training.decode_program import decode_to_file, load_decoder
from tests.tree_utils import assert_trees_close


def _run(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("def f(x):\n    return x + 1\n" * 20)
    model = functools.partial(ReversibleTransformerLM, vocab_size=256, d_model=8, d_ff=16,
                              n_layers=1, n_heads=2, max_len=32, dropout=0.0)
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
