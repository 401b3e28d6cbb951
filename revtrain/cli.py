"""Command-line tools: ``revtrain-train``, ``revtrain-eval``, ``revtrain-decode``,
``revtrain-tokenizer``.

``revtrain-train --config_file=configs/reversible_lm.gin [--config_file=...]
--gin_bindings='train.steps=20' [--gin_bindings=...] --output_dir=runs/lm`` parses the gin
files and bindings (later ones win), calls the gin-configured `train` (see
`revtrain.training.train_lib`), writes the operative config to ``output_dir/config.gin``
once the run is set up, and prints the final eval metrics. Running it again on the same
``output_dir`` resumes from the newest checkpoint. The first Ctrl-C (SIGINT), SIGTERM or
SIGHUP (a closed terminal or ssh session) saves a checkpoint after the current step and
exits with status ``128 + signal``; SIGKILL cannot be caught, so the steps after the newest
checkpoint are lost (`revtrain.training.interrupts`).

``revtrain-eval --output_dir=... [--wait]`` rebuilds the run from ``output_dir/config.gin``
and evaluates every checkpoint without eval records (following the run with ``--wait``);
``revtrain-decode --output_dir=... --prompt='def '`` continues prompts with a text LM
and writes ``output_dir/decoder_out/step_<N>.jsonl``. Both use the tokenizer the run
recorded (``output_dir/tokenizer.json`` and its ``tokenizer.model`` copy): a run trained
with a SentencePiece model is evaluated and decoded with that model, no flag needed.

``revtrain-tokenizer --input=a.txt [--input=...] --vocab_size=8000 --model_prefix=out/sp``
trains a SentencePiece model on local text (the embedded corpus without ``--input``) and
writes ``out/sp.model`` (`revtrain.data.train_sentencepiece`).

Compiled programs are kept in JAX's persistent compilation cache, so a restarted run, an
eval and a second decode compile nothing again: ``--compilation_cache_dir=DIR`` moves it and
``--nocompilation_cache`` turns it off (`revtrain.cli_compile_cache`,
`revtrain.training.compile_cache`).

Multi-host: ``--coordinator_address=host:port --num_processes=N --process_id=i`` (or the
environment variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
``JAX_PROCESS_ID``) call ``jax.distributed.initialize`` before anything else (on CPU, JAX
uses its default gloo collectives).

Conventions: the console scripts run under ``absl.app.run`` and log through
``absl.logging``, so absl's logging flags work (``--verbosity=1`` for debug lines,
``--log_dir`` with ``--alsologtostderr``); the ``revtrain.*`` loggers' INFO lines (progress,
checkpoints, memory) show on stderr. ``--gin_file`` is an alias of ``--config_file``, as in
other gin-configured JAX tools, and a config name without a directory (``copy_task.gin``)
is found among the configs shipped in the package (``revtrain/configs``). The operative
config also goes to TensorBoard as text (``tensorboard/config``).

Errors a user can fix (bad flags, unknown gin parameters, missing files, a NaN loss, a
checkpoint of another model) are printed as one line, ``<tool>: error: <message>``, with
exit status 2 for usage errors and 1 otherwise; ``--traceback`` shows the full traceback.
Each ``*_main(argv)`` builds its own flag set, so the tools can be called in-process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

import gin
from absl import app, flags

from revtrain import host_heap
from revtrain.cli_common import (  # noqa: F401  (logging_through_absl, parse_gin: used by tests)
    GinFileError,
    UsageError,
    common_flags,
    initialize_distributed,
    is_chief,
    logging_through_absl,
    parse_gin,
    print_metrics,
    run,
    use_run_tokenizer,
)
from revtrain.cli_compile_cache import define_cache_flags, use_flagged_cache
from revtrain.cli_flags import MAX_SEED, define_real
from revtrain.cli_saved_run import read_run
from revtrain.cli_tokenizer import tokenizer_main
from revtrain.training.run_directory import (
    CHECKPOINT_DIR,
    DECODER_DIR,
    TENSORBOARD_CONFIG_DIR,
)

# --------------------------------------------------------------------------------------
# revtrain-train.

def _write_operative_config(output_dir: str) -> Callable:
    """A `Loop` callback writing gin's operative config to ``config.gin`` and TensorBoard."""
    def write(loop) -> None:
        if is_chief():
            from revtrain.training.config_history import write_run_config
            from revtrain.training.metrics_writer import EventFile
            from revtrain.training.write_failures import reporting_write_failures

            config = gin.operative_config_str()
            write_run_config(output_dir, config)
            logdir = os.path.join(output_dir, TENSORBOARD_CONFIG_DIR)
            with reporting_write_failures(f"write the TensorBoard events in {logdir}",
                                          os.path.join(output_dir, CHECKPOINT_DIR)):
                events = EventFile(logdir)
                try:
                    events.add_text("gin/operative_config", gin.config.markdown(config),
                                    loop.step)
                finally:
                    events.close()
    return write


def _print_summary(loop) -> None:
    """A `Loop` callback printing the parameter count and per-layer summary (stdout)."""
    if is_chief():
        print(loop.summary, flush=True)


def _train(fv: flags.FlagValues) -> int:
    if not fv.output_dir:
        raise UsageError("--output_dir is required (checkpoints, metrics and config.gin go "
                         "there)")
    if not fv.config_file:
        raise UsageError("give at least one --config_file, e.g. "
                         "--config_file=configs/reversible_lm.gin")
    initialize_distributed(fv)
    parse_gin(fv.config_file, fv.gin_bindings)
    from revtrain import configurables
    from revtrain.training.config import legacy_binding_error

    removed = sorted(set(gin.get_bindings("train")) - {"steps"})
    if removed:  # A usage error, before anything is built.
        raise UsageError(str(legacy_binding_error(removed)))
    output_dir = os.path.abspath(fv.output_dir)
    use_flagged_cache(fv)
    loop = configurables.train(output_dir=output_dir,
                               callbacks=[_write_operative_config(output_dir),
                                          _print_summary],
                               **configurables.run_configs())
    if loop.interrupted_by is not None:
        name = signal.Signals(loop.interrupted_by).name
        # After SIGHUP the terminal may be gone (EIO): the save is done, the status stands.
        with contextlib.suppress(OSError):
            if is_chief():
                print(f"stopped by {name} after step {loop.step}; the checkpoint is saved "
                      f"in {output_dir}; run the same command to resume", file=sys.stderr)
        return 128 + loop.interrupted_by
    if loop.last_eval_metrics:
        print_metrics(f"final eval at step {loop.step}", loop.last_eval_metrics)
    return 0


def train_main(argv: Sequence[str] | None = None) -> int:
    """``revtrain-train``; returns the exit status (``argv[0]`` is the program name)."""
    fv = common_flags("Directory for checkpoints, metrics.jsonl, TensorBoard files and "
                       "config.gin; an existing run there is resumed.")
    define_cache_flags(fv)
    return run("revtrain-train", fv, argv, _train)


# --------------------------------------------------------------------------------------
# revtrain-eval and revtrain-decode: the run rebuilt from output_dir/config.gin
# (`revtrain.cli_saved_run.read_run`).

def _eval(fv: flags.FlagValues) -> int:
    import dataclasses

    from revtrain.training.eval_program import CheckpointEvaluator

    output_dir, configs, final_step = read_run(fv)
    use_flagged_cache(fv)
    eval_config = configs["eval_config"]
    if fv.one_pass or fv.eval_steps is not None:
        steps = None if fv.one_pass else fv.eval_steps
        eval_config = dataclasses.replace(eval_config, steps=steps)
    if not eval_config.enabled:
        raise UsageError("this run has EvalConfig.steps=0 (no evaluation); pass "
                         "--eval_steps=N or --one_pass")
    evaluator = CheckpointEvaluator(configs["run"], eval_config, output_dir, fv.split)
    try:
        if not fv.wait and not evaluator.checkpointer.all_steps():
            raise UsageError(f"no checkpoint to load in {evaluator.checkpointer.directory}; "
                             f"train first, or pass --wait to evaluate the checkpoints as "
                             f"they appear")
        if fv.step is not None and fv.step not in evaluator.checkpointer.all_steps():
            raise UsageError(f"--step={fv.step}: no checkpoint of that step in "
                             f"{evaluator.checkpointer.directory}; it has "
                             f"{evaluator.checkpointer.all_steps()}")
        results = (evaluator.follow(final_step, fv.poll_seconds) if fv.wait else
                   evaluator.run(fv.step))
        count = 0
        for step, metrics in results:
            for split, values in metrics.items():
                print_metrics(f"{split} at step {step}", values)
            count += 1
    finally:
        evaluator.close()
    if count == 0 and is_chief():
        print(f"nothing to evaluate: every checkpoint in {output_dir} has its eval records "
              f"in metrics.jsonl", flush=True)
    return 0


def eval_main(argv: Sequence[str] | None = None) -> int:
    """``revtrain-eval``: evaluates the checkpoints of ``--output_dir`` without eval records."""
    fv = common_flags("The output_dir of a revtrain-train run.")
    define_cache_flags(fv)
    flags.DEFINE_boolean("wait", False, "Keep polling for new checkpoints (and, first, for "
                         "the run's config.gin); exit after the run's final step "
                         "(train.steps) is evaluated.", flag_values=fv)
    define_real("poll_seconds", 10.0, "Seconds between looks for new checkpoints with "
                "--wait.", fv, lower=0.0, upper=600.0, lower_open=True)
    flags.DEFINE_integer("step", None, "Evaluate only the checkpoint of this step.",
                         flag_values=fv, lower_bound=0)
    flags.DEFINE_string("split", None, "Evaluate only this eval split (default: all).",
                        flag_values=fv)
    flags.DEFINE_integer("eval_steps", None, "Eval batches per split (default: the run's "
                         "EvalConfig.steps).", flag_values=fv, lower_bound=1)
    flags.DEFINE_boolean("one_pass", False, "One exact pass over each (finite) split.",
                         flag_values=fv)
    return run("revtrain-eval", fv, argv, _eval)


def _decode(fv: flags.FlagValues) -> int:
    from revtrain.data import ByteTokenizer
    from revtrain.training.decode_program import (
        decode_length,
        decode_to_file,
        default_length_note,
        load_decoder,
        new_bytes_per_prompt,
    )
    from revtrain.training.run_tokenizer import read_run_tokenizer

    if fv.prompts_file and fv["prompt"].present:
        raise UsageError("give --prompt or --prompts_file, not both")
    prompts = _read_prompts(fv.prompts_file) if fv.prompts_file else [_prompt(fv.prompt)]
    output_dir, configs, _ = read_run(fv)
    use_flagged_cache(fv)
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


# --------------------------------------------------------------------------------------
# Console-script entry points (setup.cfg).

def _app_run(main: Callable[[Sequence[str]], int], tool: str) -> None:
    """Runs ``main(sys.argv)`` under ``absl.app.run``; exits with its status.

    The host allocator is tuned first (`revtrain.host_heap.configure_host_allocator`;
    ``REVTRAIN_HOST_ALLOCATOR=system`` opts out). ``main`` parses its own flag set (which
    holds absl's logging flags), so ``absl.app`` only needs ``FLAGS`` marked parsed; INFO
    lines are shown without absl's prefix. A bad ``REVTRAIN_HOST_ALLOCATOR`` is a one-line
    ``<tool>: error:`` with exit status 2 (``tool`` names the command also under
    ``python -m revtrain``, whose ``argv[0]`` is ``__main__.py``).
    """
    flags.FLAGS.set_default("showprefixforinfo", False)
    try:  # Before any JAX computation: the runtime's threads pick their heap once.
        host_heap.configure_host_allocator()
    except ValueError as e:
        print(f"{tool}: error: ValueError: {e}", file=sys.stderr)
        sys.exit(2)

    def parse(argv: list[str]) -> list[str]:
        flags.FLAGS.mark_as_parsed()
        return argv

    def run_main(argv: list[str]) -> int:
        status = main(argv)
        _nothing_after_the_last_line(status)
        return status

    app.run(run_main, flags_parser=parse)


def _nothing_after_the_last_line(status: int) -> None:
    """Keeps the command's last line last while the interpreter shuts down.

    Once ``main`` has returned, its work is done (checkpoints committed, the lock
    released), so a Ctrl-C now exits at once with status 130 instead of raising
    ``KeyboardInterrupt`` inside an ``atexit`` handler. After a failure reported in one
    line (status not 0; ``--traceback`` raises instead of returning), what the failure left
    behind -- orbax's and tensorstore's threads, asyncio's "Event loop is closed", C++
    logs -- is not shown: Python's reports of it are dropped and stderr goes to
    ``/dev/null``.
    """
    import signal
    import threading
    import warnings

    def exit_now(signum: int, frame: object) -> None:
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, exit_now)
    if status == 0:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    sys.unraisablehook = lambda unraisable: None
    threading.excepthook = lambda args: None
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stderr.fileno())
    os.close(devnull)


def run_train() -> None:
    """Console script ``revtrain-train`` (also ``python -m revtrain``)."""
    _app_run(train_main, "revtrain-train")


def run_eval() -> None:
    """Console script ``revtrain-eval``."""
    _app_run(eval_main, "revtrain-eval")


def run_decode() -> None:
    """Console script ``revtrain-decode``."""
    _app_run(decode_main, "revtrain-decode")


def run_tokenizer() -> None:
    """Console script ``revtrain-tokenizer``."""
    _app_run(tokenizer_main, "revtrain-tokenizer")
