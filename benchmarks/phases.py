"""Where a step's time goes: per-phase seconds and dropout-mask generation alone.

`PhaseTimer` is a trainer observer (``on_phase`` / ``on_dispatch``, the public observer
protocol of `revtrain.trainers.common.protocols`): before each compiled-function dispatch it waits
for that call's inputs (``jax.block_until_ready``), so the time since the previous wait is
the device time of the work the call depends on, and it books that time to the phase the
step was in. Waiting serialises dispatches that would otherwise overlap, so phase times are
measured on extra steps, never on the timed ones, and add up to a little more than an
unprofiled step. The block trainers report ``forward`` (up to the loss layer), ``loss``
(the loss layer's forward-backward-optimizer call) and ``backward`` (reversing and
updating every layer); `Trainer` compiles its whole step as one program, so it reports
only ``step``.

`time_masks` times drawing every dropout mask of one forward pass of the benchmark's
reversible Transformer LM, alone: with `revtrain.layers.dropout_masks.keep_mask` (what
the layers use) and with ``jax.random.bernoulli`` (32 random bits per element, what they
used before) for comparison. The reversible trainers draw each mask twice per step (the
forward pass, then again when recomputing a layer's input in the backward pass).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

PHASES = ("forward", "loss", "backward", "step")
_NEXT_PHASE = {"loss_start": "loss", "backward_start": "backward"}


class PhaseTimer:
    """Observer booking device time to the phases of a step (module docstring)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._phase, self._next, self._last = "step", None, None

    def on_phase(self, label: str) -> None:
        if label == "step_start":
            self._phase, self._next, self._last = "step", None, time.perf_counter()
        elif label in _NEXT_PHASE:
            self._next = _NEXT_PHASE[label]

    def on_dispatch(self, label: str, fn: Any, args: tuple) -> None:
        del label, fn
        import jax
        jax.block_until_ready(args)
        self._book()
        if self._next is not None:
            self._phase, self._next = self._next, None

    def finish(self, outputs: Any) -> None:
        """Waits for the step's ``outputs`` and books the time to the last phase."""
        import jax
        jax.block_until_ready(outputs)
        self._book()

    def _book(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.seconds[self._phase] += now - self._last
        self._last = now


def profile_phases(trainer: Any, batch: tuple, steps: range) -> dict[str, float]:
    """Median seconds per phase over ``steps`` profiled steps (keys: those of `PHASES` seen).

    The first block-trainer dispatch's wait also holds the step's host-side preparation,
    which is booked to ``forward`` (the block trainers) or ``step`` (`Trainer`).
    """
    import jax
    per_step: dict[str, list[float]] = defaultdict(list)
    for step in steps:
        timer = PhaseTimer()
        trainer.observers.append(timer)
        try:
            timer.finish(trainer.one_step(batch, jax.random.key(step)))
        finally:
            trainer.observers.remove(timer)
        for phase, seconds in timer.seconds.items():
            if phase == "step" and len(timer.seconds) > 1:  # Block trainers: up to the loss.
                phase = "forward"
            per_step[phase].append(seconds)
    return {phase: statistics.median(v) for phase, v in per_step.items()}


def mask_sites(config: dict[str, Any]) -> list[tuple[tuple[int, ...], float]]:
    """``[(mask shape, rate)]`` of every dropout in one forward pass of the benchmark model.

    `revtrain.models.ReversibleTransformerLM`: embedding ``[batch, seq, d_model]``,
    positional encoding ``[seq, d_model]``, then per layer the attention probabilities
    ``[batch, n_heads, seq, seq]`` and the feed-forward's ``[batch, seq, d_ff]`` and
    ``[batch, seq, d_model]``.
    """
    b, s, d = config["batch_size"], config["seq_len"], config["d_model"]
    per_layer = [(b, config["n_heads"], s, s), (b, s, config["d_ff"]), (b, s, d)]
    rate = config["dropout"]
    return [((b, s, d), rate), ((s, d), rate)] + [(shape, rate) for shape in
                                                  per_layer * config["depth"]]


def time_masks(config: dict[str, Any], repeats: int = 3) -> dict[str, float]:
    """Median seconds to draw one forward pass's masks: ``{'mask_s', 'mask_bernoulli_s'}``
    (``mask_s`` with the config's ``mask_bits``, default 16).

    0.0 for both when the dropout rate is 0 (no masks are drawn).
    """
    import jax

    from revtrain.layers.dropout_masks import keep_mask

    sites = mask_sites(config)
    if config["dropout"] == 0.0:
        return {"mask_s": 0.0, "mask_bernoulli_s": 0.0}
    bits = config.get("mask_bits", 16)
    draws = {"mask_s": lambda key, shape, rate: keep_mask(key, shape, rate, bits),
             "mask_bernoulli_s": lambda key, shape, rate: jax.random.bernoulli(
                 key, 1.0 - rate, shape)}
    results = {}
    for name, draw in draws.items():
        @jax.jit
        def all_masks(key, draw=draw):
            keys = jax.random.split(key, len(sites))
            return [draw(keys[i], shape, rate) for i, (shape, rate) in enumerate(sites)]
        jax.block_until_ready(all_masks(jax.random.key(0)))
        times = []
        for k in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(all_masks(jax.random.key(k + 1)))
            times.append(time.perf_counter() - start)
        results[name] = statistics.median(times)
    return results
