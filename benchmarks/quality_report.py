"""What `benchmarks/quality.py` reports: summaries over seeds, the convergence rule, the
targets, the ablation, the tables, the plot, and the merge of ``--update`` runs.

Reads results of either format: a row without ``load_avg`` or ``measured`` (the first,
reduced run) shows "—" there, and a payload whose plain Transformer curve does not meet the
convergence rule (or that has no such curve) is not converged, so its targets read
"not converged (budget)" instead of a verdict.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.quality_variants import ABLATION_ONLY, FACTORS, TRAX_MATCH, VARIANTS

FLAT_BITS = 0.02  # The last FLAT_FRACTION of the steps improve the plain model by less.
FLAT_FRACTION = 0.2
CONVERGENCE_VARIANT = "plain"
NOT_CONVERGED = "not converged (budget)"
SEEDS = 3  # Seeds a target is judged on; fewer is a budget-limited result, not a verdict.
REFORMER_NOTE = ("Equal parameters is the Reformer paper's comparison (Kitaev et al. 2020 "
                 "compare a regular and a reversible Transformer with the same number of "
                 "parameters); equal width keeps d_model and d_ff, and the reversible "
                 "model's wider head (2 d_model) gives it more parameters.")


def spread(std: float, n: int) -> str:
    """`` ± std`` over ``n`` seeds, or `` (1 seed)``: one seed has no spread to give."""
    return f" ± {std:.4f}" if n > 1 else " (1 seed)"


def seeds_short(n: int) -> str:
    """A target's status when it rests on fewer than `SEEDS` seeds."""
    return f"{n} of {SEEDS} seeds (budget)"


def label(variant: str) -> str:
    return VARIANTS[variant].label if variant in VARIANTS else variant


def variants(results: Sequence[dict[str, Any]]) -> list[str]:
    """The variants of ``results`` in `VARIANTS`' order (unknown ones last), so that a
    table's rows do not depend on the order the invocations ran them in."""
    order = {v: i for i, v in enumerate(VARIANTS)}
    return sorted(dict.fromkeys(r["variant"] for r in results),
                  key=lambda v: order.get(v, len(order)))


def _ok(results: Sequence[dict[str, Any]], variant: str) -> list[dict[str, Any]]:
    return [r for r in results if r["variant"] == variant and "error" not in r]


# ------------------------------------------------------------------------------------------
# Curves and the convergence rule.

def at_step(curve: Sequence[dict[str, Any]], step: float) -> float:
    """Bits per byte of an eval curve at ``step`` (linear between its points; the first
    point's value before it)."""
    points = [(p["step"], p["bits_per_byte"]) for p in curve]
    if step <= points[0][0]:
        return points[0][1]
    for (s0, b0), (s1, b1) in itertools.pairwise(points):
        if s0 <= step <= s1:
            return b0 + (b1 - b0) * (step - s0) / max(s1 - s0, 1e-12)
    return points[-1][1]


def mean_curve(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The seeds' curves averaged point by point (over the steps all of them have)."""
    n = min(len(r["curve"]) for r in rows)
    return [{"step": rows[0]["curve"][i]["step"],
             "bits_per_byte": statistics.fmean(r["curve"][i]["bits_per_byte"] for r in rows),
             "train_s": statistics.fmean(r["curve"][i]["train_s"] for r in rows)}
            for i in range(n)]


def late_improvement(curve: Sequence[dict[str, Any]], steps: float | None = None) -> float:
    """How much the last `FLAT_FRACTION` of ``steps`` (default: the curve's last step)
    lowered the curve, in bits per byte."""
    steps = curve[-1]["step"] if steps is None else steps
    return at_step(curve, (1 - FLAT_FRACTION) * steps) - at_step(curve, steps)


def flattened(curve: Sequence[dict[str, Any]], steps: float | None = None) -> bool:
    """The rule: the last 20% of the steps improve the curve by less than 0.02 bits/byte
    (needs a point at or before 80% of the steps)."""
    steps = curve[-1]["step"] if steps is None else steps
    return (curve[0]["step"] <= (1 - FLAT_FRACTION) * steps
            and late_improvement(curve, steps) < FLAT_BITS)


def pilot_steps(curve: Sequence[dict[str, Any]]) -> int | None:
    """The budget a pilot picks: the first eval step from which the rule holds at every
    later eval step of the curve (a plateau that the curve later leaves does not count);
    None when it does not hold at the curve's end."""
    steps = [p["step"] for p in curve]
    holds = [flattened(curve, s) for s in steps]
    if not holds or not holds[-1]:
        return None
    first = len(holds) - 1
    while first > 0 and holds[first - 1]:
        first -= 1
    return steps[first]


def convergence(payload: dict[str, Any]) -> dict[str, Any]:
    """Whether the run is converged: its plain Transformer's mean curve meets the rule at
    the run's final step, and the run has at least the pilot's steps when a pilot set
    them. ``{'converged', 'reason', 'late_improvement'}``."""
    rows = _ok(payload["results"], CONVERGENCE_VARIANT)
    if not rows:
        return {"converged": False, "late_improvement": None,
                "reason": f"no {label(CONVERGENCE_VARIANT)} rows to check the rule on"}
    curve = mean_curve(rows)
    gain = late_improvement(curve)
    pilot = payload.get("pilot_steps")
    if not flattened(curve):
        reason = (f"the last {FLAT_FRACTION:.0%} of {curve[-1]['step']} steps still improved "
                  f"{label(CONVERGENCE_VARIANT)} by {gain:.4f} bits/byte (rule: < "
                  f"{FLAT_BITS})")
        return {"converged": False, "late_improvement": gain, "reason": reason}
    if pilot and payload["config"]["steps"] < pilot:
        return {"converged": False, "late_improvement": gain,
                "reason": f"{payload['config']['steps']} steps, fewer than the pilot's {pilot}"}
    return {"converged": True, "late_improvement": gain,
            "reason": f"the last {FLAT_FRACTION:.0%} of the steps improved "
                      f"{label(CONVERGENCE_VARIANT)} by {gain:.4f} bits/byte"}


# ------------------------------------------------------------------------------------------
# Summaries and targets.

def summarize(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant: mean and standard deviation over the seeds of the final bits per
    byte, the training seconds, the worst load average, the most workers that ran at once
    (``jobs``), the peaks and the parameter count; failed seeds are left out and
    counted. ``load_by_jobs`` keeps the worst load average per number of workers that ran
    at once, so a seed run alone and one run beside another are not reported as one
    (``{jobs: load}``, sorted by jobs; load None where no such row recorded one)."""
    out = {}
    for variant in variants(results):
        rows = _ok(results, variant)
        failed = sum(1 for r in results if r["variant"] == variant and "error" in r)
        if not rows:
            out[variant] = {"n": 0, "failed": failed}
            continue
        bpb = [r["bits_per_byte"] for r in rows]
        load_by_jobs: dict[int, float | None] = {}
        for r in rows:
            jobs, load = r.get("jobs", 1), max(r["load_avg"]) if r.get("load_avg") else None
            known = [x for x in (load_by_jobs.get(jobs), load) if x is not None]
            load_by_jobs[jobs] = max(known) if known else None
        loads = [load for load in load_by_jobs.values() if load is not None]
        out[variant] = {"jobs": max(load_by_jobs),
            "n": len(rows), "failed": failed, "mean": statistics.fmean(bpb),
            "std": statistics.stdev(bpb) if len(bpb) > 1 else 0.0,
            "train_s": statistics.fmean(r["train_s"] for r in rows),
            "load_avg": max(loads) if loads else None,
            "load_by_jobs": dict(sorted(load_by_jobs.items())),
            "peak_bytes": max((r.get("peak_bytes") or 0) for r in rows) or None,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rows),
            "n_params": rows[0]["n_params"], "d_ff": rows[0].get("d_ff_used")}
    return out


def paired_gap(results: Sequence[dict[str, Any]], a: str, b: str
               ) -> tuple[float, float, int] | None:
    """``a - b`` per seed (both saw the seed's batches), as ``(mean, std, seeds)``."""
    first = {r["seed"]: r["bits_per_byte"] for r in _ok(results, b)}
    diffs = [r["bits_per_byte"] - first[r["seed"]] for r in _ok(results, a)
             if r["seed"] in first]
    if not diffs:
        return None
    return (statistics.fmean(diffs), statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
            len(diffs))


def divergence(results: Sequence[dict[str, Any]], a: str, b: str
               ) -> dict[str, Any] | None:
    """Where the training losses of ``a`` and ``b`` part, over the seeds both ran (each
    pair saw the seed's batches from the seed's key): ``{'seeds', 'steps', 'first_step',
    'apart'}``, ``first_step`` the earliest step (1-based) whose losses differ in any
    seed (None: equal bit for bit throughout) and ``apart`` the largest absolute loss
    difference (nats) at the steps 10, 100, 1,000... and the last. None without a pair."""
    by_seed = {r["seed"]: r for r in _ok(results, b) if r.get("train_losses")}
    pairs = [(r["train_losses"], by_seed[r["seed"]]["train_losses"])
             for r in _ok(results, a) if r.get("train_losses") and r["seed"] in by_seed]
    if not pairs:
        return None
    steps = min(min(len(x), len(y)) for x, y in pairs)
    firsts = [next((i + 1 for i in range(steps) if x[i] != y[i]), None) for x, y in pairs]
    marks = [10 ** k for k in range(1, 8) if 10 ** k < steps] + [steps]
    return {"seeds": len(pairs), "steps": steps,
            "first_step": min((f for f in firsts if f), default=None),
            "apart": {m: max(abs(x[m - 1] - y[m - 1]) for x, y in pairs) for m in marks}}


def divergence_text(d: dict[str, Any]) -> str:
    """`divergence` in words, for the targets table."""
    if d["first_step"] is None:
        return f"equal bit for bit for all {d['steps']:,} steps of {d['seeds']} seed(s)"
    apart = ", ".join(f"{v:.1e} at step {m:,}" for m, v in d["apart"].items()
                      if m >= d["first_step"])
    return (f"equal to step {d['first_step'] - 1:,}, then apart by float32 rounding that "
            f"training amplifies: {apart} (nats, largest over {d['seeds']} seed(s))")


def at_wall_time(curve: Sequence[dict[str, Any]], seconds: float) -> float:
    """Bits per byte of an eval curve at ``seconds`` of training (linear between points;
    the last point when the curve ends earlier, the first when it starts later)."""
    points = [(p["train_s"], p["bits_per_byte"]) for p in curve]
    if seconds <= points[0][0]:
        return points[0][1]
    for (t0, b0), (t1, b1) in itertools.pairwise(points):
        if t0 <= seconds <= t1:
            return b0 + (b1 - b0) * (seconds - t0) / max(t1 - t0, 1e-12)
    return points[-1][1]


def equal_wall_time(results: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """SentencePiece against bytes (``bytes_alone``) at the byte runs' training time,
    per seed, then averaged: ``{'seconds', 'bytes', 'sentencepiece', 'difference',
    'seeds', 'spread'}``. Only seeds whose two rows each ran alone (``jobs`` 1) count: a
    worker beside another one trains slower, so its seconds are not the other row's."""
    pairs = []
    for seed in sorted({r["seed"] for r in results}):
        found = {r["variant"]: r for r in results if r["seed"] == seed and "error" not in r
                 and r.get("jobs", 1) == 1}
        if "bytes_alone" in found and "sentencepiece" in found:
            byte_run, sp = found["bytes_alone"], found["sentencepiece"]
            pairs.append((byte_run["train_s"], byte_run["bits_per_byte"],
                          at_wall_time(sp["curve"], byte_run["train_s"])))
    if not pairs:
        return None
    seconds, byte_bpb, sp_bpb = (statistics.fmean(p[i] for p in pairs) for i in range(3))
    return {"seconds": seconds, "bytes": byte_bpb, "sentencepiece": sp_bpb,
            "difference": sp_bpb - byte_bpb, "seeds": len(pairs),
            "spread": statistics.stdev([p[2] - p[1] for p in pairs]) if len(pairs) > 1
            else 0.0}


def targets(results: Sequence[dict[str, Any]], converged: bool = True
            ) -> list[dict[str, Any]]:
    """The issue's quality targets, for the configurations the run has. A target with a
    limit gets ``met`` True/False on a converged run; on any other run its ``status`` is
    `NOT_CONVERGED`, and on rows with fewer than `SEEDS` seeds `seeds_short` (a
    budget-limited gap is not a finding). Reported rows are ``met``."""
    s, checks = summarize(results), []

    def add(target: str, value: float, text: str, limit: float | None,
            absolute: bool = True, seeds: int = SEEDS) -> None:
        check = {"target": target, "value": text, "met": True}
        if limit is not None:
            check["met"] = (abs(value) if absolute else value) <= limit
            if not converged:
                check["status"] = NOT_CONVERGED
            elif seeds < SEEDS:
                check["status"] = seeds_short(seeds)
        checks.append(check)

    def gap(target: str, a: str, b: str, limit: float | None, absolute: bool = True):
        if not (s.get(a, {}).get("n") and s.get(b, {}).get("n")):
            return
        value = s[a]["mean"] - s[b]["mean"]
        paired = paired_gap(results, a, b)
        per_seed = (f"; per seed {paired[0]:+.4f}{spread(paired[1], paired[2])}"
                    if paired else "")
        add(target, value, f"{value:+.4f} ({s[a]['mean']:.4f}{spread(s[a]['std'], s[a]['n'])}"
                           f" vs {s[b]['mean']:.4f}{spread(s[b]['std'], s[b]['n'])}"
                           f"{per_seed})", limit, absolute, min(s[a]["n"], s[b]["n"]))

    for trainer in ("rev_trainer", "rev_reversible", "rev_memory_efficient"):
        gap(f"{label(trainer)} within 0.01 bpb of the plain Transformer at equal "
            f"parameters", trainer, "plain_params", 0.01)
        gap(f"{label(trainer)} vs the plain Transformer at equal width (reported)", trainer,
            "plain", None)
    trainers = [t for t in ("rev_trainer", "rev_reversible", "rev_memory_efficient")
                if s.get(t, {}).get("n")]
    if len(trainers) > 1:
        means = [s[t]["mean"] for t in trainers]
        apart = max(means) - min(means)
        add("the trainers agree to 0.002 bpb", apart, f"{apart:.4f} (largest difference "
            f"of the means of {len(trainers)} trainers)", 0.002,
            seeds=min(s[t]["n"] for t in trainers))
    for a, b in itertools.pairwise(trainers):
        parted = divergence(results, a, b)
        if parted:
            add(f"training losses, {label(a)} vs {label(b)} (reported)", 0.0,
                divergence_text(parted), None)
    exact = "exact_long" if s.get("exact_long", {}).get("n") else "rev_reversible"
    gap("LSH-8 within 0.02 bpb of exact attention", "lsh8", exact, 0.02, False)
    gap("LSH-2 within 0.05 bpb of exact attention", "lsh2", exact, 0.05, False)
    for n in (1, 4):
        gap(f"LSH-{n} gap to exact attention (reported)", f"lsh{n}", exact, None)
    for trax, ours, note in TRAX_MATCH:
        gap(f"{label(ours)} within 0.02 bpb of {label(trax)} ({note})", ours, trax, 0.02)
    wall = equal_wall_time(results)
    if wall:
        winner = "SentencePiece" if wall["difference"] < 0 else "bytes"
        checks.append({"target": "SentencePiece vs bytes at equal wall time (reported)",
                       "value": f"{winner} by {abs(wall['difference']):.4f} bpb at "
                                f"{wall['seconds']:.0f} s ({wall['sentencepiece']:.4f} vs "
                                f"{wall['bytes']:.4f}; " + (
                                    f"seed spread {wall['spread']:.4f})" if wall["seeds"] > 1
                                    else "1 seed)"),
                       "met": True})
    return checks


def targets_table(checks: Sequence[dict[str, Any]]) -> str:
    """`report.targets_table`, with a check's ``status`` in place of its verdict."""
    return report.markdown_table(
        ["target", "measured", "met"],
        [[c["target"], c["value"], c.get("status") or ("yes" if c["met"] else "**no**")]
         for c in checks])


def ablation_table(results: Sequence[dict[str, Any]]) -> str | None:
    """One row per factor: revtrain's change of bits/byte when it takes Trax's setting,
    Trax's when it takes revtrain's (per seed, mean ± std), and what cannot be matched;
    None when the run has no ablation rows."""
    def cell(a, b):
        if a is None:
            return "cannot be set in Trax"
        found = paired_gap(results, a, b)
        return "—" if found is None else f"{found[0]:+.4f}{spread(found[1], found[2])}"

    rows = [[factor, cell(ours, ref), cell(trax, trax_ref), note or "—"]
            for factor, ours, ref, trax, trax_ref, note in FACTORS
            if paired_gap(results, ours, ref) or (trax and paired_gap(results, trax, trax_ref))]
    if not rows:
        return None
    return report.markdown_table(["factor", "revtrain Δ bits/byte", "Trax Δ bits/byte",
                                  "not matched"], rows)


def rerun_table(results: Sequence[dict[str, Any]], rerun: Sequence[dict[str, Any]],
                variant: str = "rev_reversible") -> str:
    """``variant`` rerun at other code (``rerun``) against its rows in ``results``, per
    seed; then every ablation factor whose reference is ``variant``, per seed against
    each of the two (a factor and its reference are paired by seed, so they should have
    run at the same numerics; the rows' commits show which did)."""
    old = {r["seed"]: r for r in _ok(results, variant)}
    new = {r["seed"]: r for r in _ok(rerun, variant)}

    def commit(r):
        return r.get("commit") or "not recorded"

    rows = [[str(s), f"{old[s]['bits_per_byte']:.4f} ({commit(old[s])})",
             f"{new[s]['bits_per_byte']:.4f} ({commit(new[s])})",
             f"{new[s]['bits_per_byte'] - old[s]['bits_per_byte']:+.4f}"]
            for s in sorted(set(old) & set(new))]
    seeds = report.markdown_table(["seed", f"{label(variant)}, the table's row",
                                   "rerun", "rerun - row"], rows)
    again = f"{variant} (rerun)"
    both = [*results, *({**r, "variant": again} for r in _ok(rerun, variant))]

    def cell(a, b):
        found = paired_gap(both, a, b)
        return "—" if found is None else f"{found[0]:+.4f}{spread(found[1], found[2])}"

    factors = [[factor, ", ".join(sorted({commit(r) for r in _ok(results, ours)})),
                cell(ours, variant), cell(ours, again)]
               for factor, ours, ref, *_ in FACTORS if ref == variant and _ok(results, ours)]
    return seeds.rstrip("\n") + "\n\n" + report.markdown_table(
        ["factor", "its rows' commit", "Δ vs the table's row", "Δ vs the rerun"], factors)


# ------------------------------------------------------------------------------------------
# --update: separate invocations merge into one results file.

MERGE_IGNORED = ("configurations", "compilation_cache_dir")


def check_mergeable(old_config: dict[str, Any], new_config: dict[str, Any]) -> None:
    """Raises ValueError naming the settings in which two runs differ (a merge would mix
    budgets or sizes); checked before a ``--update`` run starts."""
    differ = sorted(k for k in set(old_config) | set(new_config)
                    if k not in MERGE_IGNORED and old_config.get(k) != new_config.get(k))
    if differ:
        raise ValueError(f"--update: the results file was run with other settings ("
                         f"{', '.join(f'{k}={old_config.get(k)!r}' for k in differ)}); "
                         f"rerun with those, or write to another --out_dir")


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new``'s rows added to ``old``'s, replacing the rows of the same (variant, seed);
    every invocation's ``machine`` kept in ``runs``.

    Raises:
      ValueError: when the two runs' settings differ (`check_mergeable`).
    """
    check_mergeable(old["config"], new["config"])
    replaced = {(r["variant"], r["seed"]) for r in new["results"]}
    kept = [r for r in old["results"] if (r["variant"], r["seed"]) not in replaced]
    return new | {"results": kept + new["results"],
                  "runs": old.get("runs", [old["machine"]]) + [new["machine"]],
                  "pilot_steps": new.get("pilot_steps") or old.get("pilot_steps"),
                  "wall_s": old.get("wall_s", 0.0) + new["wall_s"]}


# ------------------------------------------------------------------------------------------
# Tables and the plot.

def load_cell(summary: dict[str, Any]) -> str:
    """The table's load column: the worst load average per number of workers that ran at
    once, e.g. ``"0.9 alone; 2.1 (2 workers at once)"``; "—" where no row recorded one.
    A wall time beside other workers is not an idle one, so it says so."""
    by_jobs = summary.get("load_by_jobs") or {}
    text = lambda load: "—" if load is None else f"{load:.1f}"
    if not by_jobs or list(by_jobs) == [1]:
        return text(by_jobs.get(1))
    return "; ".join(f"{text(load)} " + ("alone" if jobs == 1 else f"({jobs} workers at once)")
                     for jobs, load in by_jobs.items())


def readme_table(payload: dict[str, Any], ablation_rows: bool = True) -> str:
    """The documents' table (`benchmarks.render_tables`): one row per configuration;
    without the rows that only measure a factor of the ablation (`ABLATION_ONLY`) unless
    ``ablation_rows``."""
    rows = []
    for variant, v in summarize(payload["results"]).items():
        if not ablation_rows and variant in ABLATION_ONLY:
            continue
        if not v["n"]:
            rows.append([label(variant), "failed", "", "", "", "", ""])
            continue
        peak = report.mib(v["peak_bytes"]) if v["peak_bytes"] else "—"
        load = load_cell(v)
        mean = f"{v['mean']:.4f}" + (f" ± {v['std']:.4f}" if v["n"] > 1
                                     else " (one seed: no spread)")
        rows.append([label(variant), mean, f"{v['n']}",
                     f"{v['n_params']:,}", f"{v['train_s']:.0f}", load,
                     f"{peak} / {report.mib(v['peak_rss_bytes'])}"])
    return report.markdown_table(
        ["configuration", "held-out bits/byte (mean ± std)", "seeds", "parameters",
         "train s", "load avg", "peak device / RSS MiB"], rows)


def plot(path: Path, results: Sequence[dict[str, Any]]) -> bool:
    """Held-out bits per byte against step (mean over seeds) and against training time."""
    plt = report.pyplot(path)
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for variant in variants(results):
        rows = _ok(results, variant)
        if not rows:
            continue
        curve = mean_curve(rows)
        style = "--" if label(variant).startswith("Trax") else "-"
        for ax, x in zip(axes, ("step", "train_s"), strict=True):
            ax.plot([p[x] for p in curve], [p["bits_per_byte"] for p in curve], style,
                    marker=".", label=label(variant))
    for ax, xlabel in zip(axes, ("step", "training wall time (s, eval excluded)"),
                          strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out bits per byte (mean over seeds)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    report.save_figure(plt, fig, path)
    return True
