"""Command-line tools: ``revtrain-train``, ``revtrain-eval``, ``revtrain-decode``,
``revtrain-tokenizer``, ``revtrain-plan``.

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
``--nocompilation_cache`` turns it off (`revtrain.cli.cache_flags`,
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

The programs, one module each, and what they share:

- `train`: ``revtrain-train`` (`train_main`);
- `evaluate`: ``revtrain-eval`` (`eval_main`);
- `decode`: ``revtrain-decode`` (`decode_main`);
- `tokenizer`: ``revtrain-tokenizer`` (`tokenizer_main`);
- `plan`: ``revtrain-plan`` (`plan_main`): which trainer fits a memory budget, at what
  batch and speed (`revtrain.planning`); its budget flags serve ``revtrain-train`` too;
- `saved_run`: the run that eval and decode rebuild from ``output_dir/config.gin``;
- `common`: the common flag set, absl logging, ``jax.distributed`` start-up, gin parsing,
  and `run`, which turns errors into one line and an exit status;
- `bounded_flags`: numeric flags refused while the flags are parsed (`define_real`);
- `cache_flags`: the compilation-cache flags;
- `app`: the console-script entry points (`run_train`, ...) under ``absl.app``.
"""

from revtrain.cli.app import run_decode, run_eval, run_plan, run_tokenizer, run_train
from revtrain.cli.decode import decode_main
from revtrain.cli.evaluate import eval_main
from revtrain.cli.plan import plan_main
from revtrain.cli.tokenizer import tokenizer_main
from revtrain.cli.train import train_main

__all__ = ["decode_main", "eval_main", "plan_main", "run_decode", "run_eval", "run_plan",
           "run_tokenizer", "run_train", "tokenizer_main", "train_main"]
