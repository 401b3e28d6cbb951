"""Long-context layers through the trainers: blockwise and LSH attention, chunked
feed-forward and rotary positions give the same steps in all three trainers (dropout
included, on 1 and 4 devices, with FSDP), the same steps as the full path, no
recompilation, checkpoints that move between implementations, and a memory ledger that
counts the attention's residuals."""
import functools

import jax
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain import memory
from revtrain.models import ReversibleTransformerLM
from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
from tests.tree_utils import assert_trees_close

pytestmark = pytest.mark.slow

VOCAB, LENGTH, BATCH = 16, 12, 8
TRAINERS = {"Trainer": Trainer, "ReversibleSerialTrainer": ReversibleSerialTrainer,
            "MemoryEfficientTrainer": MemoryEfficientTrainer}


def _batch(seed=0):
    rs = np.random.RandomState(seed)
    tokens = rs.randint(0, VOCAB, (BATCH, LENGTH + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:], (rs.rand(BATCH, LENGTH) > 0.1).astype(np.float32)


def _adam():
    return optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)


def _model(implementation, dropout, ff_chunk_size=5, length=LENGTH, n_layers=1,
           attention=None):
    attention = attention or functools.partial(tl.CausalAttention,
                                               implementation=implementation, block_size=8)
    model = ReversibleTransformerLM(vocab_size=VOCAB, d_model=8, d_ff=16,
                                    n_layers=n_layers, n_heads=2, max_len=length, dropout=dropout,
                                    attention_type=attention, ff_chunk_size=ff_chunk_size,
                                    pos_type="rotary")
    blocks, loss = tl.extract_reversible_blocks([model, tl.CrossEntropyLoss()])
    tokens = np.zeros((BATCH, length), np.int32)
    tl.init_reversible_blocks(blocks, loss, (tokens, tokens, np.ones((BATCH, length),
                                                                     np.float32)),
                              jax.random.key(0))
    return blocks, loss


def _build(name, n_devices, implementation="blockwise", dropout=0.3, attention=None,
           **kwargs):
    blocks, loss = _model(implementation, dropout, attention=attention)
    if name == "Trainer":
        return Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), _adam, n_devices=n_devices,
                       **kwargs)
    return TRAINERS[name](blocks, loss, _adam, n_devices=n_devices, **kwargs)


def _steps(trainer, n=2, seed=0):
    losses = [float(trainer.one_step(_batch(seed + s), jax.random.key(10 + s), step=s)[0])
              for s in range(n)]
    return losses, trainer.weights


@pytest.mark.parametrize("n_devices", [1, 4])
def test_the_trainers_agree_and_equal_the_full_path_with_dropout(n_devices):
    """Attention-dropout masks are functions of the key and the element's position, so the
    full-path Trainer is the reference of every blockwise trainer."""
    reference = _steps(_build("Trainer", n_devices, implementation="xla"))
    assert reference[0][1] < reference[0][0]
    for name in TRAINERS:
        losses, weights = _steps(_build(name, n_devices))
        np.testing.assert_allclose(losses, reference[0], rtol=1e-5, err_msg=name)
        assert_trees_close(weights, reference[1], rtol=1e-5, atol=1e-5)


def test_device_count_and_fsdp_do_not_change_the_result_without_dropout():
    one = _steps(_build("ReversibleSerialTrainer", 1, dropout=0.0))
    for trainer in (_build("ReversibleSerialTrainer", 4, dropout=0.0),
                    _build("MemoryEfficientTrainer", 4, dropout=0.0, fsdp=True),
                    _build("Trainer", 2, dropout=0.0, fsdp=True)):
        losses, weights = _steps(trainer)
        np.testing.assert_allclose(losses, one[0], rtol=1e-5)
        assert_trees_close(weights, one[1], rtol=1e-5, atol=1e-5)


def _lsh(**kwargs):
    """LSH attention with 3 chunks of 4 over the 12 positions, two rounds."""
    return functools.partial(tl.LSHCausalAttention, chunk_len=4, n_hashes=2, **kwargs)


def test_lsh_attention_gives_the_same_steps_in_all_three_trainers_with_dropout():
    """The rotations and dropout masks come from the layer's key, so the reversible
    trainers' recomputation hashes and drops as the Trainer's one program does (on 4
    devices: inside shard_map)."""
    reference = _steps(_build("Trainer", 4, attention=_lsh()))
    assert reference[0][1] < reference[0][0]
    for name in ("ReversibleSerialTrainer", "MemoryEfficientTrainer"):
        losses, weights = _steps(_build(name, 4, attention=_lsh()))
        np.testing.assert_allclose(losses, reference[0], rtol=1e-5, err_msg=name)
        assert_trees_close(weights, reference[1], rtol=1e-5, atol=1e-5)


def test_lsh_with_a_hash_seed_does_not_depend_on_the_device_count_or_fsdp():
    one = _steps(_build("ReversibleSerialTrainer", 1, dropout=0.0,
                        attention=_lsh(hash_seed=3)))
    for trainer in (_build("ReversibleSerialTrainer", 4, dropout=0.0,
                           attention=_lsh(hash_seed=3)),
                    _build("MemoryEfficientTrainer", 2, dropout=0.0, fsdp=True,
                           attention=_lsh(hash_seed=3))):
        losses, weights = _steps(trainer)
        np.testing.assert_allclose(losses, one[0], rtol=1e-5)
        assert_trees_close(weights, one[1], rtol=1e-5, atol=1e-5)


WIDTHS = {"d_attention_key": 6, "d_attention_value": 2}  # d_model 8, 2 heads: default 4


@pytest.mark.parametrize("kind", ["blockwise", "lsh"])
def test_the_trainers_agree_at_trax_per_head_widths(kind):
    """Non-default ``d_attention_key`` / ``d_attention_value`` through all three trainers,
    dropout included; blockwise attention against the full-path Trainer."""
    if kind == "lsh":
        reference = _steps(_build("Trainer", 1, attention=_lsh(**WIDTHS)))
        attention = _lsh(**WIDTHS)
    else:
        reference = _steps(_build("Trainer", 1, attention=functools.partial(
            tl.CausalAttention, implementation="xla", **WIDTHS)))
        attention = functools.partial(tl.CausalAttention, implementation="blockwise",
                                      block_size=8, **WIDTHS)
    assert reference[0][1] < reference[0][0]
    for name in TRAINERS:
        losses, weights = _steps(_build(name, 1, attention=attention))
        np.testing.assert_allclose(losses, reference[0], rtol=1e-5, err_msg=name)
        assert_trees_close(weights, reference[1], rtol=1e-5, atol=1e-5)
    shapes = {w.shape for w in jax.tree.leaves(weights)}
    assert (8, 12) in shapes and (8, 4) in shapes and (4, 8) in shapes


def test_no_recompilation_after_the_first_step():
    trainer = _build("ReversibleSerialTrainer", 2)
    _steps(trainer, n=1)
    counts = trainer.trace_counts()
    assert set(counts.values()) == {1}
    _steps(trainer, n=3, seed=5)
    assert trainer.trace_counts() == counts


def test_a_full_path_train_state_restores_into_a_blockwise_trainer():
    full = _build("ReversibleSerialTrainer", 1, implementation="xla")
    _steps(full, n=1)
    blockwise = _build("ReversibleSerialTrainer", 1, implementation="blockwise")
    blockwise.restore(full.train_state)
    losses_full, weights_full = _steps(full, n=1, seed=3)
    losses_block, weights_block = _steps(blockwise, n=1, seed=3)
    np.testing.assert_allclose(losses_block, losses_full, rtol=1e-5)
    assert_trees_close(weights_block, weights_full, rtol=1e-5, atol=1e-5)


def test_the_ledger_counts_what_the_attention_vjp_saves():
    """Trainer's one program differentiates the model: what blockwise attention keeps for
    its backward pass (each layer's input; one head's q, k, v, output and log-sum-exp at a
    time) are temporaries of that program, which the ledger adds to the live arrays; and
    no length x length buffer is among them."""
    length = 1024
    blocks, loss = _model("blockwise", 0.0, ff_chunk_size=None, length=length, n_layers=2)
    trainer = Trainer(tl.Serial(tl.blocks_to_layers(blocks, loss)), _adam)
    tokens = np.zeros((BATCH, length), np.int32)
    batch = (tokens, tokens, np.ones((BATCH, length), np.float32))
    trainer.one_step(batch, jax.random.key(0))
    ledger = memory.MemoryLedger(jax.local_devices()[0])
    trainer.observers.append(ledger)
    trainer.one_step(batch, jax.random.key(1))
    trainer.block_until_ready()
    [entry] = [e for e in ledger.entries if e.fn_bytes]
    one_head = 4 * BATCH * length * 4 * 4  # q, k, v, out of one head (d_head 4), float32
    layer_inputs = 2 * 2 * BATCH * length * 8 * 4  # two streams per layer, float32
    assert entry.fn_bytes > one_head + layer_inputs
    square = BATCH * 2 * length * length * 4  # one layer's probabilities, full path
    assert entry.total_bytes < square / 4
