"""Reconstruction drift of reversal vs depth and precision, with and without ``keep_every``.

Usage (from the repository root, after ``pip install -e '.[bench]'``)::

    python benchmarks/reconstruction_drift.py            # depths 8,16,32,64 (issue 16)
    python benchmarks/reconstruction_drift.py --quick    # tiny sizes, seconds

For `revtrain.models.ReversibleTransformerLM` (default d_model 64, d_ff 128, 4 heads,
sequence 64, batch 4, dropout 0; float32 residual streams) at each depth, for each
``compute_dtype`` (float32, bfloat16) and each ``keep_every`` (None and the
``--keep_every_values``), it reports:

* the worst and median relative reconstruction error over the reversible layers
  (`revtrain.layers.reconstruction_error` with that ``keep_every``);
* the worst and median relative error ``||g - g_ref|| / ||g_ref||`` of each layer's weight
  gradient from `ReversibleSerialTrainer` (one step) against `Trainer`'s stored-activation
  gradient ``g_ref`` in the same precision (layers with a zero gradient, e.g. swaps, are
  skipped). Gradients are read exactly: the optimizer keeps the gradient as its state;
* the activation memory the kept copies cost: ``device_footprint().kept_bytes`` of that
  trainer (block inputs included) and the number of kept stack copies.

``--variants=round_inputs`` measures a cheaper remedy instead (issue 16): every
half-residual first rounds its input to bfloat16 (`round_to_bfloat16`), so that forward
and reverse see the same rounded value unless the reconstruction crossed a rounding
boundary. It changes the model (`Trainer` is given the same variant) and costs no memory.
``--merge`` adds the results to those already in the JSON.

``keep_every`` counts *flat* reversible layers: one model layer (attention + feed-forward)
is 4 of them (two half-residuals, two swaps), so ``keep_every=8`` keeps one copy per two
model layers. Runs in one process on one device. Writes ``reconstruction_drift.json``,
``.md`` and ``.png`` to ``--out_dir``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # Run as a script: make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import flags  # noqa: E402

from benchmarks import harness, report  # noqa: E402

flags.adopt_module_key_flags(harness)  # --help lists the shared flags.
flags.DEFINE_list("keep_every_values", ["4", "8", "16"], "keep_every values measured "
                  "besides None (flat reversible layers; 4 per model layer)")
flags.DEFINE_list("compute_dtypes", ["float32", "bfloat16"], "compute_dtype values")
flags.DEFINE_boolean("gradients", True, "also compare each layer's gradient with Trainer's")
flags.DEFINE_list("variants", ["plain"], "model variants: plain, round_inputs (each "
                  "half-residual rounds its input to bfloat16 first)")
flags.DEFINE_boolean("merge", False, "add the results to those in the existing JSON")

NAME = "reconstruction_drift"
DEFAULTS = {"depths": "8,16,32,64", "d_model": 64, "d_ff": 128, "n_heads": 4, "seq_len": 64,
            "batch_size": 4, "vocab_size": 256, "dropout": 0.0}
QUICK = {"depths": "2,4", "d_model": 16, "d_ff": 32, "n_heads": 2, "seq_len": 16,
         "batch_size": 2, "vocab_size": 32}
FLAGS = flags.FLAGS


def parse_flags(argv: Sequence[str] | None) -> Any:
    """The run's settings: the shared harness flags with this benchmark's defaults."""
    if argv is not None:
        FLAGS.unparse_flags()
        FLAGS([sys.argv[0], *argv])
    args = type("Args", (), {})()
    for name, value in FLAGS.flag_values_dict().items():
        setattr(args, name, value)
    for name, value in {**DEFAULTS, **(QUICK if args.quick else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    depths = args.depths.split(",") if isinstance(args.depths, str) else args.depths
    args.depths = [int(d) for d in depths]
    args.keep_every_values = [None] + [int(k) for k in args.keep_every_values]
    args.out_dir = Path(args.out_dir or (harness.QUICK_RESULTS_DIR if args.quick
                                         else harness.RESULTS_DIR))
    args.command = harness.command_line(argv)
    return args


def _gradient_recorder() -> Any:
    """An optax transformation whose state is the last gradient; it updates nothing."""
    import jax
    import jax.numpy as jnp
    import optax

    def update(grads, state, params=None):
        del state, params
        return jax.tree.map(jnp.zeros_like, grads), grads
    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


def round_to_bfloat16(x: Any) -> Any:
    """``x`` rounded to bfloat16 and cast back to its dtype (the cheaper remedy's layer)."""
    return x.astype("bfloat16").astype(x.dtype)


def _rounding_inputs(layer: Any) -> Any:
    """A half-residual like ``layer`` whose compute part starts by rounding to bfloat16."""
    from revtrain import layers as tl
    if not isinstance(layer, tl.ReversibleHalfResidual):
        return layer
    compute, attention = layer.sublayers
    return tl.ReversibleHalfResidual(
        tl.Fn("RoundToBfloat16", round_to_bfloat16), *compute.sublayers,
        attention_layer=None if isinstance(attention, tl.Select) else attention)


def _relative_errors(trees: Sequence[Any], reference: Sequence[Any]) -> list[float]:
    import jax
    import numpy as np
    errors = []
    for tree, ref in zip(trees, reference, strict=True):
        a, b = (np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in
                                jax.tree.leaves(t)] or [np.zeros(0)]) for t in (tree, ref))
        if np.linalg.norm(b) > 0:
            errors.append(float(np.linalg.norm(a - b) / np.linalg.norm(b)))
    return errors


def measure_depth(config: dict[str, Any], depth: int, dtype: str,
                  keep_every_values: Sequence[int | None], gradients: bool,
                  variant: str = "plain") -> list[dict]:
    """One result per ``keep_every`` for one depth, compute dtype and model variant."""
    import jax
    import numpy as np

    from revtrain import layers as tl
    from revtrain.trainers import ReversibleSerialTrainer, Trainer

    batch = harness.make_batch(config)

    def blocks():
        model = harness.model(config | {"depth": depth}, compute_dtype=dtype)
        made, loss = tl.extract_reversible_blocks([model, tl.CrossEntropyLoss()])
        if variant == "round_inputs":
            made = [(std, [_rounding_inputs(layer) for layer in revs]) for std, revs in made]
        tl.init_reversible_blocks(made, loss, batch, jax.random.key(config["seed"]))
        return made, loss

    def trained_gradients(trainer):
        trainer.one_step(batch, jax.random.key(config["seed"] + 1))
        return trainer.slots

    model_blocks = blocks()
    reference = None
    if gradients:
        whole = tl.fuse_loss_heads(tl.Serial(tl.blocks_to_layers(*blocks())))
        reference = trained_gradients(Trainer(whole, _gradient_recorder, n_devices=1))
    results = []
    for keep_every in keep_every_values:
        start = time.perf_counter()
        errors = tl.reconstruction_error(model_blocks, batch, jax.random.key(1), keep_every)
        trainer = ReversibleSerialTrainer(*blocks(), _gradient_recorder, n_devices=1,
                                          keep_every=keep_every)
        grads = trained_gradients(trainer)
        n_rev = len(errors)
        result = {"depth": depth, "compute_dtype": dtype, "keep_every": keep_every,
                  "variant": variant,
                  "worst_error": max(errors), "median_error": float(np.median(errors)),
                  "errors": errors, "kept_bytes": trainer.device_footprint().kept_bytes,
                  "kept_copies": 0 if keep_every is None else (n_rev - 1) // keep_every}
        if reference is not None:
            grad_errors = _relative_errors(grads, reference)
            result |= {"worst_gradient_error": max(grad_errors),
                       "median_gradient_error": float(np.median(grad_errors))}
        result["seconds"] = time.perf_counter() - start
        print(describe(result), flush=True)
        results.append(result)
    return results


def describe(r: dict[str, Any]) -> str:
    grads = (f", gradients worst {r['worst_gradient_error']:.2e}"
             if "worst_gradient_error" in r else "")
    return (f"depth {r['depth']} {r['compute_dtype']} {r['variant']} keep_every "
            f"{r['keep_every']}: "
            f"reconstruction worst {r['worst_error']:.2e} median {r['median_error']:.2e}"
            f"{grads}; kept {r['kept_bytes'] / harness.MIB:.2f} MiB ({r['seconds']:.1f} s)")


_VARIANTS = {"plain": "-", "round_inputs": "inputs rounded to bf16"}


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1e}"


def markdown(payload: dict[str, Any]) -> str:
    """The table of every result, with the settings line."""
    c = payload["config"]
    rows = [[r["depth"], r["compute_dtype"], _VARIANTS[r.get("variant", "plain")],
             r["keep_every"] or "None", r["kept_copies"],
             f"{r['kept_bytes'] / harness.MIB:.2f}", _fmt(r["worst_error"]),
             _fmt(r["median_error"]),
             _fmt(r.get("worst_gradient_error")), _fmt(r.get("median_gradient_error"))]
            for r in sorted(payload["results"], key=lambda r: (
                r["compute_dtype"], r["depth"], r.get("variant", "plain"),
                r["keep_every"] or 0))]
    m = payload["machine"]
    return "\n".join([
        f"Reconstruction drift by depth; ReversibleTransformerLM d_model {c['d_model']}, "
        f"d_ff {c['d_ff']}, {c['n_heads']} heads, seq {c['seq_len']}, batch "
        f"{c['batch_size']}, dropout {c['dropout']} ({c.get('mask_bits', 16)}-bit masks), "
        f"float32 streams; gradients against "
        f"Trainer in the same precision; {m['processor']}, jax {m['jax']}, {m['date']}.",
        "", report.markdown_table(
            ["depth", "compute", "variant", "keep_every", "kept copies",
             "kept MiB (incl. block input)",
             "worst rec. error", "median rec. error", "worst grad. error",
             "median grad. error"], rows), ""])


def plot(path: Path, payload: dict[str, Any]) -> bool:
    """Worst reconstruction and gradient error vs depth, a line per (dtype, keep_every)."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is missing, so {path.name} was not written")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = payload["results"]
    lines = sorted({(r["compute_dtype"], r.get("variant", "plain"), r["keep_every"] or 0)
                    for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, key, title in [(axes[0], "worst_error", "worst reconstruction error"),
                           (axes[1], "worst_gradient_error", "worst per-layer gradient error")]:
        for dtype, variant, keep in lines:
            points = sorted((r["depth"], max(r[key], 1e-9)) for r in results
                            if key in r and (r["compute_dtype"], r.get("variant", "plain"),
                                             r["keep_every"] or 0) == (dtype, variant, keep))
            if points:
                extra = "" if variant == "plain" else f", {_VARIANTS[variant]}"
                ax.plot(*zip(*points, strict=True), marker="o",
                        label=f"{dtype}, keep_every {keep or 'None'}{extra}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("depth (n_layers)")
        ax.set_ylabel("relative error")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    report.save_figure(plt, fig, path)
    return True


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measures every (depth, dtype, keep_every) and writes JSON, Markdown and PNG."""
    args = parse_flags(argv)
    out = Path(args.out_dir)
    if args.render_only:
        payload = report.read_json(out / f"{NAME}.json")
    else:
        config = {name: getattr(args, name) for name in (*DEFAULTS, "seed") if name != "depths"}
        config["mask_bits"] = int(args.mask_bits)
        payload = {"benchmark": NAME, "config": config,
                   "machine": harness.machine_info(args.command), "results": []}
        if args.merge:
            payload["results"] = report.read_json(out / f"{NAME}.json")["results"]
        for depth in args.depths:
            for dtype in args.compute_dtypes:
                for variant in args.variants:
                    payload["results"] += measure_depth(config, depth, dtype,
                                                        args.keep_every_values,
                                                        args.gradients, variant)
                    report.write_json(out / f"{NAME}.json", payload)  # Partial runs count.
    report.write_json(out / f"{NAME}.json", payload)
    (out / f"{NAME}.md").write_text(markdown(payload))
    plot(out / f"{NAME}.png", payload)
    print(markdown(payload))
    print(f"wrote {out / NAME}.json, .md, .png")
    return payload


if __name__ == "__main__":
    harness.script_main(main)
