"""What the benchmark scripts write: JSON, Markdown tables, the settings line and plots.

Split from `benchmarks.harness` (flags, worker processes, the model and trainers), whose
constants it reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import FSDP_DEVICES, MIB, TRAINERS


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    """Reads a benchmark's JSON output (for ``--render_only``)."""
    if not path.exists():
        raise SystemExit(f"{path} does not exist; run the benchmark first (without "
                         f"--render_only) or pass the --out_dir holding it")
    return json.loads(path.read_text())


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join([":---"] + ["---:"] * (len(headers) - 1)) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def targets_table(checks: Sequence[dict[str, Any]]) -> str:
    """A benchmark's targets as a Markdown table: target, measured, met (a miss in bold).

    ``checks`` are the benchmarks' ``targets(...)`` dicts with ``target``, ``value`` and
    ``met`` keys.
    """
    return markdown_table(["target", "measured", "met"],
                          [[c["target"], c["value"], "yes" if c["met"] else "**no**"]
                           for c in checks])


def mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:,.1f}"


def by_key(results: Sequence[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Maps ``(trainer, depth)`` to the result, for the successful results only."""
    return {(r["trainer"], r["depth"]): r for r in results if "error" not in r}


def pyplot(path: Path) -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None (saying that ``path`` is not
    written) when matplotlib is not installed (the ``bench`` extra)."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is missing, so {path.name} was not written; "
              f"pip install -e '.[bench]'")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(plt: Any, fig: Any, path: Path) -> None:
    """Lays out ``fig``, writes it to ``path`` (110 dpi, folders made) and closes it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_by_depth(path: Path, results: Sequence[dict[str, Any]],
                  panels: Sequence[tuple[str, str, Callable[[dict], float | None]]],
                  title: str) -> bool:
    """One subplot per ``(title, y_label, value_fn)``; a line per trainer over depth.

    Returns False (and writes nothing) when matplotlib is not installed (the ``bench``
    extra).
    """
    plt = pyplot(path)
    if plt is None:
        return False
    table = by_key(results)
    depths = sorted({r["depth"] for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, (panel_title, y_label, value_fn) in zip(axes[0], panels, strict=True):
        for kind, label in TRAINERS.items():
            points = [(d, value_fn(table[(kind, d)])) for d in depths if (kind, d) in table]
            points = [(d, v) for d, v in points if v is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=label)
        ax.set_xticks(depths, [str(d) for d in depths])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("depth (n_layers: attention + feed-forward pairs)")
        ax.set_ylabel(y_label)
        ax.set_title(panel_title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save_figure(plt, fig, path)
    return True


def settings_line(config: dict[str, Any], trainers: Sequence[str] | None = None) -> str:
    """The run's settings in one line. ``trainers`` (the kinds that ran; None: unknown)
    limits the mode labels to the trainers they concern: ``scan_layers`` to
    `ReversibleSerialTrainer`, ``scan_window`` to `MemoryEfficientTrainer`."""
    def ran(prefix: str) -> bool:
        return trainers is None or any(t.startswith(prefix) for t in trainers)
    scan = config.get("scan_layers") if ran("reversible") else None
    window = config.get("scan_window") if ran("memory_efficient") else None
    return (f"d_model {config['d_model']}, d_ff {config['d_ff']}, {config['n_heads']} heads, "
            f"seq {config['seq_len']}, batch {config['batch_size']}, vocab "
            f"{config['vocab_size']}, dropout {config['dropout']}, Adam, n_devices "
            f"{config.get('n_devices', 1)} (FSDP: {FSDP_DEVICES})"
            + (f", keep_every {config['keep_every']}" if config.get("keep_every") else "")
            + (f", {config['mask_bits']}-bit dropout masks"
               if config.get("mask_bits", 16) != 16 else "")
            + f", host allocator {config.get('host_allocator', 'system')}"
            + ({True: ", ReversibleSerialTrainer's runs scanned",
                False: ", ReversibleSerialTrainer one program per layer (--noscan_layers)"}.get(
                    scan, ""))
            + (f", MemoryEfficientTrainer in scanned windows of {window}" if window else ""))
