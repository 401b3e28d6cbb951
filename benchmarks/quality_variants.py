"""The configurations of `benchmarks/quality.py`: what each one trains, and the ablation.

A configuration (a *variant*) is a `Spec`: one setting per factor. Every factor defaults to
revtrain's setting (`BASE`), so a variant names only what it changes; an ablation row
changes one factor at a time. Both sides train on the same batches; revtrain's side is
`benchmarks.quality`'s worker, Trax 1.4.1's side `benchmarks/trax_quality_worker.py`.

Facts about Trax 1.4.1 used here (read from its sources, ``trax/optimizers/adam.py``,
``trax/optimizers/base.py``, ``trax/layers/attention.py``,
``trax/layers/research/position_encodings.py``, ``trax/supervised/lr_schedules.py``):

* ``optimizers.Adam`` defaults: ``learning_rate`` 1e-4, ``b1`` 0.9, ``b2`` 0.999, ``eps``
  1e-5 (optax: 1e-8), ``weight_decay_rate`` 1e-5 applied as ``(1 - rate) * w`` on every
  step, not scaled by the learning rate, and ``clip_grad_norm`` None (no clipping);
* ``ReformerLM``'s default positions (``pos_type=None``) are ``tl.PositionalEncoding``,
  whose ``[max_len, d_model]`` table is a weight initialised with the sinusoids and
  trained. Its only fixed table, ``pos_type='sin-cos'``, concatenates the sines and
  cosines and, in training, starts at a random offset half of the time, so Trax cannot
  run revtrain's fixed table: that factor is measured on revtrain's side only;
* ``multifactor``, the default schedule of Trax's training loop, is ``0.1 *
  min(1, step / 400) / sqrt(max(step, 400))`` (linear warmup, then reciprocal square
  root decay);
* ``CrossEntropyLoss`` is a weighted mean over tokens (``sum(loss * w) / sum(w)``), as
  revtrain's;
* ``trainer_lib.train`` defaults to ``Adafactor`` with ``multifactor``; this benchmark
  drives Trax's ``ReversibleSerialTrainer`` directly with ``Adam``, which, as revtrain's
  block trainers, builds one optimizer per layer (``optimizers/trainer.py``), so
  clipping bounds each layer's gradient norm on both sides.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class Spec:
    """One configuration's setting of every factor.

    Attributes:
      label: the row's name in the tables.
      framework: ``'revtrain'`` or ``'trax'``.
      model: ``'reversible'``, ``'plain'`` (equal width) or ``'plain_sized'`` (the plain
        model's ``d_ff`` chosen so that its parameters match the reversible model's).
      trainer: ``'trainer'``, ``'reversible'`` or ``'memory_efficient'`` (revtrain's).
      n_hashes: 0 for exact attention, else LSH attention with that many hashes.
      length: ``'short'`` (``--seq_len``) or ``'long'`` (``--long_seq_len``, where LSH
        chunks do not cover the sequence).
      tokens: ``'bytes'`` or ``'sentencepiece'``.
      pos: ``'sinusoidal'`` (fixed) or ``'trained'`` (Trax's default).
      init: ``'own'`` or ``'trax'`` (revtrain starts from Trax's initial weights).
      eps: Adam's epsilon.
      weight_decay: decoupled decay per step, as Trax's (``w <- (1 - rate) * w - ...``).
      clip: global gradient norm clipped to this value; None for no clipping.
      schedule: ``'constant'`` or ``'warmup_rsqrt'`` (Trax's ``multifactor`` shape,
        scaled so that its peak is ``--learning_rate``).
      loss: ``'token'`` (mean over tokens) or ``'sequence'`` (summed over a sequence's
        positions, mean over the batch: the gradient ``seq_len`` times larger).
    """

    label: str
    framework: str = "revtrain"
    model: str = "reversible"
    trainer: str = "reversible"
    n_hashes: int = 0
    length: str = "short"
    tokens: str = "bytes"
    pos: str = "sinusoidal"
    init: str = "own"
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip: float | None = None
    schedule: str = "constant"
    loss: str = "token"


TRAX_EPS, TRAX_WEIGHT_DECAY, CLIP = 1e-5, 1e-5, 1.0
TRAX_DEFAULTS = {"pos": "trained", "eps": TRAX_EPS, "weight_decay": TRAX_WEIGHT_DECAY}


def _lsh(n: int, framework: str = "revtrain", **kw: Any) -> Spec:
    name = "Trax ReformerLM LSH" if framework == "trax" else "LSH"
    return Spec(f"{name}-{n}", framework=framework, n_hashes=n, length="long", **kw)


MAIN = {
    "plain": Spec("TransformerLM, equal width", model="plain", trainer="trainer"),
    "plain_params": Spec("TransformerLM, equal parameters", model="plain_sized",
                         trainer="trainer"),
    "rev_trainer": Spec("Reversible + Trainer", trainer="trainer"),
    "rev_reversible": Spec("Reversible + ReversibleSerialTrainer"),
    "rev_memory_efficient": Spec("Reversible + MemoryEfficientTrainer",
                                 trainer="memory_efficient"),
    "exact_long": Spec("Reversible, exact attention (long)", length="long"),
    **{f"lsh{n}": _lsh(n) for n in (1, 2, 4, 8)},
    "sentencepiece": Spec("SentencePiece + ReversibleSerialTrainer", tokens="sentencepiece"),
    # rev_reversible again, run alone in SentencePiece's invocation: its equal-wall-time
    # reference. A row of its own, so that invocation never replaces the main group's
    # rows with rows of other code (a change of numerics moves a seed by ~0.005 bits/byte).
    "bytes_alone": Spec("Bytes + ReversibleSerialTrainer, alone (SentencePiece's "
                        "reference)"),
}
ABLATION = {
    "abl_pos_trained": Spec("revtrain, trained positions", pos="trained"),
    "abl_init_trax": Spec("revtrain, trained positions, Trax's initial weights",
                          pos="trained", init="trax"),
    "abl_eps": Spec("revtrain, Adam eps 1e-5", eps=TRAX_EPS),
    "abl_weight_decay": Spec("revtrain, weight decay 1e-5", weight_decay=TRAX_WEIGHT_DECAY),
    "abl_clip": Spec("revtrain, clip norm 1", clip=CLIP),
    "abl_schedule": Spec("revtrain, warmup + rsqrt decay", schedule="warmup_rsqrt"),
    "abl_loss_sequence": Spec("revtrain, loss summed per sequence", loss="sequence"),
    "abl_trax_defaults": Spec("revtrain, Trax's defaults", **TRAX_DEFAULTS),
    # At 512 tokens: Trax's LSH rows train a [long_seq_len, d_model] table.
    "abl_long_pos_trained": Spec("Reversible, exact attention (long), trained positions",
                                 length="long", pos="trained"),
    "abl_lsh8_pos_trained": Spec("LSH-8, trained positions", n_hashes=8, length="long",
                                 pos="trained"),
}
# Trax's positions are always trained (see the module docstring).
TRAX = {
    "trax_full": Spec("Trax ReformerLM full", framework="trax", pos="trained"),
    "trax_eps": Spec("Trax, Adam eps 1e-5", framework="trax", pos="trained", eps=TRAX_EPS),
    "trax_weight_decay": Spec("Trax, weight decay 1e-5", framework="trax", pos="trained",
                              weight_decay=TRAX_WEIGHT_DECAY),
    "trax_clip": Spec("Trax, clip norm 1", framework="trax", pos="trained", clip=CLIP),
    "trax_schedule": Spec("Trax, warmup + rsqrt decay", framework="trax", pos="trained",
                          schedule="warmup_rsqrt"),
    "trax_loss_sequence": Spec("Trax, loss summed per sequence", framework="trax",
                               pos="trained", loss="sequence"),
    "trax_defaults": Spec("Trax, Trax's defaults", framework="trax", **TRAX_DEFAULTS),
    **{f"trax_lsh{n}": _lsh(n, "trax", pos="trained") for n in (1, 2, 4, 8)},
}
VARIANTS: dict[str, Spec] = {**MAIN, **ABLATION, **TRAX}
REVTRAIN_VARIANTS = [v for v, s in VARIANTS.items() if s.framework == "revtrain"]
# The default run: every revtrain configuration that needs no Trax.
DEFAULT_VARIANTS = [v for v in REVTRAIN_VARIANTS if VARIANTS[v].init == "own"]

# The --update invocations of a full run (the commands in benchmarks/quality.py).
GROUPS = {
    "main": ["plain", "plain_params", "rev_trainer", "rev_reversible",
             "rev_memory_efficient"],
    "lsh": ["exact_long", "lsh1", "lsh2", "lsh4", "lsh8"],
    "tokenizer": ["bytes_alone", "sentencepiece"],
    "ablation": [v for v in ABLATION if ABLATION[v].init == "own"],
    "trax_ablation": ["abl_init_trax", *[v for v in TRAX if not TRAX[v].n_hashes]],
    "trax_lsh": [v for v in TRAX if TRAX[v].n_hashes],
}

# One row of the ablation table: (factor, revtrain row, its reference, Trax row, its
# reference, what cannot be matched). A None row: Trax cannot change that factor.
FACTORS = [
    ("positions: trained table (Trax) vs fixed sinusoids", "abl_pos_trained",
     "rev_reversible", None, None, "Trax has no fixed table at offset 0 (its 'sin-cos' "
     "adds random offsets in training)"),
    ("initialisation: Trax's initial weights", "abl_init_trax", "abl_pos_trained", None,
     None, "same initialiser families on both sides; only the random draws differ"),
    ("Adam epsilon 1e-5 (Trax) vs 1e-8 (optax)", "abl_eps", "rev_reversible", "trax_eps",
     "trax_full", ""),
    ("weight decay 1e-5 per step (Trax's default) vs none", "abl_weight_decay",
     "rev_reversible", "trax_weight_decay", "trax_full", ""),
    ("gradient clipping at norm 1 (neither clips by default)", "abl_clip", "rev_reversible",
     "trax_clip", "trax_full", "none: both block trainers keep one optimizer per layer, "
     "so each clips one layer's gradients"),
    ("schedule: warmup + rsqrt decay vs constant", "abl_schedule", "rev_reversible",
     "trax_schedule", "trax_full", ""),
    ("loss summed per sequence vs mean per token", "abl_loss_sequence", "rev_reversible",
     "trax_loss_sequence", "trax_full", ""),
    ("Trax's defaults together (trained positions, eps, decay)", "abl_trax_defaults",
     "rev_reversible", "trax_defaults", "trax_full", ""),
    ("positions at 512 tokens, exact attention: trained table vs fixed sinusoids",
     "abl_long_pos_trained", "exact_long", None, None, "as at 128 tokens"),
    ("positions at 512 tokens, LSH-8: trained table vs fixed sinusoids",
     "abl_lsh8_pos_trained", "lsh8", None, None, "as at 128 tokens"),
]
# (Trax row, revtrain's row matched with it, what still differs).
TRAX_MATCH = [("trax_full", "abl_init_trax", "same initial weights"),
              ("trax_full", "abl_pos_trained", "matched but the random draws"),
              ("trax_lsh8", "abl_lsh8_pos_trained", "matched but the random draws and "
               "revtrain's LSH projection biases"),
              *((f"trax_lsh{n}", f"lsh{n}", "positions differ (trained in Trax)")
                for n in (1, 2, 4, 8))]
# Rows that exist only to measure one factor of the ablation (and SentencePiece's byte
# reference, a rerun of rev_reversible): the ablation table gives their differences; the
# README's table leaves them out (`summary_variants`). Trax's full and LSH-8 rows stay,
# and so does revtrain's row matched with each most closely (the same positions, and at
# 128 tokens the same initial weights): without them the README would set Trax's trained
# position table beside revtrain's sinusoids.
SHOWN_MATCHES = ("abl_init_trax", "abl_lsh8_pos_trained")
ABLATION_ONLY = frozenset([*(v for v in ABLATION if v not in SHOWN_MATCHES),
                           *(v for v, spec in TRAX.items()
                             if v != "trax_full" and not spec.n_hashes), "bytes_alone"])


def needs_trax(variant: str) -> bool:
    """Whether a configuration needs ``--trax_python`` (Trax's rows and Trax's init)."""
    spec = VARIANTS[variant]
    return spec.framework == "trax" or spec.init == "trax"


def learning_rate(schedule: str, step: int, peak: float, warmup: int) -> float:
    """The rate of ``step`` (0-based): ``peak``, or Trax's ``multifactor`` shape
    (linear warmup over ``warmup`` steps, then ``1 / sqrt(step)`` decay) peaking at
    ``peak``. Both frameworks get this rate at every step."""
    if schedule == "constant":
        return peak
    if schedule != "warmup_rsqrt":
        raise ValueError(f"schedule={schedule!r} is not 'constant' or 'warmup_rsqrt'")
    t = step + 1  # Trax's rate is 0 at step 0; one step later keeps the first update.
    return peak * min(1.0, t / warmup) * math.sqrt(warmup / max(t, warmup))


def revtrain_optimizer(spec: Spec, rate: float, seq_len: int) -> Any:
    """An optax optimizer equal to Trax's Adam with ``spec``'s settings, with an injectable
    ``learning_rate``: a ``'sequence'`` loss scales the gradient by ``seq_len`` (the same
    as scaling the loss), then clipping, Adam, the rate, and Trax's decoupled decay
    ``(1 - weight_decay) * w`` (not scaled by the rate)."""
    import optax

    def make(learning_rate):
        parts = [optax.scale(float(seq_len))] if spec.loss == "sequence" else []
        if spec.clip is not None:
            parts.append(optax.clip_by_global_norm(spec.clip))
        parts += [optax.scale_by_adam(b1=0.9, b2=0.999, eps=spec.eps),
                  optax.scale_by_learning_rate(learning_rate)]
        if spec.weight_decay:
            parts.append(optax.add_decayed_weights(-spec.weight_decay))
        return optax.chain(*parts)

    return optax.inject_hyperparams(make)(learning_rate=rate)


def check_variants(names: list[str]) -> list[str]:
    """The unknown names in ``names`` (an empty list when all are known)."""
    return [n for n in names if n not in VARIANTS]
