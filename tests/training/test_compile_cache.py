"""Tests of revtrain/training/compile_cache.py and the tools' compilation-cache flags."""
import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import pytest

from revtrain.cli.cache_flags import define_cache_flags, use_flagged_cache
from revtrain.cli.common import common_flags, parse_gin, run
from revtrain.training import RunConfig, builder, compile_cache
from revtrain.training.compile_cache import CompilationCacheConfig, use_compilation_cache
from tests.cli_helpers import COPY_TASK, TINY, _train
from tests.subprocesses import ROOT, child_env

SETTINGS = ("jax_compilation_cache_dir", "jax_enable_compilation_cache",
            "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture
def jax_settings():
    """Restores JAX's cache settings (the suite's cache) after the test."""
    with compile_cache.restoring_jax_settings():
        yield


def _unset_jax_cache():
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


@pytest.mark.parametrize("environ, expected", [
    ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/revtrain/jax"),
    ({}, os.path.expanduser("~/.cache/revtrain/jax")),
    ({"XDG_CACHE_HOME": ""}, os.path.expanduser("~/.cache/revtrain/jax")),
    ({"XDG_CACHE_HOME": "relative"}, os.path.expanduser("~/.cache/revtrain/jax")),
])
def test_the_default_directory_is_the_users_xdg_cache(environ, expected):
    assert compile_cache.default_directory(environ) == expected


def test_without_a_jax_setting_the_default_directory_is_used_and_every_program_cached(
        jax_settings, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _unset_jax_cache()
    assert use_compilation_cache() == str(tmp_path / "revtrain" / "jax")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "revtrain" / "jax")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert not (tmp_path / "revtrain").exists()  # Nothing written before a compile.


def test_the_users_jax_setting_wins_over_the_default(jax_settings, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _unset_jax_cache()
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
    assert use_compilation_cache() == str(tmp_path / "mine")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.0  # Theirs too.
    jax.config.update("jax_enable_compilation_cache", False)
    assert use_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    assert not (tmp_path / "xdg").exists()


def test_a_configured_directory_or_off_wins_over_jax_setting(jax_settings, tmp_path):
    assert use_compilation_cache(CompilationCacheConfig(str(tmp_path))) == str(tmp_path)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    assert use_compilation_cache(CompilationCacheConfig(enabled=False)) is None
    assert not jax.config.jax_enable_compilation_cache


@pytest.mark.parametrize("config, expected", [(None, "default"),
                                              (CompilationCacheConfig(enabled=False), None)])
def test_build_loop_turns_the_cache_on_before_it_builds_anything(
        jax_settings, tmp_path, monkeypatch, config, expected):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _unset_jax_cache()

    def stop(inputs):  # The first thing build_loop builds.
        raise RuntimeError("stop")

    monkeypatch.setattr(builder, "resolve_inputs", stop)
    with pytest.raises(RuntimeError, match="stop"):
        builder.build_loop(RunConfig(), compilation_cache=config)
    on = jax.config.jax_enable_compilation_cache
    assert (jax.config.jax_compilation_cache_dir if on else None) == (
        expected and str(tmp_path / "revtrain" / "jax"))


@pytest.mark.parametrize("config", [{"directory": ""}, {"directory": 3},
                                    {"enabled": "yes"}])
def test_bad_config_values_name_the_binding(config):
    with pytest.raises(ValueError, match="CompilationCacheConfig"):
        CompilationCacheConfig(**config)


def test_an_unwritable_directory_is_one_warning_and_no_cache(jax_settings, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")  # A path under a regular file cannot be created, even by root.
    with caplog.at_level(logging.INFO, logger="revtrain"):
        got = use_compilation_cache(CompilationCacheConfig(str(blocker / "cache")))
    assert got is None and not jax.config.jax_enable_compilation_cache
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert f"{blocker} is not a directory" in caplog.records[0].getMessage()


@pytest.mark.parametrize("bindings, flags, expected", [
    ([], [], "suite"),  # The user's own JAX setting (the suite's cache) wins.
    (["CompilationCacheConfig.enabled=False"], [], None),
    ([], ["--nocompilation_cache"], None),
    (["CompilationCacheConfig.directory='{tmp}/gin'"], [], "{tmp}/gin"),
    (["CompilationCacheConfig.directory='{tmp}/gin'"], ["--compilation_cache_dir={tmp}/f"],
     "{tmp}/f"),
    (["CompilationCacheConfig.enabled=False"], ["--compilation_cache_dir={tmp}/f"],
     "{tmp}/f"),
    (["CompilationCacheConfig.directory='{tmp}/gin'"], ["--nocompilation_cache"], None),
])
def test_the_flags_beat_gin_which_beats_the_users_jax_setting(tmp_path, bindings, flags,
                                                               expected):
    before = {name: getattr(jax.config, name) for name in SETTINGS}
    seen = []

    def body(fv):
        parse_gin([COPY_TASK], [b.format(tmp=tmp_path) for b in bindings])
        seen.append(use_flagged_cache(fv))
        seen.append({name: getattr(jax.config, name) for name in SETTINGS})
        return 0

    argv = ["revtrain-train", *(f.format(tmp=tmp_path) for f in flags)]
    fv = common_flags("out")
    define_cache_flags(fv)
    assert run("revtrain-train", fv, argv, body) == 0
    expected = (before["jax_compilation_cache_dir"] if expected == "suite" else
                expected and expected.format(tmp=tmp_path))
    assert seen[0] == expected
    assert seen[1]["jax_enable_compilation_cache"] == (expected is not None)
    if expected is not None:
        assert seen[1]["jax_compilation_cache_dir"] == expected
    # An in-process call leaves JAX's settings (the suite's cache) as it found them.
    assert {name: getattr(jax.config, name) for name in SETTINGS} == before


@pytest.mark.parametrize("flags, message", [
    (["--compilation_cache_dir="], "--compilation_cache_dir is empty"),
    (["--compilation_cache_dir=/tmp/x", "--nocompilation_cache"], "both given"),
])
def test_contradicting_cache_flags_are_usage_errors(tmp_path, capsys, flags, message):
    assert _train(str(tmp_path), extra_flags=flags) == 2
    assert message in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # Nothing written.


# --------------------------------------------------------------------------------------
# Restarted runs, evaluations and decodes load every program from the cache.

LM = ["ReversibleTransformerLM.vocab_size=256", "RunConfig.inputs=@TextFiles",
      "TextFiles.sequence_length=8", "TextFiles.batch_size=4"]


def _counts(tmp_path, env, tool, *argv, stderr=None):
    out = tmp_path / f"counts_{len(os.listdir(tmp_path))}.json"
    done = subprocess.run([sys.executable, "-m", "tests.training.compile_counts", str(out),
                           tool, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(out.read_text())
    assert counts["status"] == 0, done.stderr[-3000:]
    if stderr is not None:
        stderr.append(done.stderr)
    return counts


@pytest.mark.slow
def test_a_restart_an_eval_and_a_second_decode_compile_nothing(tmp_path):
    env = child_env(XDG_CACHE_HOME=str(tmp_path / "xdg"))
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        env.pop(name, None)  # The default directory, as a user gets it.
    run = str(tmp_path / "run")
    train = [f"--config_file={COPY_TASK}", f"--output_dir={run}"]
    train += [f"--gin_bindings={b}" for b in TINY + LM]
    cold = _counts(tmp_path, env, "train", *train, "--gin_bindings=train.steps=2")
    assert cold["misses"] > 0 and cold["compiles"] == cold["hits"] + cold["misses"]
    assert os.listdir(tmp_path / "xdg" / "revtrain" / "jax")
    restarted = _counts(tmp_path, env, "train", *train, "--gin_bindings=train.steps=4")
    assert restarted["misses"] == 0 and restarted["compiles"] == restarted["hits"] > 0
    shutil.move(os.path.join(run, "metrics.jsonl"), tmp_path / "train_metrics.jsonl")
    evaluated = _counts(tmp_path, env, "eval", f"--output_dir={run}")
    assert evaluated["misses"] == 0 and evaluated["compiles"] == evaluated["hits"] > 0
    decode = [f"--output_dir={run}", "--prompt=def ", "--max_new_bytes=3"]
    _counts(tmp_path, env, "decode", *decode)
    again = _counts(tmp_path, env, "decode", *decode)
    assert again["misses"] == 0 and again["compiles"] == again["hits"] > 0
    # An unwritable cache: one warning line, and the program runs uncached.
    (tmp_path / "file").write_text("")
    err = []
    uncached = _counts(tmp_path, env, "decode", *decode,
                       f"--compilation_cache_dir={tmp_path / 'file' / 'cache'}", stderr=err)
    assert uncached["compiles"] > 0 and uncached["hits"] == uncached["misses"] == 0
    lines = [line for line in err[0].splitlines() if "cache" in line.lower()]
    assert len(lines) == 1 and "cannot be written" in lines[0], err[0]


def test_a_child_of_the_suite_uses_the_suites_cache_not_the_users(tmp_path):
    code = ("from revtrain.training.compile_cache import use_compilation_cache; "
            "print(use_compilation_cache())")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))  # As the suite's tests start them.
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=120)
    assert done.stdout.strip() == jax.config.jax_compilation_cache_dir, done.stderr
    assert os.listdir(tmp_path) == []
