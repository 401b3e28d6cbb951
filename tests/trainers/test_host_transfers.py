"""A training step touches the host only where it must: no implicit transfer in either
direction (``jax.transfer_guard('disallow')``), and `one_step` returns while the step's
device work is still running (JAX's asynchronous dispatch), for all three trainers."""
import time

import jax
import numpy as np
import pytest

from revtrain import layers as tl
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
from tests.trainers.conftest import adam, initialised_blocks, make_batch, signature

TRAINERS = ["Trainer", "ReversibleSerialTrainer", "MemoryEfficientTrainer"]


def _trainer(name, blocks, loss, n_devices, **kwargs):
    if name == "Trainer":
        return Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), adam,
                       n_devices=n_devices, **kwargs)
    cls = {"ReversibleSerialTrainer": ReversibleSerialTrainer,
           "MemoryEfficientTrainer": MemoryEfficientTrainer}[name]
    return cls(blocks, loss, adam, n_devices=n_devices, **kwargs)


@pytest.mark.parametrize("name,kwargs,n_devices", [
    ("Trainer", {}, 1), ("Trainer", {"fsdp": True}, 4),
    ("ReversibleSerialTrainer", {}, 1), ("ReversibleSerialTrainer", {}, 4),
    ("ReversibleSerialTrainer", {"clip_global_norm": 1.0}, 4),
    ("ReversibleSerialTrainer", {"fsdp": True, "keep_every": 2}, 4),
    ("MemoryEfficientTrainer", {}, 1), ("MemoryEfficientTrainer", {"fsdp": True}, 4)])
def test_ordinary_steps_make_no_implicit_transfer(name, kwargs, n_devices):
    """Host batches and keys go to the devices by explicit puts; nothing comes back."""
    batch = make_batch()
    trainer = _trainer(name, *initialised_blocks("two", batch), n_devices, **kwargs)
    trainer.one_step(batch, jax.random.key(0))  # Compiles (and may read shapes) first.
    trainer.block_until_ready()
    rngs = [jax.random.key(s) for s in range(1, 4)]
    with jax.transfer_guard("disallow"):
        for step, rng in enumerate(rngs):
            loss, stats = trainer.one_step(batch, rng, step=step + 1,
                                           learning_rate=1e-3 if step == 1 else None)
    assert np.isfinite(float(loss)) and float(stats["gradients_l2"]) > 0


def test_the_guard_does_catch_an_implicit_transfer():
    """The check above can fail: an implicit host-to-device transfer is an error."""
    add = jax.jit(lambda a, b: a + b)
    x = jax.numpy.ones(3)
    with jax.transfer_guard("disallow"), pytest.raises(Exception, match="Disallowed"):
        add(x, np.ones(3, np.float32))


def _heavy(batch):
    """A model whose step takes about a second on one CPU device, most of it in the first
    block's standard layer (the last op a block trainer dispatches is its update)."""
    wide = 1024
    blocks = [(tl.Serial(tl.Embedding(16, 64), tl.Dense(wide), tl.Relu(), tl.Dense(wide),
                         tl.Relu(), tl.Dense(wide), tl.Relu(), tl.Dense(64), tl.Dup()),
               [tl.ReversibleHalfResidual(tl.Dense(64)), tl.ReversibleSwap()])]
    loss = tl.Serial(tl.Concatenate(), tl.Dense(16), tl.LogSoftmax(), tl.CrossEntropyLoss())
    tl.init_reversible_blocks(blocks, loss, signature(batch), jax.random.key(0))
    return blocks, loss


# The share of a step's wall time `one_step` may take before it returns. A block trainer
# that keeps values on the devices dispatches everything and returns; `Trainer` dispatches
# one program. `MemoryEfficientTrainer` copies each layer's new values back to host memory
# before the next layer's op (its bound on what is resident), so its host waits for every
# op but the last; what it must not wait for is the final update (most of this model's
# work), unless it frees the devices at the end of each step (its default), which means
# waiting for that update: the test turns that off.
MAX_SHARE = {"Trainer": 0.2, "ReversibleSerialTrainer": 0.2, "MemoryEfficientTrainer": 0.6}


def _dispatch_share_of_plain_jit() -> float:
    """How much of a ~0.3 s jitted computation the call itself takes (the backend's own
    asynchronous dispatch: near 0 when it has it, near 1 when it runs programs inline)."""
    x = jax.numpy.ones((1024, 1024))
    chain = jax.jit(lambda a: jax.lax.fori_loop(0, 40, lambda _, b: jax.numpy.tanh(b @ a), a))
    chain(x).block_until_ready()
    start = time.perf_counter()
    out = chain(x)
    dispatched = time.perf_counter() - start
    out.block_until_ready()
    return dispatched / (time.perf_counter() - start)


@pytest.mark.parametrize("name", TRAINERS)
def test_one_step_returns_before_the_steps_device_work_is_done(name):
    if _dispatch_share_of_plain_jit() > 0.5:
        pytest.skip("this jax's CPU backend runs programs as they are called (no "
                    "asynchronous dispatch to measure)")
    batch = make_batch(batch_size=64)
    batch = tuple(np.tile(b, (1, 40)) for b in batch)  # [64, 240]: ~1 s of work a step.
    kwargs = ({"free_accelerators_on_step": False} if name == "MemoryEfficientTrainer"
              else {})
    trainer = _trainer(name, *_heavy(batch), 1, **kwargs)
    for step in range(2):
        trainer.one_step(batch, jax.random.key(step))
    trainer.block_until_ready()
    shares = []
    for step in range(2, 4):
        start = time.perf_counter()
        loss, _ = trainer.one_step(batch, jax.random.key(step))
        dispatched = time.perf_counter() - start
        trainer.block_until_ready()
        jax.block_until_ready(loss)
        shares.append(dispatched / (time.perf_counter() - start))
    assert min(shares) < MAX_SHARE[name], shares


@pytest.mark.parametrize("name", TRAINERS)
def test_a_batch_without_weights_needs_nothing_of_the_loss_input(name):
    """Without a weights item every device's share is equal; the loss layer may take any
    stack (here a scalar first), and every trainer gives `Trainer`'s loss."""
    import jax.numpy as jnp
    inputs, targets, _ = make_batch()
    batch = (inputs, targets)

    def loss_fn(aux, x, t):
        logp = jax.nn.log_softmax(x)
        return aux * 0.0 - jnp.mean(jnp.take_along_axis(logp, t[..., None], -1))
    blocks = [(tl.Serial(tl.Embedding(16, 16), tl.Dup()),
               [tl.ReversibleHalfResidual(tl.Dense(16)), tl.ReversibleSwap()]),
              (tl.Serial(tl.Concatenate(), tl.Dense(16),
                         tl.Fn("aux_first", lambda x: (jnp.mean(x), x), n_out=2)), [])]
    loss = tl.Fn("loss", loss_fn)
    tl.init_reversible_blocks(blocks, loss, signature(batch), jax.random.key(0))
    reference = _trainer("Trainer", blocks, loss, 2).one_step(batch, jax.random.key(1))[0]
    got = _trainer(name, blocks, loss, 2).one_step(batch, jax.random.key(1))[0]
    np.testing.assert_allclose(float(got), float(reference), rtol=1e-6)
