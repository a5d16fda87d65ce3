"""A comparison's report: its tables and plots per link written from the runs' results (:func:`write_report`), the
``summary.json`` a report and a stopped comparison leave (:func:`write_summary`), and earlier comparisons' runs
re-rendered as one report (:func:`merge`, ``lightning-sync compare --merge``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_sync.benchmark.runs import REFERENCE, RunResult, Target, slug

__all__ = ["merge", "write_report", "write_summary"]


def write_summary(
    out: Path,
    command: str,
    where: str,
    target: Target,
    labels: list[str],
    groups: list[tuple[str, str | None]],
    tables: dict[str, list[dict[str, Any]]] | None,
    group_labels: dict[str, list[str]] | None = None,
) -> Path:
    """``out/summary.json``: the command, where it ran, the target, the rows and links; ``tables`` once the report
    is written (until then ``"complete": false``: the runs so far are in ``runs.csv``); ``group_labels``: the rows
    of the groups whose table has other rows than ``labels`` (``--project-ddp``)."""
    summary: dict[str, Any] = {
        "command": command,
        "where": where,
        "target": {"metric": target.metric, "value": target.value, "mode": target.mode},
        "labels": labels,
        "groups": [list(g) for g in groups],
    }
    if group_labels:
        summary["group_labels"] = group_labels
    if tables is None:
        summary["complete"] = False
    else:
        summary["tables"] = {
            group: [{k: v for k, v in row.items() if k != "summary"} for row in rows] for group, rows in tables.items()
        }
    path = out / "summary.json"
    path.write_text(json.dumps(summary, indent=2, default=str))
    return path


def write_report(
    out: Path,
    groups: list[tuple[str, str | None]],
    labels: list[str],
    results: list[RunResult],
    target: Target,
    where: str,
    command: str,
    group_labels: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """Tables per link (Markdown, CSV), every run (CSV), plots; printed and written under ``out``. ``group_labels``:
    a group's rows where they are not ``labels`` (``--project-ddp``: the projected DDP row, the reference of its
    table, in place of ``ddp``; the step-timing runs in no table)."""
    from lightning_sync.benchmark import plots, tables
    from lightning_sync.benchmark.projection import PROJECTED, projection_legend
    from lightning_sync.comm.link import LinkModel

    out.mkdir(parents=True, exist_ok=True)
    tables.write_runs(results, out / "runs.csv")  # first: a table or plot that fails leaves every run listed
    per_link: dict[str, list[dict[str, Any]]] = {}
    by_bandwidth: dict[float, dict[str, Any]] = {}
    written: list[Path] = []
    for group, link in groups:
        glabels = (group_labels or {}).get(group, labels)
        runs = [r for r in results if r.link == group and (group_labels is None or r.label in glabels)]
        seeds = len({r.seed for r in runs})
        reference = PROJECTED if PROJECTED in glabels else REFERENCE
        rows = tables.table_rows(glabels, runs, reference=reference)
        if reference != REFERENCE:  # the speedups are against a projection: marked so in summary.json too
            for row in rows:
                row["speedup_vs"] = reference
                row["projected"] = row["method"] == reference
        per_link[group] = rows
        folder = out / slug(group)
        folder.mkdir(parents=True, exist_ok=True)
        text = tables.markdown(rows, target, reference=reference)
        note = projection_legend(runs)
        legend = tables.legend(target, seeds, rows) + ("" if note is None else "\n\n" + note)
        (folder / "table.md").write_text(text + "\n\n" + legend + "\n")
        tables.write_csv(rows, folder / "table.csv")
        written += [folder / "table.md", folder / "table.csv"]
        title = f"{where}, link {group}"
        written.append(plots.plot_curves(runs, target, folder / "metric_vs_time.png", title, labels))
        written.append(plots.plot_time_to_target(rows, target, folder / "time_to_target.png", title, labels))
        written.append(plots.plot_sync(runs, folder / "sync_over_steps.png", labels))
        if link is not None:
            by_bandwidth[LinkModel.parse(link).bits_per_second] = {
                row["method"]: row["summary"] for row in rows if "summary" in row
            }
        print(f"\n## lightning-sync compare: {where}, emulated link {group}\n")
        print(text)
        print("\n" + legend)
    written.append(out / "runs.csv")
    if by_bandwidth:
        path = out / "time_to_target_vs_bandwidth.png"
        written.append(plots.plot_bandwidth(by_bandwidth, target, path, labels=labels))
    written.append(write_summary(out, command, where, target, labels, groups, per_link, group_labels))
    print("\nwritten: " + ", ".join(str(p) for p in written))
    return {"tables": per_link, "runs": results, "target": target}


def merge(folders: list[str], out: Path, command: str) -> dict[str, Any]:
    """Re-render the runs of earlier ``compare`` outputs (e.g. one per link, with different seed counts) as one
    report: a table per link and the bandwidth plot over all of them. Each folder's ``summary.json`` and
    ``runs.csv`` say what ran; every run's own records are read again: from its run folder, or, in a committed report
    whose run folders were packed (``benchmarks/pack_records.py``), from the folder's ``records.jsonl.gz``. The
    targets must agree."""
    import csv as _csv

    from lightning_sync.benchmark.ttt import PACKED, outcome, read_packed, read_records

    groups: list[tuple[str, str | None]] = []
    labels: list[str] = []
    group_labels: dict[str, list[str]] = {}
    results: list[RunResult] = []
    targets = set()
    wheres = set()
    for folder in map(Path, folders):
        summary = json.loads((folder / "summary.json").read_text())
        t = summary["target"]
        targets.add((t["metric"], float(t["value"]), t["mode"]))
        wheres.add(summary.get("where", ""))
        groups += [(g, link) for g, link in summary["groups"] if (g, link) not in groups]
        labels += [label for label in summary["labels"] if label not in labels]
        for group, rows in summary.get("group_labels", {}).items():  # a --project-ddp report's groups
            group_labels.setdefault(group, [])
            group_labels[group] += [label for label in rows if label not in group_labels[group]]
        # a committed report's runs: {run folder, relative: packed entry}
        packed = {e["run"]: e for e in read_packed(folder) if "records" in e}
        with (folder / "runs.csv").open() as f:
            for line in _csv.DictReader(f):
                run_dir = Path(line["run_dir"])
                r = RunResult(line["method"], int(line["seed"]), line["link"], run_dir, ok=line["ok"] == "True")
                r.error, r.killed, r.seconds = line["error"], line["killed"] == "True", float(line["seconds"] or 0)
                path = run_dir / "time_to_target.jsonl"
                # the packed run whose folder the run_dir ends with (runs.csv may name it from another directory)
                keys = [k for k in packed if ("/" + run_dir.as_posix()).endswith("/" + k)]
                if path.exists():
                    records = read_records(path)
                elif len(keys) == 1:
                    r.packed = packed[keys[0]]
                    records = r.records
                elif r.ok:  # else it would show as missed: a silently wrong row
                    raise ValueError(
                        f"--merge: {folder}/runs.csv names a run that completed ({line['method']}, seed "
                        f"{line['seed']}), but its records are neither in {path} nor packed in "
                        f"{folder / PACKED}: merge the folders the runs wrote, or the committed report "
                        "with its records.jsonl.gz"
                    )
                else:
                    records = []
                r.outcome = outcome(records) if records else None
                results.append(r)
    if len(targets) != 1:
        raise ValueError(f"--merge: the folders measured different targets {sorted(targets)}; merge one target")
    metric, value, mode = targets.pop()
    where = " / ".join(sorted(wheres))
    return write_report(out, groups, labels, results, Target(metric, value, mode), where, command, group_labels or None)
