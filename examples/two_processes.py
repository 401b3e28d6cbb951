"""A two-process (multi-host) training run on one machine, on CPU.

Multi-host JAX runs one Python process per host; `jax.distributed.initialize` connects
them through a coordinator, after which ``jax.devices()`` lists every process's devices
and the trainers' collectives (gradient averages, eval sums) span all of them -- on CPU
through gloo. revtrain's parts of the contract:

* each process builds the same `RunConfig` and reads only its slice of the global batch
  (`TextFiles` gives process ``i`` rows ``i * batch / n ... (i + 1) * batch / n``);
* only process 0 writes metrics and the run's files; every process takes part in saving
  checkpoints (orbax) and in evaluation;
* the result does not depend on how the global batch is split (the tests compare a
  2-process run with a 1-process run on the same global batches).

Here one machine plays both hosts: this script starts itself twice, as process 0 and
process 1, with a coordinator on a free local port, waits for both, and checks that they
report the same eval metrics. On real hosts run the worker command on each host with the
first host's address (or use ``revtrain-train --coordinator_address=host:port
--num_processes=N --process_id=i``, which does the same).

Run: ``python examples/two_processes.py`` (``--tiny`` for a seconds-long run).
"""

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time


def worker(args: argparse.Namespace) -> None:
    """One process of the run: connect, build the run, train, print the eval metrics."""
    import functools

    import jax

    # First, before anything touches a device: join the other process.
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=2,
                               process_id=args.process_id)
    from revtrain.data import TextFiles
    from revtrain.models import ReversibleTransformerLM
    from revtrain.trainers import ReversibleSerialTrainer
    from revtrain.training import CheckpointConfig, EvalConfig, LogConfig, RunConfig, build_loop

    sizes = (dict(d_model=16, d_ff=32, n_layers=1, n_heads=2) if args.tiny else
             dict(d_model=128, d_ff=512, n_layers=2, n_heads=4))
    inputs = TextFiles(sequence_length=16 if args.tiny else 128, batch_size=8)  # Global.
    run = RunConfig(model=functools.partial(ReversibleTransformerLM, vocab_size=256,
                                            max_len=128, dropout=0.0, **sizes),
                    inputs=inputs, trainer_class=ReversibleSerialTrainer, schedule=1e-3)
    local = next(iter(inputs.train_stream(start_step=0)))[0]
    print(f"process {jax.process_index()} of {jax.process_count()}: "
          f"{jax.local_device_count()} local of {jax.device_count()} devices; its slice of "
          f"the global batch of 8: inputs {list(local.shape)}", flush=True)
    loop = build_loop(run, EvalConfig(every=0, steps=2), CheckpointConfig(every=0),
                      LogConfig(progress=False), args.output_dir)
    with loop:
        metrics = loop.run(args.steps)
    print(f"process {jax.process_index()}: eval at step {loop.step}: loss "
          f"{metrics['loss']:.6f} accuracy {metrics['accuracy']:.6f}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace) -> None:
    """Starts the two processes, waits for both, checks they agree."""
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="revtrain-two-processes-")
    coordinator = f"localhost:{_free_port()}"
    # One CPU device per process (JAX_NUM_CPU_DEVICES=2 would give 2 x 2 devices).
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    command = [sys.executable, os.path.abspath(__file__), "--worker",
               f"--coordinator={coordinator}", f"--output_dir={output_dir}",
               f"--steps={args.steps}"] + (["--tiny"] if args.tiny else [])
    # Each process writes to files, not pipes: a pipe read only after the other process
    # has finished could fill up and stall a process its peer is waiting for.
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(2)]
    processes = [subprocess.Popen(command + [f"--process_id={i}"], env=env, text=True,
                                  stdout=out, stderr=err)
                 for i, (out, err) in enumerate(logs)]
    deadline = time.monotonic() + args.timeout
    while any(p.poll() is None for p in processes):
        failed = [p.returncode not in (None, 0) for p in processes]
        if any(failed) or time.monotonic() > deadline:
            for p in processes:  # A process whose peer is gone would wait for it in vain.
                p.kill()
            i = failed.index(True) if any(failed) else 0
            logs[i][1].seek(0)
            why = (f"failed with status {processes[i].returncode}" if any(failed) else
                   f"did not finish within {args.timeout} s")
            raise SystemExit(f"process {i} {why}:\n{logs[i][1].read()[-3000:]}")
        time.sleep(0.1)
    outputs = []
    for i, (process, (out, err)) in enumerate(zip(processes, logs, strict=True)):
        out.seek(0)
        err.seek(0)
        if process.returncode != 0:
            raise SystemExit(f"process {i} failed with status {process.returncode}:\n"
                             f"{err.read()[-3000:]}")
        outputs.append(out.read())
        print(outputs[-1], end="")
    evals = [re.findall(r"eval at step \d+: (.*)", out) for out in outputs]
    assert evals[0] and evals[0] == evals[1], f"the processes disagree: {evals}"
    print(f"both processes report the same eval metrics: {evals[0][0]}; checkpoints in "
          f"{output_dir}/checkpoints")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (seconds, for CI)")
    parser.add_argument("--steps", type=int, default=None, help="default 200; 2 with --tiny")
    parser.add_argument("--output_dir", default=None, help="default: a new temporary folder")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--process_id", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.tiny else 200)
    worker(args) if args.worker else launch(args)


if __name__ == "__main__":
    main()
