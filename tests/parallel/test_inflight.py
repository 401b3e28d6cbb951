"""Trainers keep few enough programs queued on XLA's CPU client that its collectives cannot
hang (`revtrain.parallel.inflight`).

Without the bound, a block trainer of 16 reversible pairs at d_model 1024 on 4 forced CPU
devices hung in its first step: one device's 32 in-flight slots were taken by later
programs while the others waited for it in the gradient all-reduce, and XLA aborted the
process after its collective timeout.
"""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from revtrain.parallel.inflight import InflightLimit
from revtrain.parallel.placement import Placement

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_DEEP_WIDE_STEPS = """
import sys
import jax
from revtrain import layers as tl
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer
from tests.trainers.conftest import adam, make_batch, signature
D, VOCAB = 1024, 16
def pair():
    return [tl.ReversibleHalfResidual(tl.LayerNorm(), tl.Dense(D), tl.Dropout(0.1)),
            tl.ReversibleSwap(), tl.ReversibleHalfResidual(tl.Dense(D), tl.Relu()),
            tl.ReversibleSwap()]
batch = make_batch()
for kind, fsdp in [("ReversibleSerialTrainer", False), ("ReversibleSerialTrainer", True),
                   ("MemoryEfficientTrainer", True)]:
    blocks = [(tl.Serial(tl.Embedding(VOCAB, D), tl.Dup()),
               [layer for _ in range(16) for layer in pair()])]
    loss = tl.Serial(tl.Concatenate(), tl.Dense(VOCAB), tl.LogSoftmax(), tl.CrossEntropyLoss())
    tl.init_reversible_blocks(blocks, loss, signature(batch), jax.random.key(0))
    cls = {"ReversibleSerialTrainer": ReversibleSerialTrainer,
           "MemoryEfficientTrainer": MemoryEfficientTrainer}[kind]
    trainer = cls(blocks, loss, adam, n_devices=4, fsdp=fsdp)
    print(kind, fsdp, "finished", float(trainer.one_step(batch, jax.random.key(0))[0]),
          flush=True)
"""


def test_a_deep_wide_model_on_four_cpu_devices_does_not_hang():
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=4"
               + " --xla_cpu_collective_call_terminate_timeout_seconds=120",
               JAX_ENABLE_COMPILATION_CACHE="false")
    run = subprocess.run([sys.executable, "-c", _DEEP_WIDE_STEPS], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    stuck = [line for line in run.stderr.splitlines() if "rendezvous" in line.lower()]
    assert run.returncode == 0, (stuck or run.stderr.splitlines())[-3:]
    finished = [line for line in run.stdout.splitlines() if "finished" in line]
    assert len(finished) == 3, run.stdout
    assert all(np.isfinite(float(line.split()[-1])) for line in finished), run.stdout


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("batch",))


def test_waits_on_every_limit_th_program_and_only_on_several_cpu_devices(monkeypatch):
    waited = []
    monkeypatch.setattr("revtrain.parallel.inflight.jax.block_until_ready", waited.append)
    limit = InflightLimit(Placement(_mesh(4)), limit=3)
    assert limit.active
    for i in range(7):
        limit.note(i)
    assert waited == [2, 5]
    single = InflightLimit(Placement(_mesh(1)), limit=1)
    assert not single.active
    single.note("not waited for")
    assert waited == [2, 5]


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit=0 must be at least 1"):
        InflightLimit(Placement(_mesh(4)), limit=0)
