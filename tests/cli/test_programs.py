"""End-to-end tests of revtrain.cli: revtrain-train / -eval / -decode on tiny configs."""
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from revtrain import cli
from revtrain.cli import common as cli_common
from revtrain.training import read_metrics
from tests.cli_helpers import CONFIGS, COPY_TASK, TINY, TRAINERS, _checkpoint, _steps, _train
from tests.full_disk import fill_disk


@pytest.mark.parametrize("trainer", TRAINERS)
def test_train_checkpoints_and_resume(tmp_path, capsys, trainer):
    out = str(tmp_path)
    common = (f"RunConfig.trainer_class=@{trainer}", "CheckpointConfig.every=2",
              "EvalConfig.every=2")
    assert _train(out, "train.steps=4", *common) == 0
    assert "final eval at step 4: loss" in capsys.readouterr().out
    assert _steps(out) == [2, 4]
    with open(os.path.join(out, "config.gin")) as f:
        config = f.read()
    assert f"RunConfig.trainer_class = @{trainer}" in config and "train.steps = 4" in config
    assert _train(out, "train.steps=6", *common) == 0
    captured = capsys.readouterr()
    # One line each for model construction, init, the trainer and the restore, timed.
    timed = [line.split("] ")[-1] for line in captured.err.splitlines()
             if re.search(r" in \d+\.\d\d s$", line)]
    assert [re.sub(r"\d+\.\d\d s$", "T s", line) for line in timed] == [
        "built the model in T s", "initialised the model's weights in T s",
        "built the trainer and its optimizer slots in T s",
        f"restored the checkpoint of step 4 from {out}/checkpoints in T s"], captured.err
    assert "final eval at step 6" in captured.out
    assert _steps(out) == [4, 6]  # max_to_keep = 2 in copy_task.gin.
    assert [r["step"] for r in read_metrics(out, "train")] == [2, 4, 6]


def test_20_then_10_steps_equal_30_steps(tmp_path):
    resumed, straight = str(tmp_path / "resumed"), str(tmp_path / "straight")
    assert _train(resumed, "train.steps=20", "EvalConfig.steps=0") == 0
    assert _train(resumed, "train.steps=30", "EvalConfig.steps=0") == 0
    assert _train(straight, "train.steps=30", "EvalConfig.steps=0") == 0
    a, b = _checkpoint(resumed, 30), _checkpoint(straight, 30)
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert int(a["step"]) == 30


def test_nan_loss_stops_with_one_line_and_keeps_checkpoint(tmp_path, capsys):
    out = str(tmp_path)
    assert _train(out, "train.steps=2") == 0
    before = _checkpoint(out, 2)
    capsys.readouterr()
    status = _train(out, "train.steps=10", "RunConfig.schedule=1e30",
                    "CheckpointConfig.every=1")
    err = capsys.readouterr().err
    assert status == 1
    line = [x for x in err.splitlines() if "error" in x]
    assert len(line) == 1 and "NonFiniteLossError: loss is" in line[0]
    assert "at step" in line[0] and "Traceback" not in err
    assert _steps(out)[-1] < int(line[0].split("at step ")[1].split(";")[0])
    after = _checkpoint(out, 2)
    for key in before:
        np.testing.assert_array_equal(before[key], after[key])


@pytest.mark.parametrize("argv_tail, message", [
    (["--config_file=nope.gin", "--output_dir=X"], "config file 'nope.gin' not found"),
    ([f"--config_file={COPY_TASK}", "--output_dir=X", "--gin_bindings=train.stepz=3"],
     "train.stepz is not a parameter of train"),
    ([f"--config_file={COPY_TASK}", "--output_dir=X", "--gin_bindings=train.eval_every=3"],
     "train.eval_every is now EvalConfig.every; change the gin binding train.eval_every to "
     "EvalConfig.every"),
    ([f"--config_file={COPY_TASK}", "--output_dir=X", "--gin_bindings=Nope.x=3"],
     "No configurable matching 'Nope'"),
    ([f"--config_file={COPY_TASK}", "--bogus_flag=1"], "Unknown command line flag"),
    ([f"--config_file={COPY_TASK}"], "--output_dir is required"),
    (["--output_dir=X", "extra"], "unexpected arguments"),
    ([f"--config_file={COPY_TASK}", "--output_dir=X",
      "--gin_bindings=CausalAttention.mask_bits=4"],
     "CausalAttention.mask_bits is set by the language model, which overrides the binding; "
     "bind ReversibleTransformerLM.dropout_mask_bits"),
    ([f"--config_file={COPY_TASK}", "--output_dir=X",
      "--gin_bindings=LSHCausalAttention.n_heads=2"],
     "LSHCausalAttention.n_heads is set by the language model, which overrides the binding; "
     "bind ReversibleTransformerLM.n_heads"),
    ([f"--config_file={COPY_TASK}", "--output_dir=X",
      "--gin_bindings=CausalAttention.d_attention_key=8",
      "--gin_bindings=ReversibleTransformerLM.d_attention_key=16"],
     "CausalAttention.d_attention_key and the language model's d_attention_key are both "
     "bound"),
])
def test_bad_flags_are_one_line_errors(tmp_path, capsys, argv_tail, message):
    argv = [a.replace("=X", f"={tmp_path}") for a in argv_tail]
    assert cli.train_main(["revtrain-train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("revtrain-train: error:")
    assert message in err


def test_missing_data_file_is_one_line_runtime_error(tmp_path, capsys):
    status = _train(str(tmp_path), "RunConfig.inputs=@TextFiles",
                    f"TextFiles.paths=['{tmp_path / 'missing.txt'}']")
    err = capsys.readouterr().err.strip()
    assert status == 1 and len(err.splitlines()) == 1
    assert "FileNotFoundError: text file" in err and "does not exist" in err
    assert "In call to configurable" not in err


def test_help_prints_flags(capsys):
    assert cli.train_main(["revtrain-train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--gin_bindings" in out and "--gin_file" in out and "--verbosity" in out


def test_decode_of_a_model_of_huge_max_len_sizes_its_cache_to_the_decode(tmp_path, capsys):
    out = str(tmp_path)
    assert _train(out, "ReversibleTransformerLM.vocab_size=256", "RunConfig.inputs=@TextFiles",
                  "TextFiles.sequence_length=8", "TextFiles.batch_size=4", "train.steps=1",
                  "ReversibleTransformerLM.max_len=1099511627776") == 0  # 2**40
    capsys.readouterr()
    assert cli.decode_main(["revtrain-decode", f"--output_dir={out}", "--prompt=def ",
                            "--max_new_bytes=3"]) == 0  # Not a MemoryError of 8 TiB.
    with open(os.path.join(out, "decoder_out", "step_1.jsonl")) as f:
        assert len(json.loads(f.read())["tokens"]) == 3


def test_eval_and_decode_use_the_latest_checkpoint(tmp_path, capsys):
    out = str(tmp_path)
    lm = ["ReversibleTransformerLM.vocab_size=256", "RunConfig.inputs=@TextFiles",
          "TextFiles.sequence_length=8", "TextFiles.batch_size=4", "train.steps=2"]
    assert _train(out, *lm) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("model: ") and " parameters in " in printed  # The summary.
    final = printed.splitlines()[-1] + "\n"
    assert "bits_per_byte" in final
    assert cli.eval_main(["revtrain-eval", f"--output_dir={out}"]) == 0
    assert "nothing to evaluate" in capsys.readouterr().out  # Training evaluated step 2.
    os.rename(os.path.join(out, "metrics.jsonl"), os.path.join(out, "train_metrics.jsonl"))
    assert cli.eval_main(["revtrain-eval", f"--output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("eval at step 2: loss")
    assert printed.split(": ", 1)[1] == final.split(": ", 1)[1]  # Same weights, same data.
    assert [r["step"] for r in read_metrics(out, "eval")] == [2]
    assert cli.decode_main(["revtrain-decode", f"--output_dir={out}", "--prompt=def ",
                            "--max_new_bytes=5"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    with open(os.path.join(out, "decoder_out", "step_2.jsonl")) as f:
        record = json.loads(f.read())
    assert record["prompt"] == "def " and len(record["tokens"]) == 5
    assert cli.eval_main(["revtrain-eval", f"--output_dir={tmp_path / 'none'}"]) == 2
    assert "config.gin not found" in capsys.readouterr().err
    for content in ("", "\n  \n"):  # No prompt: a usage error; the old output is kept.
        prompts = tmp_path / "prompts.txt"
        prompts.write_text(content)
        assert cli.decode_main(["revtrain-decode", f"--output_dir={out}",
                                f"--prompts_file={prompts}"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"revtrain-decode: error: --prompts_file={prompts} holds no prompt (it is empty "
            f"or blank); give one prompt per line"]
        with open(os.path.join(out, "decoder_out", "step_2.jsonl")) as f:
            assert json.loads(f.read()) == record
    prompts.write_bytes("caf\u00e9\n".encode("latin-1"))  # Not UTF-8: the shared check.
    assert cli.decode_main(["revtrain-decode", f"--output_dir={out}",
                            f"--prompts_file={prompts}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"revtrain-decode: error: --prompts_file={prompts}: text file '{prompts}' is not "
        f"UTF-8: byte offset 3 (line 1) holds 0xe9, invalid continuation byte; convert the "
        f"file to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8 for Latin-1 text) or give a UTF-8 "
        f"text file"]
    # No --max_new_bytes: as far as the 16-position cache allows after 'def ', with a note.
    assert cli.decode_main(["revtrain-decode", f"--output_dir={out}", "--prompt=def "]) == 0
    printed = capsys.readouterr()
    assert printed.err.splitlines()[0] == (
        "revtrain-decode: continuing the prompt by 12 bytes: as far as the model's key/value "
        "cache of 16 positions allows after the prompt (at most 200); --max_new_bytes sets a "
        "shorter length, --nocache decodes past the cache with a sliding window")
    with open(os.path.join(out, "decoder_out", "step_2.jsonl")) as f:
        record = json.loads(f.read())
    assert len(record["tokens"]) == 12 and printed.out.startswith("def ")
    # More than fits: one line with the numbers and the fixes; the file is left as it was.
    assert cli.decode_main(["revtrain-decode", f"--output_dir={out}", "--prompt=def ",
                            "--max_new_bytes=13"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "revtrain-decode: error: prompt of 4 tokens plus 13 new ones exceeds the cache of "
        "max_len=16; ask for at most 12 new ones (--max_new_bytes=12), shorten the prompt to "
        "at most 3 tokens, or decode without the cache (--nocache: a sliding window)"]
    with open(os.path.join(out, "decoder_out", "step_2.jsonl")) as f:
        assert json.loads(f.read()) == record
    fresh = tmp_path / "configured"  # A run's config.gin, no checkpoint.
    fresh.mkdir()
    shutil.copy(os.path.join(out, "config.gin"), fresh / "config.gin")
    assert cli.eval_main(["revtrain-eval", f"--output_dir={fresh}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"revtrain-eval: error: no checkpoint to load in {fresh}/checkpoints; train first, "
        f"or pass --wait to evaluate the checkpoints as they appear")
    assert os.listdir(fresh) == ["config.gin"]  # Nothing created.


@pytest.mark.parametrize("content, what", [
    ("", "it is empty"),
    ("# only a comment\n\n", "it is empty"),
    ("RunConfig.model = @ReversibleTransformerLM(\n",
     "it does not parse (TokenError: EOF in multi-line statement)"),
    ("RunConfig.model = @Nope\n", "it does not parse (ValueError: No configurable matching"),
    ("RunConfig.inputs = @CopyTask\n", "it binds no RunConfig.model"),
])
@pytest.mark.parametrize("tool", ["eval", "decode"])
def test_a_damaged_config_gin_is_one_line_naming_the_file_and_what_it_lacks(
        tmp_path, capsys, tool, content, what):
    (tmp_path / "config.gin").write_text(content)
    history = tmp_path / "config_history"
    history.mkdir()
    for stamp in ("20260101T000000.000000Z", "20260102T000000.000000Z"):
        (history / f"{stamp}.gin").write_text("RunConfig.model = @ReversibleTransformerLM\n")
    main = getattr(cli, f"{tool}_main")
    assert main([f"revtrain-{tool}", f"--output_dir={tmp_path}"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"revtrain-{tool}: error: {tmp_path}/config.gin is not a run's "
                           f"configuration: {what}"), line
    assert line.endswith(f"; copy the run's newest kept config, {history}/"
                         f"20260102T000000.000000Z.gin, over it"), line


def _start_and_signal(out, signals, *bindings, wait_for=" train: loss"):
    """Starts revtrain-train, sends ``signals`` 50 ms apart once a stderr line holds
    ``wait_for``; returns ``(returncode, stderr)``. It sees as many CPU devices as the
    tests' process, so its steps are bitwise those of an in-process run."""
    import time

    script = shutil.which("revtrain-train", path=os.path.dirname(sys.executable))
    assert script, "revtrain-train is not installed; pip install -e . to create it"
    argv = [script, f"--config_file={COPY_TASK}", f"--output_dir={out}"]
    argv += [f"--gin_bindings={b}" for b in TINY + ["train.steps=100000", *bindings]]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(len(jax.devices())))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if wait_for in line:
            for signum in signals:
                proc.send_signal(signum)
                time.sleep(0.05)
            break
    _, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + err


def _assert_same_checkpoints(a, b, step):
    saved, straight = _checkpoint(a, step), _checkpoint(b, step)
    assert sorted(saved) == sorted(straight)
    for key in saved:
        np.testing.assert_array_equal(saved[key], straight[key], err_msg=key)


def test_sigterm_twice_saves_once_and_the_run_resumes_bit_exact(tmp_path):
    import signal

    out = str(tmp_path / "run")
    code, err = _start_and_signal(out, [signal.SIGTERM, signal.SIGTERM],
                                  "CheckpointConfig.every=0")
    assert code == 128 + 15, err
    assert "received SIGTERM again: ignored" in err and "Traceback" not in err
    assert "stopped by SIGTERM after step" in err
    [step] = _steps(out)
    assert f"saved the checkpoint of step {step}" in err and step >= 2
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == [str(step)]  # No tmp.
    assert not os.path.exists(os.path.join(out, "run.lock"))
    assert _train(out, f"train.steps={step + 2}", "CheckpointConfig.every=0") == 0
    straight = str(tmp_path / "straight")
    assert _train(straight, f"train.steps={step + 2}", "CheckpointConfig.every=0") == 0
    _assert_same_checkpoints(out, straight, step + 2)


def test_sighup_of_a_closed_terminal_saves_and_stops_like_sigterm(tmp_path):
    import signal

    out = str(tmp_path / "run")
    code, err = _start_and_signal(out, [signal.SIGHUP], "CheckpointConfig.every=0")
    assert code == 128 + signal.SIGHUP, err
    assert "stopped by SIGHUP after step" in err and "Traceback" not in err
    [step] = _steps(out)
    assert f"saved the checkpoint of step {step}" in err and step >= 2
    assert not os.path.exists(os.path.join(out, "run.lock"))


def test_second_ctrl_c_forces_an_exit_keeping_the_last_checkpoint_and_no_lock(tmp_path):
    import signal

    out = str(tmp_path)
    code, err = _start_and_signal(out, [signal.SIGINT, signal.SIGINT],
                                  "CheckpointConfig.every=1", "LogConfig.every=1",
                                  wait_for="saved the checkpoint of step 2")
    assert code == 128 + 2, err
    assert not os.path.exists(os.path.join(out, "run.lock"))
    steps = _steps(out)
    assert steps and int(_checkpoint(out, steps[-1])["step"]) == steps[-1]
    # The second Ctrl-C lands in the save (KeyboardInterrupt, reported in one line) or once
    # the run has stopped (it is exiting anyway).
    if "revtrain-train: interrupted" in err:
        assert err.strip().splitlines()[-1] == (
            "revtrain-train: interrupted; checkpoints are saved atomically, so the newest "
            "complete one is intact and the steps after it are lost"), err
    else:
        assert "stopped by SIGINT after step" in err, err
    assert _train(out, f"train.steps={steps[-1] + 1}", "CheckpointConfig.every=1") == 0


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(CONFIGS) if f.endswith(".gin")))
def test_every_config_parses_with_model_and_inputs(name):
    import gin

    cli_common.parse_gin([os.path.join(CONFIGS, name)], [])
    run = gin.get_bindings("RunConfig")
    assert callable(run["model"]) and callable(run["inputs"])
    assert gin.get_bindings("train")["steps"] > 0 and callable(run["schedule"])
    assert set(gin.get_bindings("train")) == {"steps"}  # The rest is the run configuration.


@pytest.mark.parametrize("name, model, extra", [
    ("reversible_lm.gin", "ReversibleTransformerLM", []),
    # Trains its SentencePiece model on the embedded corpus first.
    ("reversible_lm_sentencepiece.gin", "ReversibleTransformerLM", []),
    ("reversible_lm_memory_efficient.gin", "ReversibleTransformerLM", []),
    ("transformer_lm.gin", "TransformerLM", []),
    # The 64K config at 16 tokens: two attention blocks and four feed-forward chunks.
    ("reversible_lm_64k.gin", "ReversibleTransformerLM",
     ["CausalAttention.block_size=8", "ReversibleTransformerLM.ff_chunk_size=4"]),
    # The LSH config at 16 tokens: chunks of 4, so hashing, sorting and look-back run.
    ("reformer_lm_64k.gin", "ReversibleTransformerLM",
     ["LSHCausalAttention.chunk_len=4", "ReversibleTransformerLM.ff_chunk_size=4"]),
])
def test_text_configs_train_two_tiny_steps(tmp_path, capsys, name, model, extra):
    shrink = [f"{model}.d_model=16", f"{model}.d_ff=32", f"{model}.n_heads=2",
              f"{model}.n_layers=1", "TextFiles.sequence_length=16", "TextFiles.batch_size=4",
              "train.steps=2", "EvalConfig.steps=1", "LogConfig.progress=False", *extra]
    argv = ["revtrain-train", f"--config_file={os.path.join(CONFIGS, name)}",
            f"--output_dir={tmp_path}"] + [f"--gin_bindings={b}" for b in shrink]
    assert cli.train_main(argv) == 0
    assert "final eval at step 2: loss" in capsys.readouterr().out


def test_verbosity_and_gin_file_flags(tmp_path, capsys):
    """absl's logging flags, gin's usual flag names and a shipped config found by name."""
    out = tmp_path / "run"
    argv = ["revtrain-train", "--gin_file=copy_task.gin", f"--output_dir={out}",
            "--verbosity=1", f"--log_dir={tmp_path / 'logs'}", "--alsologtostderr"]
    argv += [f"--gin_bindings={b}" for b in TINY + ["train.steps=2", "EvalConfig.steps=0",
                                                    "LogConfig.every=1"]]
    assert cli.train_main(argv) == 0
    err = capsys.readouterr().err
    assert "step 2 train: loss" in err and "Path not found" not in err
    with open(tmp_path / "logs" / "revtrain-train.INFO") as f:  # absl's log file, all levels.
        log = f.read()
    assert "step 2 train: loss" in log
    [events] = os.listdir(out / "tensorboard" / "config")
    with open(out / "tensorboard" / "config" / events, "rb") as f:
        assert b"gin/operative_config" in f.read()  # The operative config as TB text.


def test_memory_efficient_trainer_log_lines_are_shown(tmp_path, capsys):
    assert _train(str(tmp_path), "train.steps=1", "EvalConfig.steps=0",
                  "RunConfig.trainer_class=@MemoryEfficientTrainer",
                  "MemoryEfficientTrainer.n_steps_per_log=1") == 0
    assert "host RSS" in capsys.readouterr().err


def test_version(capsys):
    import revtrain

    assert cli.train_main(["revtrain-train", "--version"]) == 0
    assert capsys.readouterr().out.strip() == f"revtrain {revtrain.__version__}"


@pytest.mark.parametrize("flag, revtrain_level, absl_level", [
    ([], logging.INFO, logging.WARNING),  # Libraries' own loggers quiet by default.
    (["--verbosity=0"], logging.INFO, logging.INFO),
    (["--verbosity=1"], logging.DEBUG, logging.DEBUG),
    (["--verbosity=-1"], logging.WARNING, logging.WARNING),
])
def test_verbosity_sets_the_logging_levels(flag, revtrain_level, absl_level):
    fv = cli_common.common_flags("unused")
    fv(["revtrain-train", *flag])
    root_level = logging.getLogger().level
    with cli_common.logging_through_absl("revtrain-train", fv):
        assert logging.getLogger("revtrain.training").getEffectiveLevel() == revtrain_level
        assert logging.getLogger("absl").getEffectiveLevel() == absl_level
    assert logging.getLogger().level == root_level


@pytest.mark.parametrize("init", ["missing", "empty"])
def test_a_warm_start_without_a_checkpoint_is_one_line_and_creates_nothing(tmp_path, capsys,
                                                                          init):
    source = tmp_path / init
    if init == "empty":
        source.mkdir()
    new = tmp_path / "new"
    assert _train(str(new), f"CheckpointConfig.init_checkpoint_dir='{source}'") == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    reason = "is not a directory" if init == "missing" else "holds no checkpoint"
    assert line.startswith(f"revtrain-train: error: FileNotFoundError: CheckpointConfig."
                           f"init_checkpoint_dir='{source}' {reason}"), line
    assert not new.exists()  # Not even an empty checkpoints/.


def test_a_warm_start_from_a_broken_link_names_the_link_and_its_target(tmp_path, capsys):
    source = tmp_path / "link"
    source.symlink_to(tmp_path / "moved")
    new = tmp_path / "new"
    assert _train(str(new), f"CheckpointConfig.init_checkpoint_dir='{source}'") == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"revtrain-train: error: FileNotFoundError: CheckpointConfig."
                           f"init_checkpoint_dir={source} is a symbolic link to "
                           f"{tmp_path}/moved, which does not exist; create "
                           f"{tmp_path}/moved, or give a"), line
    assert not new.exists()


@pytest.mark.parametrize("tool, flag", [("eval", "--output_dir"), ("decode", "--output_dir"),
                                        ("train", "--log_dir")])
def test_a_directory_flag_that_is_a_broken_link_is_one_line(tmp_path, capsys, tool, flag):
    link = tmp_path / "link"
    link.symlink_to("missing")
    argv = [f"revtrain-{tool}", f"{flag}={link}"]
    if flag == "--log_dir":
        argv += [f"--config_file={COPY_TASK}", f"--output_dir={tmp_path / 'run'}"]
    assert getattr(cli, f"{tool}_main")(argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"revtrain-{tool}: error: {flag}={link} is a symbolic link to "
                    f"{tmp_path}/missing, which does not exist; create {tmp_path}/missing, "
                    f"or give a {flag} that is not a broken link"), line
    assert sorted(os.listdir(tmp_path)) == ["link"]


def test_a_log_dir_that_cannot_be_created_is_one_line(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    log_dir = tmp_path / "a_file" / "logs"
    assert cli.train_main(["revtrain-train", f"--log_dir={log_dir}",
                           f"--config_file={COPY_TASK}",
                           f"--output_dir={tmp_path / 'run'}"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"revtrain-train: error: cannot create --log_dir={log_dir}: Not a "
                    f"directory; choose a writable directory"), line
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


_KEEP = ("CheckpointConfig.every=2", "CheckpointConfig.keep_period=2", "EvalConfig.steps=0")


@pytest.fixture(scope="module")
def trained_to_step_2(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trained") / "run")
    assert _train(out, "train.steps=2", *_KEEP) == 0
    return out


@pytest.mark.parametrize("full, what", [
    ("run.lock", "write {out}/run.lock"),
    ("tfevents", "write the TensorBoard events in {out}/tensorboard/text"),
    ("Z.gin", "write {out}/config_history/"),
    ("config.gin", "write {out}/config.gin"),
    ("metrics.jsonl", "write {out}/metrics.jsonl"),
    ("retention.json", "write {out}/checkpoints/retention.json"),
])
def test_a_full_disk_under_any_file_of_a_run_ends_with_the_same_one_line(
        tmp_path, capsys, monkeypatch, trained_to_step_2, full, what):
    out = str(tmp_path / "run")
    shutil.copytree(trained_to_step_2, out)
    fill_disk(monkeypatch, full)
    assert _train(out, "train.steps=4", *_KEEP) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"revtrain-train: error: RunWriteError: could not "
                                f"{what.format(out=out)}"), lines[-1]
    assert lines[-1].endswith(": the disk is full (No space left on device); the newest "
                              "checkpoint, step 2, is intact; free space and run the same "
                              "command to resume (rerun with --traceback for details)"), lines[-1]
    assert [line for line in lines if "rror" in line] == [lines[-1]], err
    assert "Traceback" not in err and "Exception in thread" not in err
    assert _steps(out) == [2]


def test_a_run_that_fills_the_disk_with_metrics_stops_with_one_line(tmp_path):
    """A real full disk (a small tmpfs; needs root): tensorboardX's writer thread used to
    die on it with a traceback and then block the run forever."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "256k")
    try:
        out = str(disk / "run")
        script = shutil.which("revtrain-train", path=os.path.dirname(sys.executable))
        argv = [script, f"--config_file={COPY_TASK}", f"--output_dir={out}"]
        argv += [f"--gin_bindings={b}" for b in TINY + [
            "train.steps=100000", "CheckpointConfig.every=0", "LogConfig.every=1"]]
        from tests.subprocesses import ROOT as root
        env = dict(os.environ, PYTHONPATH=root)  # This checkout's revtrain.
        run = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 1, run.stderr[-3000:]
        lines = run.stderr.strip().splitlines()
        assert lines[-1].startswith("revtrain-train: error: RunWriteError: could not write "
                                    ) and f" {out}/" in lines[-1], lines[-1]  # Which: timing.
        assert lines[-1].endswith(": the disk is full (No space left on device); no "
                                  "checkpoint is saved yet; free space and run the same "
                                  "command to resume (rerun with --traceback for details)"
                                  ), lines[-1]
        assert [line for line in lines if "rror" in line] == [lines[-1]], run.stderr[-3000:]
        assert "Traceback" not in run.stderr and "Exception in thread" not in run.stderr
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _mount_tmpfs(path, size):
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): the full-disk test "
                    f"did not run ({mounted.stderr.strip()})")


def test_a_full_disk_during_a_save_ends_with_one_line_naming_what_is_intact(tmp_path):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "600k")
    try:
        out = str(disk / "run")
        script = shutil.which("revtrain-train", path=os.path.dirname(sys.executable))
        argv = [script, f"--config_file={COPY_TASK}", f"--output_dir={out}"]
        argv += [f"--gin_bindings={b}" for b in TINY + [
            "train.steps=100000", "CheckpointConfig.every=2",
            "CheckpointConfig.max_to_keep=None", "LogConfig.every=100000"]]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert run.returncode == 1, run.stderr
        lines = run.stderr.strip().splitlines()
        intact = _steps(out)[-1]
        assert lines[-1].startswith("revtrain-train: error: CheckpointSaveError: could not "
                                    f"save the checkpoint of step {intact + 2} in {out}/"
                                    "checkpoints: the disk is full (No space left on "
                                    f"device); the newest checkpoint, step {intact}, is "
                                    "intact; free space and run the same command"), lines[-1]
        assert [line for line in lines if "rror" in line] == [lines[-1]], run.stderr
        assert "Traceback" not in run.stderr and "Event loop" not in run.stderr
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        assert _train(out, f"train.steps={intact + 2}", "CheckpointConfig.every=2",
                      "CheckpointConfig.max_to_keep=None") == 0
        assert int(_checkpoint(out, intact + 2)["step"]) == intact + 2
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
