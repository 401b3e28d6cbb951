"""Peak accelerator memory vs depth for the trainers of a reversible Transformer LM.

Usage (from the repository root, after ``pip install -e '.[bench]'``)::

    python benchmarks/memory_vs_depth.py            # defaults: depths 2..32, d_model 256
    python benchmarks/memory_vs_depth.py --quick    # tiny sizes, seconds

Each (trainer, depth) runs in a fresh process on ``--n_devices`` devices (default 1; the
FSDP columns, "Trainer + FSDP" and "ReversibleSerialTrainer + FSDP", on 4 forced devices,
and only where the trainer takes ``fsdp``): build the
model, run ``--warmup`` steps (the first compiles), then measure ``--steps`` steps under
`revtrain.memory.track_peak`. On GPU/TPU the peak is the allocator's high-water mark; on
CPU it is the ledger (live device arrays + the compiled function's temporaries and outputs
at every dispatch; see `revtrain.memory`). Reported per configuration, in bytes:

* ``peak_bytes`` -- the peak device bytes over the measured steps on the first device
  (everything live on it in that process: the worker holds nothing else there; with
  several devices, this is the per-device peak);
* ``weights_and_slots_bytes`` -- the trainer's weights and optimizer slots on the device at
  that peak (the whole model for `Trainer`/`ReversibleSerialTrainer`, the resident layers
  for `MemoryEfficientTrainer`), and ``rest_bytes = peak_bytes - weights_and_slots_bytes``
  (activations, cotangents, inputs, temporaries);
* ``kept_bytes`` -- the activation stacks the block trainers keep for the backward pass
  (``device_footprint().kept_bytes``: block inputs and, with ``--keep_every``, the kept
  copies; part of ``rest_bytes``; 0 for `Trainer` and where they wait on the host);
* ``peak_rss_bytes`` -- the worker process's peak resident set size (on CPU "device"
  memory is host RAM; the RSS also counts the Python heap, XLA and compilation).

Writes ``memory_vs_depth.json``, ``.md`` and ``.png`` to ``--out_dir``.
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

NAME = "memory_vs_depth"


# ------------------------------------------------------------------------------------------
# Worker side.

class _SplitObserver:
    """A trainer observer: notes the ledger's entry and the trainer's resident weights+slots
    bytes (`device_footprint`) at the peak, and counts dispatches.

    It must come after the ledger in ``trainer.observers``, so the ledger's newest entry is
    the one of the current dispatch.
    """

    def __init__(self, ledger: Any, trainer: Any):
        self.ledger, self.trainer = ledger, trainer
        self.peak: tuple[Any, int] | None = None
        self.n_dispatches = 0

    def _note(self) -> None:
        entry = self.ledger.entries[-1]
        if self.peak is None or entry.total_bytes > self.peak[0].total_bytes:
            self.peak = (entry, self.trainer.device_footprint().total_bytes)

    def on_dispatch(self, label: str, fn: Any, args: tuple) -> None:
        del label, fn, args
        self.n_dispatches += 1
        self._note()

    def on_phase(self, label: str) -> None:
        del label
        self._note()


def _ledger(trainer: Any) -> Any:
    """The `MemoryLedger` that `track_peak` added to the trainer's observers, or None."""
    from revtrain import memory
    found = [o for o in trainer.observers if isinstance(o, memory.MemoryLedger)]
    return found[-1] if found else None


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """Builds the configured trainer, warms it up, and measures its peak device memory."""
    import jax

    from revtrain import memory

    trainer, batch = harness.build(config)
    device = jax.local_devices()[0]
    model_bytes = harness.host_bytes((trainer.weights, trainer.slots))
    start = time.perf_counter()
    for step in range(config["warmup"]):
        trainer.one_step(batch, jax.random.key(step))
        trainer.block_until_ready()
    warmup_s = time.perf_counter() - start
    with memory.track_peak(trainer, device=device) as report:
        resident_at_entry = trainer.device_footprint().total_bytes
        recorder, ledger = None, _ledger(trainer)
        if ledger is not None:  # The CPU ledger: split its peak.
            recorder = _SplitObserver(ledger, trainer)
            trainer.observers.append(recorder)
        losses = []
        for step in range(config["warmup"], config["warmup"] + config["steps"]):
            loss, _ = trainer.one_step(batch, jax.random.key(step))
            trainer.block_until_ready()
            losses.append(float(loss))
        if recorder is not None:
            trainer.observers.remove(recorder)
    resident = _resident_at_peak(report, recorder, resident_at_entry)
    result = {"method": report.method, "peak_bytes": report.peak_bytes,
              "weights_and_slots_bytes": resident,
              "rest_bytes": report.peak_bytes - resident,
              "baseline_bytes": report.baseline_bytes, "peak_label": report.peak_label,
              "peak_rss_bytes": report.peak_rss_bytes, "rss_bytes": report.rss_bytes,
              "model_weights_and_slots_bytes": model_bytes,
              "n_params": harness.host_bytes(trainer.weights) // 4, "losses": losses,
              "warmup_s": warmup_s}
    if recorder is not None:
        entry = recorder.peak[0]
        result |= {"peak_live_bytes": entry.live_bytes, "peak_fn_bytes": entry.fn_bytes,
                   "n_dispatches_per_step": recorder.n_dispatches // config["steps"]}
    result["kept_bytes"] = trainer.device_footprint().kept_bytes
    if hasattr(trainer, "max_resident_layers"):
        result["max_resident_layers"] = trainer.max_resident_layers
    return result


def _resident_at_peak(report: Any, recorder: _SplitObserver | None, at_entry: int) -> int:
    """Weights+slots bytes on the device at the reported peak.

    With allocator statistics (GPU/TPU) there is no peak entry: the trainer's weights and
    slots measured at entry stand in (exact for `Trainer`/`ReversibleSerialTrainer`).
    """
    if recorder is None or recorder.peak is None:
        return at_entry
    entry, resident = recorder.peak
    # The peak may be the 'enter' record taken before the recorder was installed.
    return resident if entry.total_bytes >= report.peak_bytes else at_entry


# ------------------------------------------------------------------------------------------
# Parent side: tables, plot, targets.

def _describe(r: dict[str, Any]) -> str:
    return (f"peak {report.mib(r['peak_bytes'])} MiB = weights+slots "
            f"{report.mib(r['weights_and_slots_bytes'])} + rest {report.mib(r['rest_bytes'])}"
            f" ({r['method']} at {r['peak_label']}); peak RSS {report.mib(r['peak_rss_bytes'])}"
            f" MiB")


def targets(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's memory targets, evaluated where the needed depths were measured."""
    table = report.by_key(results)
    depths = sorted({r["depth"] for r in results})
    lo, hi = (depths[0], depths[-1]) if depths else (None, None)
    checks = []
    rst_hi, tr_hi = table.get(("reversible", hi)), table.get(("trainer", hi))
    if rst_hi and tr_hi:
        ratio = rst_hi["peak_bytes"] / tr_hi["peak_bytes"]
        checks.append({"target": f"ReversibleSerialTrainer peak <= 0.25x Trainer's at depth "
                                 f"{hi}", "value": f"{ratio:.3f}x", "met": ratio <= 0.25})
    rst_lo = table.get(("reversible", lo))
    if rst_lo and rst_hi and lo != hi:
        growth = rst_hi["rest_bytes"] / rst_lo["rest_bytes"] - 1
        checks.append({"target": f"ReversibleSerialTrainer non-weight part grows < 10% from "
                                 f"depth {lo} to {hi}", "value": f"{100 * growth:+.1f}%",
                       "met": growth < 0.10})
    for kind, base in (("trainer_fsdp", "trainer"), ("reversible_fsdp", "reversible")):
        sharded, whole = table.get((kind, hi)), table.get((base, hi))
        if sharded and whole:
            ratio = sharded["weights_and_slots_bytes"] / whole["weights_and_slots_bytes"]
            checks.append({"target": f"{harness.TRAINERS[kind]} weights+slots per device <= "
                                     f"0.3x {harness.TRAINERS[base]}'s at depth {hi}",
                           "value": f"{ratio:.3f}x", "met": ratio <= 0.3})
    met_lo, met_hi = table.get(("memory_efficient", lo)), table.get(("memory_efficient", hi))
    if met_lo and met_hi and lo != hi:
        ratio = met_hi["peak_bytes"] / met_lo["peak_bytes"]
        checks.append({"target": f"MemoryEfficientTrainer peak at depth {hi} <= 1.2x depth "
                                 f"{lo}", "value": f"{ratio:.3f}x", "met": ratio <= 1.2})
    return checks


def markdown(payload: dict[str, Any]) -> str:
    results, config = payload["results"], payload["config"]
    table = report.by_key(results)
    depths = sorted({r["depth"] for r in results})
    kinds = [k for k in harness.TRAINERS if any(r["trainer"] == k for r in results)]
    summary = [[d] + [report.mib(table[(k, d)]["peak_bytes"]) if (k, d) in table else "error"
                      for k in kinds] for d in depths]
    detail = []
    for k in kinds:
        for d in depths:
            r = table.get((k, d))
            if r is not None:
                detail.append([harness.TRAINERS[k], d, report.mib(r["peak_bytes"]),
                               report.mib(r["weights_and_slots_bytes"]),
                               report.mib(r["rest_bytes"]), report.mib(r.get("kept_bytes")),
                               report.mib(r["peak_rss_bytes"])])
    lines = [f"Peak device memory (MiB) by depth; {report.settings_line(config)}; method: "
             f"{', '.join(sorted({r['method'] for r in table.values()}))}; "
             f"{payload['machine']['processor']}, {payload['machine']['cpu_count']} cores.", "",
             report.markdown_table(["depth"] + [harness.TRAINERS[k] for k in kinds], summary),
             "", report.markdown_table(
                 ["trainer", "depth", "peak (MiB)", "weights+optimizer (MiB)", "rest (MiB)",
                  "kept stacks (MiB)", "process peak RSS (MiB)"], detail)]
    lines += _errors_and_targets(results, payload["targets"])
    return "\n".join(lines) + "\n"


def _errors_and_targets(results: Sequence[dict], checks: Sequence[dict]) -> list[str]:
    lines = [""] + [f"- {harness.TRAINERS[r['trainer']]} depth {r['depth']}: {r['error']}"
                    for r in results if "error" in r]
    if checks:
        lines += ["", report.targets_table(checks)]
    return lines


def _run(args: Any) -> dict[str, Any]:
    """Runs every configuration in worker processes; returns the payload."""
    machine = harness.machine_info(args.command)  # Before the run: its date is the start.
    configs = harness.configurations(args)
    print(f"{NAME}: {len(configs)} configurations, {report.settings_line(configs[0])}")
    results = harness.run_all(str(Path(__file__).resolve()), configs, args.timeout,
                              _describe, args.jobs)
    return {"benchmark": NAME, "config": harness.model_config(args), "depths": args.depths,
            "machine": machine, "results": results}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs every configuration in a worker process and writes JSON, Markdown and PNG.

    With ``--render_only`` it reads the JSON instead and rewrites the three files.
    """
    args = harness.parse_flags(argv, steps=1, warmup=1)
    if not harness.FLAGS["trainers"].present:
        args.trainers = harness.available_trainers()
    out = Path(args.out_dir)
    payload = report.read_json(out / f"{NAME}.json") if args.render_only else _run(args)
    payload["config"] = harness.with_workers_host_allocator(payload["config"],
                                                            payload["results"])
    payload["targets"] = targets(payload["results"])
    report.write_json(out / f"{NAME}.json", payload)
    (out / f"{NAME}.md").write_text(markdown(payload))
    panels = [("total peak", "peak device memory (MiB)",
               lambda r: r["peak_bytes"] / harness.MIB),
              ("beyond weights + optimizer state", "MiB",
               lambda r: r["rest_bytes"] / harness.MIB)]
    report.plot_by_depth(out / f"{NAME}.png", payload["results"], panels,
                          f"Peak device memory vs depth "
                          f"({report.settings_line(payload['config'])})")
    print(markdown(payload))
    print(f"wrote {out / NAME}.json, .md, .png")
    return payload


if __name__ == "__main__":
    harness.script_main(main, measure)
