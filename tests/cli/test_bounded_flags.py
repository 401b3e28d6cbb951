"""Tests of revtrain/cli/bounded_flags.py and of every tool's numeric flags: a bad value is refused
while the flags are parsed, in one line naming the flag and the value, before anything is
loaded (the output directory below does not exist: a later check would say so instead)."""
import pytest
from absl import flags

from revtrain import cli
from revtrain.cli.bounded_flags import define_real

MAIN = {"train": cli.train_main, "eval": cli.eval_main, "decode": cli.decode_main,
        "tokenizer": cli.tokenizer_main}


@pytest.mark.parametrize("tool, flag, message", [
    ("decode", "--temperature=inf", "flag --temperature=inf: must be a finite number >= 0"),
    ("decode", "--temperature=nan", "flag --temperature=nan: must be a finite number >= 0"),
    ("decode", "--temperature=-1", "flag --temperature=-1: must be a finite number >= 0"),
    ("decode", "--top_p=0.0", "flag --top_p=0.0: must be a finite number in (0, 1]"),
    ("decode", "--top_p=nan", "flag --top_p=nan: must be a finite number in (0, 1]"),
    ("decode", "--top_p=1.5", "flag --top_p=1.5: must be a finite number in (0, 1]"),
    ("decode", "--max_new_bytes=-1", "flag --max_new_bytes=-1: -1 is not "),
    ("decode", "--step=-1", "flag --step=-1: -1 is not "),
    ("decode", "--seed=-1", "flag --seed=-1: -1 is not "),
    ("decode", "--seed=4294967296", "flag --seed=4294967296: 4294967296 is not "),
    ("eval", "--poll_seconds=nan", "flag --poll_seconds=nan: must be a finite number in "
                                   "(0, 600]"),
    ("eval", "--poll_seconds=0", "flag --poll_seconds=0: must be a finite number in (0, 600]"),
    ("eval", "--step=-2", "flag --step=-2: -2 is not "),
    ("train", "--num_processes=0", "flag --num_processes=0: 0 is not "),
    ("train", "--process_id=-1", "flag --process_id=-1: -1 is not "),
])
# revtrain-tokenizer's --vocab_size is bounded by the one SentencePiece option check, which
# says why (the byte pieces): tests/test_troubleshooting.py's tokenizer table.
def test_a_bad_number_is_refused_at_parsing_naming_flag_and_value(tmp_path, capsys, tool,
                                                                  flag, message):
    argv = [f"revtrain-{tool}", flag]
    if tool != "tokenizer":
        argv.append(f"--output_dir={tmp_path / 'none'}")
    assert MAIN[tool](argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"revtrain-{tool}: error: {message}"), line
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("prompt, message", [
    ("", "--prompt is empty; give text to continue (--prompt='def '), or leave the flag out "
         "to continue a newline"),
    ("caf\udce9 au lait", "--prompt is not UTF-8 text (byte 0xe9 at offset 3); pass UTF-8 "
                          "text, or the prompts in a UTF-8 file with --prompts_file"),
])
def test_an_empty_or_non_utf8_prompt_is_one_line_before_loading(tmp_path, capsys, prompt,
                                                                message):
    argv = ["revtrain-decode", f"--prompt={prompt}", f"--output_dir={tmp_path / 'none'}"]
    assert cli.decode_main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"revtrain-decode: error: {message}"]


@pytest.mark.parametrize("flag", ["--top_k=20", "--top_p=0.9"])
def test_sampling_flags_at_temperature_0_are_one_line_before_loading(tmp_path, capsys, flag):
    # Greedy decoding takes the argmax: a --top_k or --top_p there would be ignored.
    name = flag.split("=")[0]
    argv = ["revtrain-decode", flag, f"--output_dir={tmp_path / 'none'}"]
    assert cli.decode_main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"revtrain-decode: error: {flag} has no effect at --temperature=0 (greedy decoding); "
        f"pass --temperature above 0 to sample, or leave {name} out"]
    assert not (tmp_path / "none").exists()


def test_define_real_keeps_its_interval_and_default():
    fv = flags.FlagValues()
    define_real("rate", 0.5, "A rate.", fv, lower=0.0, upper=1.0, lower_open=True)
    fv(["prog"])
    assert fv.rate == 0.5
    fv(["prog", "--rate=1"])
    assert fv.rate == 1.0
    for bad in ("0", "-0.0", "inf", "-inf", "nan", "1.0000001"):
        with pytest.raises(flags.IllegalFlagValueError, match=r"must be a finite number in "
                           r"\(0, 1\]"):
            fv(["prog", f"--rate={bad}"])
    assert "(a finite number in (0, 1])" in fv.get_help()


@pytest.mark.parametrize("name, value, message", [
    ("JAX_NUM_PROCESSES", "0", "environment variable JAX_NUM_PROCESSES='0' must be >= 1"),
    ("JAX_PROCESS_ID", "-1", "environment variable JAX_PROCESS_ID='-1' must be >= 0"),
])
def test_the_environment_variables_of_the_process_flags_have_their_bounds(
        tmp_path, capsys, monkeypatch, name, value, message):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1")
    for each in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.setenv(each, value if each == name else "1" if "NUM" in each else "0")
    argv = ["revtrain-train", f"--output_dir={tmp_path / 'run'}", "--config_file=copy_task.gin"]
    assert cli.train_main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"revtrain-train: error: {message}"]
