"""Multi-device CPU programs get enough XLA client threads for their collectives, or are
refused before they run (`revtrain.parallel.cpu_collectives`, issue 40)."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from revtrain import _xla_cpu
from revtrain.parallel import cpu_collectives
from revtrain.parallel.cpu_collectives import CollectiveThreads, max_waiting_collectives
from revtrain.parallel.mesh import MESH_AXES
from tests.mesh_models import build, global_batch, transformer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_HLO = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%inner_body (p: (f32[4], s32[])) -> (f32[4], s32[]) {
  %cp = f32[4]{0} collective-permute(f32[4]{0} %x), channel_id=1, source_target_pairs={{0,1}}
}

%outer_body (p: (f32[4], s32[])) -> (f32[4], s32[]) {
  %w = (f32[4], s32[]) while((f32[4], s32[]) %t), condition=%cond, body=%inner_body
  %ag = f32[4]{0} all-gather(f32[4]{0} %y), channel_id=1, dimensions={0}
}

%cond (p: (f32[4], s32[])) -> pred[] {
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %ar = f32[4]{0} all-reduce(f32[4]{0} %x), channel_id=1, to_apply=%add
  %w2 = (f32[4], s32[]) while((f32[4], s32[]) %t), condition=%cond, body=%outer_body
  ROOT %rs = f32[4]{0} reduce-scatter(f32[4]{0} %z), channel_id=1, to_apply=%add
}
"""


def test_the_bound_adds_one_per_level_and_the_levels_of_every_loop():
    # main: its own collectives (1) + outer loop (its all-gather 1 + inner loop 1).
    assert max_waiting_collectives(_HLO) == 3
    without_loops = _HLO.replace("body=%outer_body", "body=%cond")
    assert max_waiting_collectives(without_loops) == 1
    assert max_waiting_collectives("HloModule m\n\nENTRY %main () -> f32[] {\n}\n") == 0


def test_reserve_threads_keeps_what_the_user_set():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    _xla_cpu.reserve_threads(env)
    assert env["NPROC"] == "256"
    assert env["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=4 "
                                "--xla_cpu_collective_call_terminate_timeout_seconds=1800")
    mine = {"NPROC": "8", "XLA_FLAGS": "--xla_cpu_collective_call_terminate_timeout_seconds=5"}
    _xla_cpu.reserve_threads(mine)
    assert mine == {"NPROC": "8",
                    "XLA_FLAGS": "--xla_cpu_collective_call_terminate_timeout_seconds=5"}


def test_this_process_has_the_reserved_client_threads():
    """conftest imports revtrain before JAX starts, so the client has 256 threads."""
    jax.devices()
    expected = min(max(int(os.environ["NPROC"]), 4), _xla_cpu.RESERVED_THREADS)
    assert cpu_collectives.client_threads(4) == expected


def _ring_then_reduce(mesh):
    """A ring of ``ppermute`` in a loop, then an independent ``psum``: the shape of the
    program that deadlocked (ring attention beside a gradient reduction)."""
    def body(x):
        ring = lax.fori_loop(0, 4, lambda i, v: lax.ppermute(
            v, "seq", [(d, (d + 1) % 4) for d in range(4)]), x)
        return ring, lax.psum(x * 2.0, "seq")

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("seq"),
                                 out_specs=(P("seq"), P("seq"))))


def test_a_program_that_could_take_every_thread_is_refused_before_it_runs(monkeypatch):
    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
    program, x = _ring_then_reduce(mesh), np.arange(16.0)
    lowered = []
    real = cpu_collectives.max_waiting_collectives
    monkeypatch.setattr(cpu_collectives, "max_waiting_collectives",
                        lambda text: lowered.append(1) or real(text))
    threads = CollectiveThreads(mesh)
    assert threads.active
    threads.check("ring", program, (x,))
    threads.check("ring", program, (x,))
    assert lowered == [1]  # Once per argument signature.
    waiting = real(program.lower(x).compile().as_text())
    assert waiting >= 2
    monkeypatch.setattr(cpu_collectives, "client_threads", lambda n: 4 * waiting - 1)
    with pytest.raises(RuntimeError) as error:
        CollectiveThreads(mesh).check("ring", program, (x,))
    message = str(error.value)
    assert "\n" not in message
    assert f"program 'ring' can wait in {waiting} collectives at once on each of 4" in message
    assert "NPROC=256" in message


def test_one_device_and_one_level_programs_are_not_checked(monkeypatch):
    monkeypatch.setattr(cpu_collectives, "client_threads", lambda n: 1)
    single = CollectiveThreads(Mesh(np.array(jax.devices()[:1]), ("seq",)))
    assert not single.active
    single.check("anything", object(), ())
    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
    reduce_only = jax.jit(jax.shard_map(lambda x: lax.psum(x, "seq"), mesh=mesh,
                                        in_specs=P("seq"), out_specs=P()))
    monkeypatch.setattr(cpu_collectives, "client_threads", lambda n: 4)
    CollectiveThreads(mesh).check("psum", reduce_only, (np.arange(8.0),))


def test_ring_attention_fsdp_and_data_reductions_in_one_program_fit_the_threads():
    """The (data, fsdp, seq) = (1, 2, 2) Transformer with scanned layers: its reverse
    program holds ring attention loops, FSDP gathers and reduce-scatters and the
    gradient reductions. Some program can wait in several collectives at once on a
    device (the hazard is real), and every one fits the client's threads."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 2, 2), MESH_AXES)
    trainer = build("ReversibleSerialTrainer", transformer, mesh=mesh, scan_layers=True)
    seen = {}

    class Record:
        def on_dispatch(self, label, program, args):
            if label not in seen:
                text = program.lower(*args).compile().as_text()
                seen[label] = max_waiting_collectives(text)

    trainer.observers.append(Record())
    trainer.one_step(global_batch(), jax.random.key(0))
    assert max(seen.values()) >= 2, seen
    assert 4 * max(seen.values()) <= cpu_collectives.client_threads(4), seen


def test_a_small_client_refuses_the_ring_program_instead_of_hanging():
    """Issue 40's failure, forced: a client of 4 threads (NPROC=4, what a 2-core machine
    gave) and the (1, 2, 2) Transformer. Before the check this could hang and abort
    (status 134); now the step is refused in one line and the process ends normally."""
    script = ("import jax, numpy as np\n"
              "from jax.sharding import Mesh\n"
              "from revtrain.parallel.mesh import MESH_AXES\n"
              "from tests.mesh_models import build, global_batch, transformer\n"
              "mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 2, 2), MESH_AXES)\n"
              "t = build('ReversibleSerialTrainer', transformer, mesh=mesh)\n"
              "try:\n"
              "    t.one_step(global_batch(), jax.random.key(0))\n"
              "except RuntimeError as e:\n"
              "    print('refused:', e)\n")
    env = dict(os.environ, NPROC="4", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_ENABLE_COMPILATION_CACHE="false")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused: program " in run.stdout and "could deadlock" in run.stdout, run.stdout
