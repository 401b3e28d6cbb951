"""The long-context LM: exact blockwise attention (or LSH attention) on long byte windows.

Reformer's recipe (Kitaev et al., 2020), as in configs/reversible_lm_64k.gin and
configs/reformer_lm_64k.gin:

* reversible half-residuals: activation memory does not grow with depth;
* attention that never holds a ``length x length`` buffer: ``CausalAttention(
  implementation='blockwise')`` (exact: an online softmax over blocks of keys) or
  ``LSHCausalAttention`` (approximate: positions attend within chunks of similar keys);
* the feed-forward run over chunks of positions (``ff_chunk_size``) and the loss over
  chunks (``CrossEntropyLoss(n_chunks=...)``): no ``length x d_ff`` or ``length x vocab``
  buffer either;
* rotary positions: no position table of ``length`` rows.

The script first checks that blockwise attention gives the same outputs as full attention
(one attention layer, the same weights, at a length where full attention still fits), then
trains a few steps at ``--length`` with `ReversibleSerialTrainer` and reports the peak
device bytes of those steps (`revtrain.memory.track_peak`).

Run: ``python examples/long_context.py`` (65,536 bytes: minutes per step on 2 CPU cores;
``--attention=lsh`` about 15 s). ``--tiny`` runs 64 bytes in seconds.
"""

import argparse
import functools

import jax
import numpy as np

from revtrain import memory
from revtrain.data import TextFiles
from revtrain.layers import CausalAttention, CrossEntropyLoss, Gelu, LSHCausalAttention
from revtrain.models import ReversibleTransformerLM
from revtrain.trainers import ReversibleSerialTrainer
from revtrain.training import RunConfig, build_model, build_trainer, optimizer_fn


def attention(kind: str, block: int):
    """The ``attention_type`` of the model: a factory called with the model's sizes."""
    if kind == "lsh":  # n_buckets defaults to Reformer's 2 * length // chunk_len.
        return functools.partial(LSHCausalAttention, chunk_len=block, n_chunks_before=1,
                                 n_hashes=2)
    return functools.partial(CausalAttention, implementation=kind, block_size=block)


SIZES = dict(d_model=128, d_ff=512, n_heads=4)  # configs/reversible_lm_64k.gin
TINY_SIZES = dict(d_model=32, d_ff=64, n_heads=2)


def lm(kind: str, length: int, block: int, ff_chunk: int, sizes: dict):
    """``mode -> model`` of configs/reversible_lm_64k.gin, ``max_len`` set to ``length``."""
    return functools.partial(ReversibleTransformerLM, vocab_size=256, n_layers=2,
                             max_len=length, dropout=0.0, ff_activation=Gelu,
                             attention_type=attention(kind, block), ff_chunk_size=ff_chunk,
                             pos_type="rotary", **sizes)


def check_blockwise_is_exact(length: int, block: int, sizes: dict) -> None:
    """Blockwise and full ('xla') attention: the same function of the same weights."""
    blockwise = CausalAttention(sizes["d_model"], n_heads=sizes["n_heads"], mode="eval",
                                implementation="blockwise", block_size=block, rotary=True)
    full = CausalAttention(sizes["d_model"], n_heads=sizes["n_heads"], mode="eval",
                           implementation="xla", rotary=True)
    x = jax.random.normal(jax.random.key(0), (1, length, sizes["d_model"]))
    weights, state = blockwise.init(jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    rng=jax.random.key(1))
    out_blockwise, _ = jax.jit(blockwise.pure_fn)(x, weights, state, None)
    out_full, _ = jax.jit(full.pure_fn)(x, weights, state, None)
    difference = float(np.abs(np.asarray(out_blockwise) - np.asarray(out_full)).max())
    print(f"blockwise vs full attention at length {length}: outputs differ by at most "
          f"{difference:.1e} (of values up to {float(np.abs(np.asarray(out_full)).max()):.1f})")
    assert difference < 1e-4, difference


def train(kind: str, length: int, block: int, ff_chunk: int, sizes: dict,
          steps: int) -> None:
    # The embedded corpus has about 466 KB: eval_fraction 0.3 leaves whole eval windows
    # of 64K bytes (as in the 64K configs).
    inputs = TextFiles(sequence_length=length, batch_size=1, eval_fraction=0.3)
    run = RunConfig(model=lm(kind, length, block, ff_chunk, sizes), inputs=inputs,
                    loss=functools.partial(CrossEntropyLoss, n_chunks=max(1, length // 4096)))
    built = build_model(run, inputs)
    trainer = build_trainer(ReversibleSerialTrainer, built.model, built.loss,
                            functools.partial(optimizer_fn, "adam", learning_rate=2e-3,
                                              clip_gradient_norm=1.0), n_devices=1)
    stream = inputs.train_stream(start_step=0)
    losses = []
    with memory.track_peak(trainer) as report:
        for step in range(steps):
            loss, _ = trainer.one_step(next(stream), jax.random.key(step), step=step)
            losses.append(float(loss))
            print(f"step {step + 1} ({kind} attention, {length} bytes): loss {losses[-1]:.4f}")
    logits = 4 * sizes["n_heads"] * length * length  # float32 [heads, length, length]
    print(f"peak device bytes of the steps: {memory.format_bytes(report.peak_bytes)} "
          f"({report.method}); full attention's logits alone would take "
          f"{memory.format_bytes(logits)} per sequence")
    assert np.isfinite(losses).all(), losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", choices=["blockwise", "lsh"], default="blockwise")
    parser.add_argument("--length", type=int, default=None,
                        help="bytes per sequence (default 65536; 64 with --tiny)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (seconds, for CI)")
    args = parser.parse_args()
    length = args.length or (64 if args.tiny else 65536)
    # Attention blocks (LSH chunks) and feed-forward chunks: 512 and 4096 positions (128
    # for LSH) as in the 64K configs; 16 at tiny lengths, so several of each run.
    block = 16 if args.tiny else (128 if args.attention == "lsh" else 512)
    ff_chunk = 16 if args.tiny else 4096
    # Full attention holds length x length logits: compare at most 1,024 positions.
    sizes = TINY_SIZES if args.tiny else SIZES
    check_blockwise_is_exact(min(length, 1024), min(block, 64), sizes)
    train(args.attention, length, block, ff_chunk, sizes, args.steps)


if __name__ == "__main__":
    main()
