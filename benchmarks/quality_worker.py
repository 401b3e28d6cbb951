"""revtrain's side of `benchmarks/quality.py`: trains one configuration in a worker process.

`measure` builds the variant's model (`benchmarks.quality_variants.Spec`), its data (the
embedded corpus, the seed's batches), the optimizer equal to Trax's Adam with the variant's
settings, and trains it, evaluating the held-out bits per byte every ``eval_every`` steps.
`write_batches` writes a seed's batches for Trax's worker, so both sides see the same ones.
"""

from __future__ import annotations

import functools
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.quality_variants import VARIANTS, Spec, learning_rate, revtrain_optimizer


def seq_len(config: dict[str, Any], spec: Spec) -> int:
    return config["long_seq_len"] if spec.length == "long" else config["seq_len"]


def batch_size(config: dict[str, Any], spec: Spec) -> int:
    """The long configurations see as many tokens per step as the short ones."""
    if spec.length != "long":
        return config["batch_size"]
    return max(1, config["batch_size"] * config["seq_len"] // config["long_seq_len"])


def model_fn(config: dict[str, Any], spec: Spec, vocab_size: int, d_ff: int | None = None
             ) -> Any:
    """The variant's model factory (``mode=`` is left to the caller)."""
    from revtrain import layers as tl
    from revtrain.models import ReversibleTransformerLM, TransformerLM

    cls = ReversibleTransformerLM if spec.model == "reversible" else TransformerLM
    attention = tl.CausalAttention
    if spec.n_hashes:
        attention = functools.partial(
            tl.LSHCausalAttention, chunk_len=config["chunk_len"], n_hashes=spec.n_hashes,
            n_buckets=2 * seq_len(config, spec) // config["chunk_len"])
    return functools.partial(
        cls, vocab_size=vocab_size, d_model=config["d_model"], d_ff=d_ff or config["d_ff"],
        n_layers=config["n_layers"], n_heads=config["n_heads"],
        max_len=seq_len(config, spec), dropout=0.0, attention_type=attention,
        ff_activation=tl.Relu, pos_type=spec.pos)


def n_params(make: Any, length: int) -> int:
    """Parameters of ``make(mode='train')``, counted from its abstract initialisation."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from revtrain.layers import ShapeDtype

    model = make(mode="train")
    shapes = jax.eval_shape(
        lambda: model.init(ShapeDtype((1, length), jnp.int32), rng=jax.random.key(0))[0])
    return sum(int(np.prod(w.shape)) for w in jax.tree.leaves(shapes))


def sized_d_ff(config: dict[str, Any], spec: Spec, vocab_size: int) -> int:
    """The plain model's ``d_ff`` whose parameter count is nearest the reversible model's
    (parameters are linear in ``d_ff``: two counts give the line)."""
    length = seq_len(config, spec)
    target = n_params(model_fn(config, VARIANTS["rev_reversible"], vocab_size), length)
    d_ff = config["d_ff"]
    at = n_params(model_fn(config, spec, vocab_size, d_ff), length)
    slope = n_params(model_fn(config, spec, vocab_size, d_ff + 1), length) - at
    return max(1, d_ff + round((target - at) / slope))


def inputs_for(config: dict[str, Any], spec: Spec) -> Any:
    """The seed's data: the embedded corpus, the last 5% held out; a SentencePiece model
    is trained on the train text only."""
    from revtrain.data import TextFiles, trained_sentencepiece

    tokenizer, length = None, seq_len(config, spec)
    if spec.tokens == "sentencepiece":
        with tempfile.TemporaryDirectory() as tmp:
            train_text = Path(tmp) / "train.txt"
            data = TextFiles(sequence_length=length, batch_size=1, process_index=0,
                             process_count=1)
            train_text.write_bytes(data.train_bytes.tobytes())
            tokenizer = trained_sentencepiece(config["sp_vocab_size"], paths=[train_text])
    return TextFiles(sequence_length=length, batch_size=batch_size(config, spec),
                     seed=config["seed"], tokenizer=tokenizer, process_index=0,
                     process_count=1)


def write_batches(config: dict[str, Any], path: Path) -> None:
    """The train batches of steps ``0 .. steps - 1`` and the eval pass, as ``.npz``, for
    Trax's worker (``config['variant']`` sets the length)."""
    import numpy as np

    inputs = inputs_for(config, VARIANTS[config["variant"]])
    train = list(itertools.islice(inputs.train_stream(0), config["steps"]))
    evals = list(inputs.eval_pass())
    np.savez(path, train_inputs=np.stack([b[0] for b in train]),
             train_targets=np.stack([b[1] for b in train]),
             eval_inputs=np.stack([b[0] for b in evals]),
             eval_targets=np.stack([b[1] for b in evals]),
             eval_weights=np.stack([b[2] for b in evals]))


def load_initial_weights(built: Any, path: str) -> None:
    """Puts Trax's initial weights (``.npz`` of its leaves, in tree order) into the flat
    layers of ``built``.

    Raises:
      ValueError: when the leaves' shapes differ from revtrain's model (another size or
        position table), naming the first difference.
    """
    import jax
    import numpy as np

    data = np.load(path)
    theirs = [data[f"arr_{i}"] for i in range(len(data.files))]
    ours, treedef = jax.tree.flatten(built.initial_values()["weights"])
    shapes = ([tuple(w.shape) for w in ours], [tuple(w.shape) for w in theirs])
    if shapes[0] != shapes[1]:
        first = next((i for i, (a, b) in enumerate(zip(*shapes, strict=False))
                      if a != b),
                     min(map(len, shapes)))
        raise ValueError(f"Trax's initial weights do not fit: {len(theirs)} leaves vs "
                         f"{len(ours)}, first difference at leaf {first}")
    values = jax.tree.unflatten(treedef, [np.asarray(w, np.float32) for w in theirs])
    for layer, weights in zip(built.flat_layers, values, strict=True):
        layer.weights = jax.tree.map(jax.numpy.asarray, weights)


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """Trains one configuration for ``steps`` steps; the eval curve, times and memory."""
    import jax
    import numpy as np

    from revtrain import layers as tl
    from revtrain import memory
    from revtrain.trainers import MemoryEfficientTrainer, ReversibleSerialTrainer, Trainer
    from revtrain.training import RunConfig
    from revtrain.training.builder import build_evaluator, build_model, build_trainer

    spec = VARIANTS[config["variant"]]
    inputs = inputs_for(config, spec)
    d_ff = (sized_d_ff(config, spec, inputs.vocab_size) if spec.model == "plain_sized"
            else config["d_ff"])
    trainer_class = {"trainer": Trainer, "reversible": ReversibleSerialTrainer,
                     "memory_efficient": MemoryEfficientTrainer}[spec.trainer]
    peak, warmup = config["learning_rate"], config["schedule_warmup"]
    optimizer = functools.partial(revtrain_optimizer, spec, peak, seq_len(config, spec))
    run = RunConfig(model=model_fn(config, spec, inputs.vocab_size, d_ff), inputs=inputs,
                    trainer_class=trainer_class, loss=tl.CrossEntropyLoss,
                    optimizer=optimizer, schedule=peak, seed=config["seed"], n_devices=1)
    built = build_model(run, inputs)
    if spec.init == "trax":
        load_initial_weights(built, config["init_path"])
    trainer = build_trainer(trainer_class, built.model, built.loss, optimizer, 1)
    evaluator = build_evaluator(run, built, inputs)
    count = sum(int(np.size(w)) for w in jax.tree.leaves(built.initial_values()["weights"]))
    rng, stream = jax.random.key(config["seed"]), inputs.train_stream(0)
    curve, losses, train_s = [], [], 0.0
    with memory.track_peak(trainer) as tracked:
        for step in range(config["steps"]):
            rate = learning_rate(spec.schedule, step, peak, warmup)
            start = time.perf_counter()
            loss, _ = trainer.one_step(next(stream), jax.random.fold_in(rng, step),
                                       step=step, learning_rate=rate)
            losses.append(float(loss))  # Waits for the step.
            train_s += time.perf_counter() - start
            if (step + 1) % config["eval_every"] == 0 or step + 1 == config["steps"]:
                values = (built.nest(trainer.host_values("weights")),
                          built.nest(trainer.host_values("state")))
                metrics = evaluator.evaluate(*values, inputs.eval_pass())
                curve.append({"step": step + 1, "loss": metrics["loss"],
                              "bits_per_byte": metrics["bits_per_byte"], "train_s": train_s})
    return {"curve": curve, "train_losses": losses, "train_s": train_s,
            "bits_per_byte": curve[-1]["bits_per_byte"], "n_params": count,
            "d_ff_used": d_ff, "vocab_size": inputs.vocab_size, "method": tracked.method,
            "peak_bytes": tracked.peak_bytes, "peak_rss_bytes": tracked.peak_rss_bytes,
            "bytes_per_token": len(inputs.eval_bytes) / len(inputs.eval_tokens)}
