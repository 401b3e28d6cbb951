"""Train a model whose weights do not fit a device-memory budget with MemoryEfficientTrainer.

`MemoryEfficientTrainer` keeps every layer's weights and optimizer slots in host memory
and puts one layer's (plus ``n_async_layers`` prefetched ones) on the accelerator at a
time; reversible layers mean no activations are stored across the model either. So the
device holds about one layer, whatever the depth.

The script states a budget (``--budget_mib``), builds a deep reversible Transformer LM
whose float32 weights alone exceed it, trains a few steps, and measures the peak device
bytes of those steps with `revtrain.memory.track_peak`:

* on GPU/TPU the allocator's high-water mark (``memory_stats``; it counts from process
  start, so the model is initialised in host memory, never on the device);
* on CPU, which keeps no allocator statistics, a ledger of the live device arrays plus
  each compiled program's temporaries at every dispatch of the trainer (a lower bound:
  allocator fragmentation is not counted). "Device" memory is host RAM there, so the
  check is about what the trainer keeps as device arrays, not the process's RSS.

It asserts ``weights > budget >= peak`` and prints the three figures.

Run: ``python examples/memory_efficient.py`` (a 24-layer, d_model 512 model: 0.28 GiB
of weights, 0.85 GiB with Adam's slots, against a 128 MiB budget; minutes on a CPU).
``--tiny`` runs a 16-layer, d_model 32 model (0.6 MiB of weights) against 0.5 MiB.
"""

import argparse

import jax
import numpy as np
import optax

from revtrain import memory
from revtrain.data import TextFiles
from revtrain.layers import CrossEntropyLoss
from revtrain.models import ReversibleTransformerLM
from revtrain.trainers import MemoryEfficientTrainer
from revtrain.training import RunConfig, build_model, build_trainer

MiB = 2**20


def build(tiny: bool):
    """An initialised model (values in host memory) and its batches."""
    sizes = (dict(d_model=32, d_ff=64, n_layers=16, n_heads=2, max_len=16) if tiny else
             dict(d_model=512, d_ff=2048, n_layers=24, n_heads=8, max_len=128))
    inputs = TextFiles(sequence_length=sizes["max_len"], batch_size=2 if tiny else 8)
    run = RunConfig(model=lambda mode: ReversibleTransformerLM(
        vocab_size=256, dropout=0.0, mode=mode, **sizes), inputs=inputs,
        loss=CrossEntropyLoss)
    # Initialise in host memory: on a GPU the full model never touches the device.
    with jax.default_device(jax.devices("cpu")[0]):
        built = build_model(run, inputs)
    # The layer objects keep their initial values; as numpy copies they are host memory
    # on every backend (on CPU a jax array is device memory, and np.asarray of one is a
    # view of its buffer, not a copy).
    for layer in (built.model, built.loss):
        layer.weights = jax.tree.map(np.array, layer.weights)
        layer.state = jax.tree.map(np.array, layer.state)
    return built, inputs


def tree_bytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget_mib", type=float, default=None,
                        help="device-memory budget in MiB (default 128; 0.5 with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="default 3; 2 with --tiny")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (seconds, for CI)")
    args = parser.parse_args()
    steps = args.steps or (2 if args.tiny else 3)
    budget = int((args.budget_mib or (0.5 if args.tiny else 128)) * MiB)

    built, inputs = build(args.tiny)
    adam = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)  # noqa: E731
    # n_async_layers=1: one layer computes while the next one's weights are copied in.
    trainer = build_trainer(MemoryEfficientTrainer, built.model, built.loss, adam,
                            n_devices=1, n_async_layers=1)
    values = trainer.train_state  # Host (numpy) arrays between steps.
    weights, slots = tree_bytes(values.weights), tree_bytes(values.slots)
    print(f"budget {memory.format_bytes(budget)}; model weights {memory.format_bytes(weights)}"
          f" + optimizer slots {memory.format_bytes(slots)}, in host memory")
    assert weights > budget, "the model fits the budget: make it deeper or the budget smaller"

    stream = inputs.train_stream(start_step=0)
    losses = []
    with memory.track_peak(trainer) as report:  # Filled in when the block exits.
        for step in range(steps):
            loss, _ = trainer.one_step(next(stream), jax.random.key(step), step=step)
            losses.append(float(loss))
            print(f"step {step + 1} loss {losses[-1]:.4f}")
    print(f"peak device bytes during training: {memory.format_bytes(report.peak_bytes)} "
          f"({report.method}, at {report.peak_label}; before the steps "
          f"{memory.format_bytes(report.baseline_bytes)}); at most "
          f"{trainer.max_resident_layers} of {len(trainer.layers)} layers resident at once")
    assert np.isfinite(losses).all(), losses
    assert report.peak_bytes <= budget, (
        f"peak {report.peak_bytes} bytes exceeds the budget of {budget} bytes")
    print(f"weights {weights} bytes > budget {budget} bytes >= peak {report.peak_bytes} bytes")


if __name__ == "__main__":
    main()
