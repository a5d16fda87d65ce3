"""The tables of a time-to-target comparison: one row per method over its seeds (:func:`table_rows`), as Markdown
with its legend and as CSV, and every run in one CSV (:func:`write_runs`). The plots are
:mod:`~lightning_sync.benchmark.plots`."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_sync.benchmark.runs import REFERENCE, RunResult, Target
from lightning_sync.benchmark.ttt import MEMORY_KEYS, Summary, speedup, summarize_runs

__all__ = ["COLUMNS", "MISSED", "legend", "markdown", "table_rows", "write_csv", "write_runs"]

MISSED = "missed"


def _mean(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def table_rows(labels: Sequence[str], results: Sequence[RunResult], reference: str = REFERENCE) -> list[dict[str, Any]]:
    """One row per label (in order): how many runs reached the target, the mean time to target (fastest and slowest
    dropped from 5 runs on; missed unless every run kept reached it), min, max, speedup vs ``reference``, and the
    means over the runs that reached it of steps, bytes sent per rank, blocked and evaluation seconds and LSSR at
    the target, and the best metric value (mean over runs). When some row ran with replica groups, every row also
    has ``inter_bytes``: the bytes a replica sent between replicas (rank 0's ``bytes_inter``; a row without groups,
    every rank a replica, sent all its bytes between replicas: its ``bytes_per_rank``), and the seconds rank 0 was
    blocked inside its replica (``blocked_intra_s``; none without groups) and between replicas
    (``blocked_inter_s``; without groups: its ``blocked_s``)."""
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
            inter_bytes=_mean([o.inter_bytes for o in at]),
            blocked_s=_mean([o.blocked_s for o in at]),
            blocked_intra_s=_mean([o.blocked_intra_s for o in at]),
            blocked_inter_s=_mean([o.blocked_inter_s for o in at]),
            eval_s=_mean([o.eval_s for o in at]),
            lssr=_mean([o.lssr for o in at]),
            best=_mean([o.best for o in ran]),
            state_mb=_mean([o.state_bytes / 1e6 for o in ran]),
            peak_rss_mb=_mean([o.peak_rss_bytes / 1e6 for o in ran]),
        )
        row["summary"] = s
        rows.append(row)
    if any(_has_inter(row) for row in rows):  # replica groups in this table: every row gets the column
        for row in rows:
            if "reached" in row and not _has_inter(row):
                row["inter_bytes"] = row["bytes_per_rank"]
                row["blocked_inter_s"] = row["blocked_s"]
    else:
        for row in rows:
            for key in _GROUPED:
                row.pop(key, None)
    if not any(_has(row, "state_mb") or _has(row, "peak_rss_mb") for row in rows):  # runs recorded before memory
        for row in rows:
            for key in _MEMORY:
                row.pop(key, None)
    return rows


#: the columns a table has only when some row ran with replica groups
_GROUPED = ("inter_bytes", "blocked_intra_s", "blocked_inter_s")


#: the memory columns: only when some run recorded its memory (runs of before it have none)
_MEMORY = ("state_mb", "peak_rss_mb")


def _has(row: dict[str, Any], key: str) -> bool:
    value = row.get(key)
    return value is not None and not math.isnan(value)


def _has_inter(row: dict[str, Any]) -> bool:
    return _has(row, "inter_bytes")


COLUMNS = [
    ("method", "method"),
    ("reached", "reached"),
    ("mean_s", "time to target s"),
    ("min_s", "min s"),
    ("max_s", "max s"),
    ("speedup", "speedup vs ddp"),
    ("steps", "steps"),
    ("bytes_per_rank", "bytes sent / rank"),
    ("inter_bytes", "bytes between replicas / replica"),  # only in tables with replica groups (:func:`table_rows`)
    ("blocked_s", "blocked s"),
    ("blocked_intra_s", "blocked s inside replica"),  # these two only with replica groups, as inter_bytes
    ("blocked_inter_s", "blocked s between replicas"),
    ("eval_s", "eval s"),
    ("lssr", "LSSR"),
    ("best", "best"),
    ("state_mb", "state MB / rank"),  # these two only when the runs recorded their memory
    ("peak_rss_mb", "peak RSS MB"),
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
    if key in ("bytes_per_rank", "inter_bytes"):
        return f"{value:,.0f}"
    if key == "steps":
        return f"{value:.0f}"
    if key in ("lssr",):
        return f"{value:.3f}"
    return f"{value:.4g}" if key == "best" else f"{value:.1f}"


def _columns(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The table's columns: the bytes and blocked seconds per level only when a row ran with replica groups."""
    inter = any("inter_bytes" in row for row in rows)
    memory = any(key in row for row in rows for key in _MEMORY)
    return [(k, label) for k, label in COLUMNS if (k not in _GROUPED or inter) and (k not in _MEMORY or memory)]


def markdown(rows: list[dict[str, Any]], target: Target, reference: str = REFERENCE) -> str:
    """The table as Markdown; a failed method's row says why. ``reference``: the row the speedups are against (its
    name heads their column: ``speedup vs ddp (projected)`` with ``compare --project-ddp``)."""
    columns = _columns(rows)
    labels = [label if key != "best" else f"best {target.metric}" for key, label in columns]
    labels = [f"speedup vs {reference}" if key == "speedup" else label for (key, _), label in zip(columns, labels)]
    lines = ["| " + " | ".join(labels) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        if "reached" not in row:
            error = row.get("error", "no run").replace("|", "/")[:160]
            lines.append(f"| {row['method']} | failed: {error} |" + " |" * (len(columns) - 2))
            continue
        lines.append("| " + " | ".join(_fmt(k, row.get(k), row) for k, _ in columns) + " |")
    return "\n".join(lines)


def legend(target: Target, seeds: int, rows: list[dict[str, Any]] | None = None) -> str:
    """What the table's columns mean (printed under it); ``rows``: the table's, for its optional columns."""
    text = (
        f"Target: {target.describe()} on the validation set. Time to target: wall seconds from the start of fit to the "
        f"end of the first evaluation that met it (evaluation included), mean over {seeds} seed(s)"
        + (" after dropping the fastest and the slowest (*)" if seeds >= 5 else "")
        + "; a run that never met it within its budget is missed, and a mean over a missed run is missed. Speedup: "
        "ddp's mean over the row's. Steps, bytes, blocked and evaluation seconds and LSSR are at the target (means "
        "over the runs that reached it); best: the best value of the metric over the run (mean over runs)."
    )
    if rows is not None and any("state_mb" in row for row in rows):
        text += (
            " State MB / rank: rank 0's parameters, gradients, optimizer and outer-optimizer state (DiLoCo's global "
            "parameters and momentum) in MB (1e6 bytes), counted exactly from their storages (local shards under "
            "FSDP2) at the end of the run; peak RSS MB: its peak resident set size (everything else included: "
            "communication buffers, activations, data, libraries); means over the runs."
        )
    if rows is not None and any("inter_bytes" in row for row in rows):
        text += (
            " Bytes between replicas / replica: with replica groups (replica_size), what rank 0 — the first "
            "replica's leader, the one rank per replica that syncs between replicas — sent outside its replica "
            "(bytes sent / rank also counts the traffic inside the replica); a row without replica groups is one "
            "replica per rank, and all its bytes are sent between replicas. Blocked s inside replica / between "
            "replicas: rank 0's blocked seconds split the same way (a row without replica groups is blocked only "
            "between replicas)."
        )
    return text


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    keys = ["method", "runs"] + [k for k, _ in _columns(rows) if k != "method"] + ["dropped_extremes", "error"]
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
        *MEMORY_KEYS,
        "first_batch",
        "seconds",
        "killed",
        "error",
        "run_dir",
    ]
    inter = any(r.outcome is not None and not math.isnan(r.outcome.inter_bytes) for r in results)
    if inter:  # replica groups in this report: the bytes sent and the seconds blocked per level (rank 0's)
        keys.insert(keys.index("bytes_per_rank") + 1, "inter_bytes")
        keys[keys.index("blocked_s") + 1 : keys.index("blocked_s") + 1] = ["blocked_intra_s", "blocked_inter_s"]
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
                    **{key: "" if math.isnan(getattr(o, key)) else getattr(o, key) for key in MEMORY_KEYS},
                )
                if inter:
                    for key in _GROUPED:
                        value = getattr(o, key)
                        line[key] = "" if math.isnan(value) else value
            writer.writerow(line)
