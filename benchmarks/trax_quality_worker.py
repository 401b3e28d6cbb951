"""Trax's side of ``benchmarks/quality.py``: trains Trax 1.4.1's ReformerLM on given batches.

Run by a Python with Trax 1.4.1 (``../shared/peers/trax/install.sh``), never by revtrain's;
it imports neither revtrain nor JAX-using code of the ``benchmarks`` package (only
`benchmarks.quality_variants`' schedule, plain Python)::

    /tmp/traxenv/bin/python benchmarks/trax_quality_worker.py CONFIG_JSON BATCHES_NPZ \
        [--dump_init WEIGHTS_NPZ]

``BATCHES_NPZ`` holds the train batches revtrain's runs of the same seed see
(``train_inputs``/``train_targets`` int32 ``[steps, batch, length]``: ``inputs = window[:-1]``,
``targets = window[1:]``) and the held-out eval pass (``eval_inputs``/``eval_targets``/
``eval_weights``, ``[n, batch, length]``), written by ``quality.py``.

The model is ``ReformerLM`` (ReLU, dropout 0, per-head key and value width ``d_model //
n_heads``, ``CausalAttention`` or ``LSHSelfAttention`` with ``n_buckets = 2 * length /
chunk_len``; its default, trained position table) *without its first layer*,
``ShiftRight``: the batches are already shifted, and shifting them again would make Trax
predict the byte after next (the first results file did so). Then ``LogSoftmax`` and
``CrossEntropyLoss`` (times the length for ``spec.loss == 'sequence'``), trained by
Trax's ``ReversibleSerialTrainer`` with ``optimizers.Adam`` (``b1`` 0.9, ``b2`` 0.999,
``spec.eps``, ``weight_decay_rate = spec.weight_decay``, ``clip_grad_norm = spec.clip``)
at the rate of ``spec.schedule`` for every step.

Prints one JSON line: the eval curve (loss per token and bits per byte every
``eval_every`` steps), train losses, wall times, parameter count and peak RSS. With
``--dump_init``, writes the initial weights' leaves (tree order) to ``WEIGHTS_NPZ`` for
revtrain's ``abl_init_trax`` row instead of training, and prints ``{"leaves": n}``.
"""
import functools
import json
import math
import resource
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import trax  # noqa: E402
import trax.layers as tl  # noqa: E402
from absl import logging  # noqa: E402
from trax import fastmath, optimizers, shapes  # noqa: E402
from trax.optimizers import trainer as trainer_lib  # noqa: E402

from benchmarks.quality_variants import learning_rate  # noqa: E402

logging.set_verbosity(logging.WARNING)


def attention_type(config, length):
    n_hashes = config["spec"]["n_hashes"]
    if not n_hashes:
        return tl.CausalAttention
    return functools.partial(tl.LSHSelfAttention, chunk_len=config["chunk_len"],
                             n_hashes=n_hashes, n_buckets=2 * length // config["chunk_len"])


def model_without_shift(config, length):
    """ReformerLM less its leading ShiftRight (the batches are shifted), then LogSoftmax."""
    d, heads = config["d_model"], config["n_heads"]
    lm = trax.models.ReformerLM(
        config["vocab_size"], d_model=d, d_ff=config["d_ff"], n_layers=config["n_layers"],
        n_heads=heads, dropout=0.0, max_len=length,
        attention_type=attention_type(config, length), ff_activation=tl.Relu, mode="train",
        d_attention_key=d // heads, d_attention_value=d // heads)
    first, *rest = lm.sublayers  # ShiftRight(1), wrapped by Trax's shape assertions.
    names = [first.name, *(layer.name for layer in first.sublayers)]
    if not any(name.startswith("ShiftRight") for name in names):
        raise ValueError(f"ReformerLM's first layer is {names}, not ShiftRight")
    return tl.Serial(*rest, tl.LogSoftmax())


def loss_layer(config, length):
    if config["spec"]["loss"] == "sequence":  # Summed over a sequence, mean over the batch.
        return tl.Serial(tl.CrossEntropyLoss(), tl.Fn("TimesLength", lambda x: x * length))
    return tl.CrossEntropyLoss()


def eval_fn(model):
    """The held-out pass's jitted sums (negative log-likelihood, tokens), compiled once.

    One function for the whole run: a fresh ``jax.jit`` of a fresh closure per eval would
    compile again at every eval and bill Trax's side for the harness's compiles.
    """
    def nll_sums(weights, state, inputs, targets, mask, rng):
        log_probs, _ = model.pure_fn(inputs, weights, state, rng)
        token = -jax.numpy.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        return (token * mask).sum(), mask.sum()

    return jax.jit(nll_sums)


def eval_loss(model, fn, batches, rng):
    """Mean cross-entropy (nats per token) over the eval pass, weights as masks."""
    total, count = 0.0, 0.0
    for inputs, targets, mask in zip(*batches, strict=True):
        s, n = fn(model.weights, model.state, inputs, targets, mask, rng)
        total, count = total + float(s), count + float(n)
    return total / count


def main(config_json, batches_path, dump_init=None):
    config = json.loads(config_json)
    spec, data = config["spec"], np.load(batches_path)
    train_inputs, train_targets = data["train_inputs"], data["train_targets"]
    length = train_inputs.shape[-1]
    model = model_without_shift(config, length)
    ones = np.ones(train_inputs.shape[1:], np.float32)
    first = (train_inputs[0], train_targets[0], ones)
    blocks, loss = trainer_lib.extract_reversible_blocks([model, loss_layer(config, length)])
    trainer_lib.init_reversible_blocks(blocks, loss, shapes.signature(first),
                                       fastmath.random.get_prng(config["seed"]))
    leaves = jax.tree_util.tree_leaves(model.weights)
    if dump_init:
        np.savez(dump_init, *[np.asarray(w) for w in leaves])
        print(json.dumps({"leaves": len(leaves)}))
        return
    adam = functools.partial(optimizers.Adam, learning_rate=config["learning_rate"],
                             weight_decay_rate=spec["weight_decay"], b1=0.9, b2=0.999,
                             eps=spec["eps"], clip_grad_norm=spec["clip"])
    trainer = optimizers.ReversibleSerialTrainer(blocks, loss, adam)
    n_params = sum(int(np.size(w)) for w in leaves)
    eval_sets = (data["eval_inputs"], data["eval_targets"], data["eval_weights"])
    held_out = eval_fn(model)
    rng = fastmath.random.get_prng(config["seed"])
    curve, losses, train_s = [], [], 0.0
    for step in range(config["steps"]):
        rate = learning_rate(spec["schedule"], step, config["learning_rate"],
                             config["schedule_warmup"])
        start = time.perf_counter()
        batch = (train_inputs[step], train_targets[step], ones)
        value, _ = trainer.one_step(batch, jax.random.fold_in(rng, step), step=step,
                                    learning_rate=rate)
        losses.append(float(value))  # Waits for the step.
        train_s += time.perf_counter() - start
        if (step + 1) % config["eval_every"] == 0 or step + 1 == config["steps"]:
            nats = eval_loss(model, held_out, eval_sets, jax.random.fold_in(rng, 10 ** 6 + step))
            curve.append({"step": step + 1, "loss": nats,
                          "bits_per_byte": nats / math.log(2.0), "train_s": train_s})
    print(json.dumps({"curve": curve, "train_losses": losses, "train_s": train_s,
                      "n_params": n_params, "bits_per_byte": curve[-1]["bits_per_byte"],
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                      * 1024}))


if __name__ == "__main__":
    if len(sys.argv) not in (3, 5) or (len(sys.argv) == 5 and sys.argv[3] != "--dump_init"):
        sys.exit("usage: trax_quality_worker.py CONFIG_JSON BATCHES_NPZ [--dump_init NPZ]")
    main(sys.argv[1], sys.argv[2], sys.argv[4] if len(sys.argv) == 5 else None)
