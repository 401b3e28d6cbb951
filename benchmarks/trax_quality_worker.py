"""Trax's side of ``benchmarks/quality.py``: trains Trax 1.4.1's ReformerLM on given batches.

Run by a Python with Trax 1.4.1 (``../shared/peers/trax/install.sh``), never by revtrain's;
it imports neither revtrain nor the ``benchmarks`` package::

    /tmp/traxenv/bin/python benchmarks/trax_quality_worker.py CONFIG_JSON BATCHES_NPZ

``BATCHES_NPZ`` holds the train batches revtrain's runs of the same seed see
(``train_inputs``/``train_targets`` int32 ``[steps, batch, length]``) and the held-out eval
pass (``eval_inputs``/``eval_targets``/``eval_weights``, ``[n, batch, length]``), written by
``quality.py``. The model is ``ReformerLM`` (ReLU feed-forward, dropout 0, per-head key and
value width ``d_model // n_heads``, ``CausalAttention`` or ``LSHSelfAttention``) followed by
``LogSoftmax`` and ``CrossEntropyLoss``, trained by Trax's ``ReversibleSerialTrainer`` with
Adam (``b1`` 0.9, ``b2`` 0.999, ``eps`` 1e-8, no weight decay: optax's ``adam``) at a
constant rate. Prints one JSON line: the eval curve (loss per byte-token and bits per byte
every ``eval_every`` steps), train losses, wall times, parameter count and peak RSS.
"""
import functools
import json
import math
import resource
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import trax  # noqa: E402
import trax.layers as tl  # noqa: E402
from absl import logging  # noqa: E402
from trax import fastmath, optimizers, shapes  # noqa: E402
from trax.optimizers import trainer as trainer_lib  # noqa: E402

logging.set_verbosity(logging.WARNING)


def attention_type(config):
    if config["variant"] == "trax_full":
        return tl.CausalAttention
    n_hashes = int(config["variant"].rsplit("lsh", 1)[1])
    return functools.partial(tl.LSHSelfAttention, chunk_len=config["chunk_len"],
                             n_hashes=n_hashes, n_buckets=config["n_buckets"])


def eval_loss(model, batches, rng):
    """Mean cross-entropy (nats per token) over the eval pass, weights as masks."""
    def nll_sums(weights, state, inputs, targets, mask):
        log_probs, _ = model.pure_fn(inputs, weights, state, rng)
        token = -jax.numpy.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        return (token * mask).sum(), mask.sum()

    fn = jax.jit(nll_sums)
    total, count = 0.0, 0.0
    for inputs, targets, mask in zip(*batches, strict=True):
        s, n = fn(model.weights, model.state, inputs, targets, mask)
        total, count = total + float(s), count + float(n)
    return total / count


def main(config_json, batches_path):
    config = json.loads(config_json)
    data = np.load(batches_path)
    d, heads = config["d_model"], config["n_heads"]
    lm = trax.models.ReformerLM(
        config["vocab_size"], d_model=d, d_ff=config["d_ff"], n_layers=config["n_layers"],
        n_heads=heads, dropout=0.0, max_len=config["seq_len"],
        attention_type=attention_type(config), ff_activation=tl.Relu, mode="train",
        d_attention_key=d // heads, d_attention_value=d // heads)
    model = tl.Serial(lm, tl.LogSoftmax())
    train_inputs, train_targets = data["train_inputs"], data["train_targets"]
    ones = np.ones(train_inputs.shape[1:], np.float32)
    first = (train_inputs[0], train_targets[0], ones)
    blocks, loss_layer = trainer_lib.extract_reversible_blocks([model, tl.CrossEntropyLoss()])
    trainer_lib.init_reversible_blocks(blocks, loss_layer, shapes.signature(first),
                                       fastmath.random.get_prng(config["seed"]))
    adam = functools.partial(optimizers.Adam, learning_rate=config["learning_rate"],
                             weight_decay_rate=0.0, b1=0.9, b2=0.999, eps=1e-8)
    trainer = optimizers.ReversibleSerialTrainer(blocks, loss_layer, adam)
    n_params = sum(int(np.size(w)) for w in jax.tree_util.tree_leaves(model.weights))
    eval_sets = (data["eval_inputs"], data["eval_targets"], data["eval_weights"])
    rng = fastmath.random.get_prng(config["seed"])
    curve, losses, train_s = [], [], 0.0
    for step in range(config["steps"]):
        start = time.perf_counter()
        batch = (train_inputs[step], train_targets[step], ones)
        loss, _ = trainer.one_step(batch, jax.random.fold_in(rng, step), step=step,
                                   learning_rate=config["learning_rate"])
        losses.append(float(loss))  # Waits for the step.
        train_s += time.perf_counter() - start
        if (step + 1) % config["eval_every"] == 0 or step + 1 == config["steps"]:
            value = eval_loss(model, eval_sets, jax.random.fold_in(rng, 10 ** 6 + step))
            curve.append({"step": step + 1, "loss": value,
                          "bits_per_byte": value / math.log(2.0), "train_s": train_s})
    print(json.dumps({"curve": curve, "train_losses": losses, "train_s": train_s,
                      "n_params": n_params, "bits_per_byte": curve[-1]["bits_per_byte"],
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                      * 1024}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
