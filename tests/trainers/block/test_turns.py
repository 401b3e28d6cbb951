"""Tests for revtrain.trainers.block.turns: random draws are counted once each, and the
scanned reverse runs a layer in turn (inside a conditional) only where its draws outweigh
the stack items a conditional would copy."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from revtrain import layers as tl
from revtrain.models import ReversibleTransformerLM
from revtrain.trainers import ReversibleSerialTrainer
from revtrain.trainers.block import scan_programs, turns


def test_random_draw_bytes_counts_each_draw_once_loops_included():
    def draws(key):
        a = jax.random.bits(key, (64, 32))  # 8 KiB of uint32.
        b = jax.lax.fori_loop(0, 5, lambda i, c: c + jax.random.bits(
            jax.random.fold_in(key, i), (16,), jnp.uint16).sum(), 0)  # 32 B, once.
        return a, b

    assert turns.random_draw_bytes(draws, jax.random.key(0)) == 64 * 32 * 4 + 16 * 2
    assert turns.random_draw_bytes(lambda x: x * 2, jnp.ones(3)) == 0


def _trainer_and_batch(length, dropout, d_model=16):
    attention = functools.partial(tl.CausalAttention, implementation="blockwise",
                                  block_size=min(length, 64))
    model = ReversibleTransformerLM(vocab_size=16, d_model=d_model, d_ff=2 * d_model,
                                    n_layers=2, n_heads=2, max_len=length, dropout=dropout,
                                    ff_chunk_size=min(length, 64), attention_type=attention)
    ids = np.arange(2 * length, dtype=np.int32).reshape(2, length) % 16
    batch = (ids, ids, np.ones(ids.shape, np.float32))
    signature = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in batch)
    blocks, loss = tl.extract_reversible_blocks([model, tl.CrossEntropyLoss()])
    tl.init_reversible_blocks(blocks, loss, signature, jax.random.key(0))
    return ReversibleSerialTrainer(blocks, loss, lambda: optax.sgd(0.1), n_devices=1), batch


def _decisions(monkeypatch, length, dropout):
    seen = []

    def spy(fn, carry, n_devices, *args):
        seen.append(turns.reverse_in_turn(fn, carry, n_devices, *args))
        return seen[-1]

    monkeypatch.setattr(scan_programs, "reverse_in_turn", spy)
    trainer, batch = _trainer_and_batch(length, dropout)
    loss, _ = trainer.one_step(batch, jax.random.key(1))
    assert np.isfinite(float(loss))
    return seen


def test_dropout_at_a_short_length_runs_its_attention_in_turn(monkeypatch):
    seen = _decisions(monkeypatch, length=128, dropout=0.1)
    # Reverse order per repetition: swap, feed-forward (chunked: one chunk's masks at a
    # time), swap, attention (its [batch, heads, length, length] masks outweigh the carry).
    assert seen[:4] == [False, False, False, True]


def test_without_dropout_no_layer_runs_in_turn(monkeypatch):
    seen = _decisions(monkeypatch, length=256, dropout=0.0)
    assert seen and not any(seen)


def _reverse_temp_bytes(monkeypatch, in_turn):
    if in_turn is not None:
        monkeypatch.setattr(scan_programs, "reverse_in_turn", lambda *a: in_turn)
    trainer, batch = _trainer_and_batch(2048, 0.0, d_model=64)
    programs = {}

    class Watch:
        def on_dispatch(self, label, fn, args):
            if label.startswith("backward/layers"):
                programs[label] = (fn, args)

    trainer.observers.append(Watch())
    trainer.one_step(batch, jax.random.key(1))
    ((fn, args),) = programs.values()
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(
        a, "sharding", None)) if hasattr(a, "shape") else a, tuple(args))
    return fn.lower(*abstract).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_a_long_sequences_scanned_reverse_does_not_copy_its_stack_items(monkeypatch):
    carry = 4 * 2 * 2048 * 64 * 4  # Two streams and their cotangents, float32.
    chosen = _reverse_temp_bytes(monkeypatch, None)
    monkeypatch.undo()
    everything_in_turn = _reverse_temp_bytes(monkeypatch, True)
    print(f"scanned reverse temporaries: {chosen / carry:.2f} carries as chosen, "
          f"{everything_in_turn / carry:.2f} with every layer in turn")
    assert everything_in_turn - chosen >= 0.5 * carry  # 0.71 here; 1.0 at 65,536 tokens.
