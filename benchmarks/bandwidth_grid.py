"""Every method's time to target against link bandwidth, from committed ``compare`` reports (issue 16, item 4).

    python benchmarks/bandwidth_grid.py docs/benchmarks/time_to_target/words/100mbit \\
        docs/benchmarks/time_to_target/words/1gbit_5seeds docs/benchmarks/time_to_target/words/10gbit_all_methods \\
        --out docs/benchmarks/time_to_target/words/bandwidth_grid

``compare --merge`` re-renders earlier runs from their run folders (the records of every evaluation), which live in
the scratch ``--out`` of the machine that ran them. This script needs only what is committed: each report's
``summary.json`` (the tables ``compare`` wrote; per-run records an experiment keeps are packed in its
``records.jsonl.gz`` by ``benchmarks/pack_records.py`` and not read here). It writes ``grid.md``: a row per method,
a column per link, the
speedup against Lightning's DDP **of the same report** (every ratio is measured side by side in one run, never across
runs), the runs that reached the target, and DDP's mean time per link; and ``speedup_vs_bandwidth.png``, those
speedups against bandwidth (log axes, DDP the line at 1, min-max of the ratio as error bars: the slowest run of the
method against DDP's mean and the fastest). The plot shows ratios, not seconds, because the reports may come from
different sessions or machines: a ratio is measured within one run, an absolute time only means something beside
the times of its own run (``compare``'s own ``time_to_target_vs_bandwidth.png`` plots seconds, for links run
together). The reports must measure the same target. A link may come from several reports (DDP's runs at 100 Mbit/s
take most of a session, so its rows are run in parts, each part with its own DDP row): a method may then be in only
one of them, its cell is its ratio to **its own** report's DDP, marked ``[k]`` (the k-th report given for that link),
and DDP's cell lists each report's mean. A method missing at a link is shown as not run, a missed mean as missed (an
``x`` on the plot's bottom edge). ``--drop REPORT=METHOD,...`` leaves those rows of one report out (e.g. rows a later
run re-measured, which then gives that cell; a dropped row no other report gives is shown as left out); the grid
lists what was left out of which report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lightning_sync.benchmark.runs import REFERENCE, Target
from lightning_sync.comm.link import LinkModel

NOT_RUN = "not run"
LEFT_OUT = "left out"  # run, but its row was dropped (--drop) and no other report gives the cell


def read_reports(
    folders: list[Path], keep: list[str] | None = None, drop: dict[Path, list[str]] | None = None
) -> tuple[Target, dict[float, dict[str, Any]], list[str]]:
    """``(target, {bits/s: entry}, methods in order)`` from the reports' ``summary.json``; with ``keep``, only those
    methods' rows (and DDP's), in that order (a name in no report is an error); ``drop`` maps a report folder to
    methods whose rows in that report are left out (not DDP, which every ratio of the report needs; a folder not
    given or a method not in that report is an error).

    An entry is ``{"link", "sources": [folder, ...], "rows": {method: row}, "part": {method: k}, "refs": [ddp row of
    report k, ...], "dropped": {method, ...}}``: every method's row with the index of the report it came from, whose
    DDP row is its reference, and the methods whose rows at this link were dropped.
    """
    targets: set[tuple[str, float, str]] = set()
    links: dict[float, dict[str, Any]] = {}
    methods: list[str] = []
    drop = drop or {}
    unknown = [str(folder) for folder in drop if folder not in folders]
    if unknown:
        raise ValueError(f"--drop: {', '.join(unknown)} is not one of the reports given")
    for folder in folders:
        summary = json.loads((folder / "summary.json").read_text())
        dropped = drop.get(folder, [])
        if REFERENCE in dropped:
            raise ValueError(f"--drop: {REFERENCE} cannot be left out of {folder} (its other rows are ratios to it)")
        present = {row["method"] for table in summary["tables"].values() for row in table}
        absent = [m for m in dropped if m not in present]
        if absent:
            raise ValueError(f"--drop: {', '.join(absent)} not in {folder} (names as in its table)")
        t = summary["target"]
        targets.add((t["metric"], float(t["value"]), t["mode"]))
        for group, link in summary["groups"]:
            if link is None:
                raise ValueError(f"{folder}: group {group!r} ran without an emulated link (a column needs one)")
            bw = LinkModel.parse(link).bits_per_second
            rows = {
                row["method"]: row
                for row in summary["tables"][group]
                if (keep is None or row["method"] == REFERENCE or row["method"] in keep)
                and row["method"] not in dropped
            }
            ref = rows.get(REFERENCE)
            if ref is None or ref.get("mean_s") is None:
                raise ValueError(f"{folder}: link {link!r} has no {REFERENCE} row that reached the target")
            entry = links.setdefault(
                bw, {"link": link, "sources": [], "rows": {}, "part": {}, "refs": [], "dropped": set()}
            )
            entry["dropped"].update(row["method"] for row in summary["tables"][group] if row["method"] in dropped)
            for method in rows:
                if method != REFERENCE and method in entry["rows"]:
                    raise ValueError(
                        f"{method!r} at link {link!r} is in both {entry['sources'][entry['part'][method]]} and "
                        f"{folder}: each cell must come from one run (its speedup is a ratio to that run's "
                        f"{REFERENCE})"
                    )
            part = len(entry["sources"])
            entry["sources"].append(str(folder))
            entry["refs"].append(ref)
            for method, row in rows.items():
                if method != REFERENCE:
                    entry["rows"][method] = row
                    entry["part"][method] = part
            entry["rows"].setdefault(REFERENCE, ref)
            entry["part"].setdefault(REFERENCE, 0)
            # a dropped row keeps its place in the order (its cell reads "left out" where no other report gives it)
            shown = [row["method"] for row in summary["tables"][group]]
            methods += [m for m in shown if m not in methods and (m in rows or m in dropped)]
    if len(targets) != 1:
        raise ValueError(f"the reports measured different targets {sorted(targets)}; give reports of one target")
    if keep is not None:
        missing = [m for m in keep if m not in methods and m != REFERENCE]
        if missing:
            raise ValueError(f"--methods: {', '.join(missing)} in none of the reports (names as in their tables)")
        methods = [REFERENCE] + [m for m in keep if m != REFERENCE]
    metric, value, mode = targets.pop()
    return Target(metric, value, mode), links, methods


def reference_of(entry: dict[str, Any], method: str) -> dict[str, Any]:
    """The DDP row that ``method``'s ratio at this link was measured against: the one of its own report."""
    return entry["refs"][entry["part"][method]]


def plot_speedups(target: Target, links: dict[float, dict[str, Any]], methods: list[str], path: Path) -> Path:
    """Speedup against ddp (of the same report) per bandwidth, log-log, one line per method, each method in its look
    from :func:`lightning_sync.benchmark.plots.styles` (ddp black and solid), the legend outside the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lightning_sync.benchmark.plots import bandwidth_axes, errorbar_line, outside_legend, styles

    fig, ax = plt.subplots(figsize=(9, 5))
    order = sorted(links)
    looks = styles(methods)  # the looks of compare's own plots: ddp black and solid, every method distinct
    handles, names = [], []
    values = [
        row["speedup"] for entry in links.values() for row in entry["rows"].values() if row.get("speedup") is not None
    ]
    bottom = min(values + [1.0]) / 1.5
    for method in methods:
        xs, ys, lo, hi, missed = [], [], [], [], []
        for bw in order:
            row = links[bw]["rows"].get(method)
            if row is None or "reached" not in row:
                continue
            if row.get("speedup") is None:
                missed.append(bw)
                continue
            ref = reference_of(links[bw], method)["mean_s"]
            xs.append(bw)
            ys.append(row["speedup"])
            lo.append(row["speedup"] - (ref / row["max_s"] if row.get("max_s") else bottom))
            hi.append((ref / row["min_s"]) - row["speedup"])
        drawn = errorbar_line(ax, method, looks[method], xs, ys, lo, hi, missed, bottom, method == REFERENCE)
        if drawn is not None:
            handles.append(drawn[0])
            names.append(drawn[1])
    bandwidth_axes(ax, order, lambda v: f"{v:g}x")
    ax.set_xlabel("link bandwidth (emulated; latency as given)")
    ax.set_ylabel(f"speedup vs {REFERENCE} in time to target")
    ax.set_title(f"time to {target.describe()}: speedup vs {REFERENCE} (x at bottom: missed)")
    ax.grid(True, which="major", alpha=0.3)
    outside_legend(ax, handles, names)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return NOT_RUN
    if "reached" not in row:
        return "failed"
    reached = f"{row['reached']}/{row['runs']}"
    if row.get("mean_s") is None:
        return f"missed ({reached})"
    if row["method"] == REFERENCE:
        return f"{row['mean_s']:.1f} s ({reached})"
    return f"{row['speedup']:.2f}x ({reached})"


def _link_cell(entry: dict[str, Any], method: str) -> str:
    """A method's cell at one link; with several reports there, marked with the report (``[k]``) it came from, and
    DDP's cell listing every report's DDP."""
    several = len(entry["sources"]) > 1
    if method == REFERENCE and several:
        return "; ".join(f"{_cell(ref)} [{k + 1}]" for k, ref in enumerate(entry["refs"]))
    row = entry["rows"].get(method)
    if row is None and method in entry.get("dropped", ()):
        return LEFT_OUT
    if row is None or not several:
        return _cell(row)
    return f"{_cell(row)} [{entry['part'][method] + 1}]"


def _sources(entry: dict[str, Any]) -> str:
    if len(entry["sources"]) == 1:
        return f"{entry['link']}: {entry['sources'][0]}"
    return f"{entry['link']}: " + ", ".join(f"[{k + 1}] {src}" for k, src in enumerate(entry["sources"]))


def grid_markdown(
    target: Target, links: dict[float, dict[str, Any]], methods: list[str], drop: dict[Path, list[str]] | None = None
) -> str:
    order = sorted(links)
    head = "| method | " + " | ".join(f"{links[bw]['link']}" for bw in order) + " |"
    lines = [head, "|---|" + "---:|" * len(order)]
    for method in methods:
        lines.append(f"| {method} | " + " | ".join(_link_cell(links[bw], method) for bw in order) + " |")
    several = any(len(links[bw]["sources"]) > 1 for bw in order)
    return "\n".join(lines) + (
        f"\n\nTarget: {target.describe()}. {REFERENCE}'s cell: its mean time to target (runs that reached it / runs); "
        f"every other cell: the speedup against {REFERENCE}'s mean in the same report (the same run), with the runs "
        "that reached the target."
        + (
            f" A link run in several reports: [k] names the report a cell came from, {REFERENCE}'s cell lists each "
            f"report's {REFERENCE}."
            if several
            else ""
        )
        + " Sources: "
        + "; ".join(_sources(links[bw]) for bw in order)
        + "."
        + (
            " Rows left out of a report (--drop): "
            + "; ".join(f"{', '.join(names)} of {folder}" for folder, names in drop.items())
            + "."
            if drop
            else ""
        )
    )


def parse_drop(items: list[str]) -> dict[Path, list[str]]:
    """``--drop REPORT=METHOD,...`` items as ``{report folder: [method, ...]}``."""
    drop: dict[Path, list[str]] = {}
    for item in items:
        folder, sep, names = item.rpartition("=")
        methods = [m.strip() for m in names.split(",") if m.strip()]
        if not sep or not folder or not methods:
            raise ValueError(f"--drop must look like REPORT=METHOD[,METHOD...]; got {item!r}")
        drop.setdefault(Path(folder), []).extend(methods)
    return drop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="compare --out folders (their summary.json)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated rows to show, in this order (ddp always; default: every row of the reports), e.g. to "
        "leave out a report's tuned row from a grid of default rows",
    )
    parser.add_argument(
        "--drop",
        action="append",
        default=[],
        metavar="REPORT=METHOD,...",
        help="leave these rows of one report out (repeatable), e.g. rows a later report re-measured at that link",
    )
    args = parser.parse_args(argv)
    keep = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    drop = parse_drop(args.drop)
    target, links, methods = read_reports(args.reports, keep, drop)
    args.out.mkdir(parents=True, exist_ok=True)
    plot = plot_speedups(target, links, methods, args.out / "speedup_vs_bandwidth.png")
    text = grid_markdown(target, links, methods, drop)
    (args.out / "grid.md").write_text(text + "\n")
    command = "python benchmarks/bandwidth_grid.py " + " ".join(map(str, args.reports)) + f" --out {args.out}"
    if args.methods:
        command += f" --methods {args.methods}"
    command += "".join(f" --drop {item}" for item in args.drop)
    # a link's report folder, or the list of them when it was run in parts
    sources = {e["link"]: e["sources"][0] if len(e["sources"]) == 1 else e["sources"] for e in links.values()}
    (args.out / "summary.json").write_text(json.dumps({"command": command, "sources": sources}, indent=2))
    print(text)
    print(f"\nwritten: {plot}, {args.out / 'grid.md'}, {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
