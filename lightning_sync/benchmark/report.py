"""Tables and plots of a time-to-target comparison: one table per link (Markdown and CSV), every run in one CSV,
the metric over wall time per link, the sync behaviour over steps, and time to target against bandwidth."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_sync.benchmark.runs import REFERENCE, RunResult, Target
from lightning_sync.benchmark.ttt import Summary, speedup, summarize_runs

__all__ = ["COLUMNS", "markdown", "plot_bandwidth", "plot_curves", "plot_sync", "table_rows", "write_csv", "write_runs"]

MISSED = "missed"


def _mean(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def table_rows(labels: Sequence[str], results: Sequence[RunResult], reference: str = REFERENCE) -> list[dict[str, Any]]:
    """One row per label (in order): how many runs reached the target, the mean time to target (fastest and slowest
    dropped from 5 runs on; missed unless every run kept reached it), min, max, speedup vs ``reference``, and the
    means over the runs that reached it of steps, bytes sent per rank, blocked and evaluation seconds and LSSR at
    the target, and the best metric value (mean over runs)."""
    by_label: dict[str, list[RunResult]] = {label: [] for label in labels}
    for r in results:
        by_label.setdefault(r.label, []).append(r)
    summaries: dict[str, Summary | None] = {}
    for label, runs in by_label.items():
        # a run that failed counts as missed; a method none of whose runs ran is a failed row (with the error)
        times = [r.outcome.time_s if r.ok and r.outcome is not None else None for r in runs]
        summaries[label] = summarize_runs(times) if any(r.ok for r in runs) else None
    ref = summaries.get(reference)
    rows = []
    for label, runs in by_label.items():
        s = summaries[label]
        row: dict[str, Any] = {"method": label, "runs": len(runs)}
        failed = [r for r in runs if not r.ok]
        if failed:
            row["error"] = "; ".join(sorted({r.error for r in failed}))[:300]
        if s is None:
            rows.append(row)
            continue
        at = [r.outcome for r in runs if r.ok and r.outcome is not None and r.outcome.reached]
        ran = [r.outcome for r in runs if r.ok and r.outcome is not None]
        row.update(
            reached=s.reached,
            mean_s=s.mean_s,
            min_s=s.min_s,
            max_s=s.max_s,
            dropped_extremes=s.dropped_extremes,
            speedup=speedup(ref, s) if label != reference else (1.0 if s.mean_s is not None else None),
            steps=_mean([o.steps for o in at]),
            bytes_per_rank=_mean([o.bytes_per_rank for o in at]),
            blocked_s=_mean([o.blocked_s for o in at]),
            eval_s=_mean([o.eval_s for o in at]),
            lssr=_mean([o.lssr for o in at]),
            best=_mean([o.best for o in ran]),
        )
        row["summary"] = s
        rows.append(row)
    return rows


COLUMNS = [
    ("method", "method"),
    ("reached", "reached"),
    ("mean_s", "time to target s"),
    ("min_s", "min s"),
    ("max_s", "max s"),
    ("speedup", "speedup vs ddp"),
    ("steps", "steps"),
    ("bytes_per_rank", "bytes sent / rank"),
    ("blocked_s", "blocked s"),
    ("eval_s", "eval s"),
    ("lssr", "LSSR"),
    ("best", "best"),
]


def _fmt(key: str, value: Any, row: dict[str, Any]) -> str:
    if key == "method":
        return str(value)
    if key == "reached":
        return f"{value}/{row['runs']}" if value is not None else f"0/{row['runs']}"
    if key in ("mean_s", "min_s", "max_s"):
        if value is None:
            return MISSED if row.get("reached") is not None else "–"
        text = f"{value:.1f}"
        return text + " *" if key == "mean_s" and row.get("dropped_extremes") else text
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if key == "speedup":
        return f"{value:.2f}x"
    if key == "bytes_per_rank":
        return f"{value:,.0f}"
    if key == "steps":
        return f"{value:.0f}"
    if key in ("lssr",):
        return f"{value:.3f}"
    return f"{value:.4g}" if key == "best" else f"{value:.1f}"


def markdown(rows: list[dict[str, Any]], target: Target) -> str:
    """The table as Markdown; a failed method's row says why."""
    labels = [label if key != "best" else f"best {target.metric}" for key, label in COLUMNS]
    lines = ["| " + " | ".join(labels) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        if "reached" not in row:
            error = row.get("error", "no run").replace("|", "/")[:160]
            lines.append(f"| {row['method']} | failed: {error} |" + " |" * (len(COLUMNS) - 2))
            continue
        lines.append("| " + " | ".join(_fmt(k, row.get(k), row) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def legend(target: Target, seeds: int) -> str:
    """What the table's columns mean (printed under it)."""
    return (
        f"Target: {target.describe()} on the validation set. Time to target: wall seconds from the start of fit to the "
        f"end of the first evaluation that met it (evaluation included), mean over {seeds} seed(s)"
        + (" after dropping the fastest and the slowest (*)" if seeds >= 5 else "")
        + "; a run that never met it within its budget is missed, and a mean over a missed run is missed. Speedup: "
        "ddp's mean over the row's. Steps, bytes, blocked and evaluation seconds and LSSR are at the target (means "
        "over the runs that reached it); best: the best value of the metric over the run (mean over runs)."
    )


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    keys = ["method", "runs"] + [k for k, _ in COLUMNS if k != "method"] + ["dropped_extremes", "error"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in keys})


def write_runs(results: Sequence[RunResult], path: Path) -> None:
    """Every run, one line each: its link, method, seed, outcome and folder."""
    keys = [
        "link",
        "method",
        "seed",
        "ok",
        "reached",
        "time_s",
        "steps",
        "bytes_per_rank",
        "blocked_s",
        "eval_s",
        "lssr",
        "best",
        "evaluations",
        "wall_s",
        "end_steps",
        "first_batch",
        "seconds",
        "killed",
        "error",
        "run_dir",
    ]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for r in results:
            o = r.outcome
            line = {"link": r.link, "method": r.label, "seed": r.seed, "ok": r.ok, "seconds": round(r.seconds, 3)}
            line.update(killed=r.killed, error=r.error, run_dir=str(r.run_dir))
            if o is not None:
                line.update(
                    reached=o.reached,
                    time_s="" if o.time_s is None else o.time_s,
                    steps=o.steps,
                    bytes_per_rank=o.bytes_per_rank,
                    blocked_s=o.blocked_s,
                    eval_s=o.eval_s,
                    lssr=o.lssr,
                    best=o.best,
                    evaluations=o.evaluations,
                    wall_s=o.wall_s,
                    end_steps=o.end_steps,
                    first_batch=o.first_batch,
                )
            writer.writerow(line)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(results: Sequence[RunResult], target: Target, path: Path, title: str = "") -> Path:
    """The metric at every evaluation against wall time, every run (one colour per method), the target dashed."""
    from lightning_sync.benchmark.ttt import read_records

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours: dict[str, Any] = {}
    for r in results:
        evals = [rec for rec in read_records(r.run_dir / "time_to_target.jsonl") if rec.get("event") == "eval"]
        if not evals:
            continue
        colour = colours.setdefault(r.label, f"C{len(colours) % 10}")
        ax.plot(
            [e["wall_s"] for e in evals],
            [e["value"] for e in evals],
            marker=".",
            color=colour,
            alpha=0.8,
            label=r.label if r.label not in [h.get_label() for h in ax.get_lines()] else None,
        )
    ax.axhline(target.value, linestyle="--", color="grey", linewidth=1)
    ax.set_xlabel("wall time since the start of fit (s)")
    ax.set_ylabel(target.metric)
    if target.mode == "min":
        ax.set_yscale("log")
    ax.set_title(title or f"target {target.describe()}")
    if colours:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sync(results: Sequence[RunResult], path: Path) -> Path:
    """LSSR, period and ICS share over steps (``SyncStats``' logged values; the first seed of each method)."""
    plt = _pyplot()
    first: dict[str, RunResult] = {}
    for r in results:
        first.setdefault(r.label, r)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label in zip(axes, ("sync/lssr", "sync/period", "sync/ics_fraction"), ("LSSR", "period", "ICS share")):
        for r in first.values():
            pts = [(h["step"], h[key]) for h in r.history if key in h and "step" in h]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=r.label)
        ax.set_xlabel("step")
        ax.set_title(label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rate(bits_per_second: float) -> str:
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g} {unit}"
    return f"{bits_per_second:g} bit/s"


def plot_bandwidth(summaries: dict[float, dict[str, Summary]], target: Target, path: Path, title: str = "") -> Path:
    """Time to target against link bandwidth (bits/s), log-log, one line per method through its means, min-max as
    error bars; a missed mean is an ``x`` on the top edge (never a number), so where a method starts to beat ddp
    (the crossover) is visible."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    finite = [
        v for per in summaries.values() for s in per.values() for v in (s.mean_s, s.min_s, s.max_s) if v is not None
    ]
    top = max(finite) * 2.0 if finite else 1.0
    methods: list[str] = []
    for per in summaries.values():
        methods += [m for m in per if m not in methods]
    palette = plt.get_cmap("tab20").colors if len(methods) > 10 else [f"C{i}" for i in range(10)]
    for i, method in enumerate(methods):
        colour = palette[i % len(palette)]
        xs, ys, lo, hi, missed = [], [], [], [], []
        for bw in sorted(summaries):
            s = summaries[bw].get(method)
            if s is None:
                continue
            if s.mean_s is None:
                missed.append(bw)
                continue
            xs.append(bw)
            ys.append(s.mean_s)
            lo.append(s.mean_s - (s.min_s if s.min_s is not None else s.mean_s))
            hi.append((s.max_s if s.max_s is not None else top) - s.mean_s)
        style = "-" if method == REFERENCE else "--" if "(tuned)" not in method else ":"
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", linestyle=style, color=colour, capsize=3, label=method)
        if missed:
            ax.scatter(
                missed, [top] * len(missed), marker="x", color=colour, label=None if xs else f"{method} (missed)"
            )
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sorted(summaries), [_rate(bw) for bw in sorted(summaries)])
    ax.xaxis.set_minor_formatter(NullFormatter())
    seconds = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(seconds)
    ax.yaxis.set_minor_formatter(seconds)
    ax.set_xlabel("link bandwidth (emulated; latency as given)")
    ax.set_ylabel("time to target (s)")
    ax.set_title(title or f"time to {target.describe()} (x on top: missed)")
    if methods:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
