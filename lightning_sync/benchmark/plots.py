"""The plots of a time-to-target comparison: the metric over wall time per link (the median over seeds per method,
:func:`plot_curves`), a bar chart of the time to target per link (:func:`plot_time_to_target`), the sync behaviour
over steps (:func:`plot_sync`) and time to target against bandwidth (:func:`plot_bandwidth`). Every plot of a report
gives a method the same look (:func:`styles`); :func:`errorbar_line` and :func:`bandwidth_axes` draw a method's
values against bandwidth (also ``benchmarks/bandwidth_grid.py``'s speedups). The tables are
:mod:`~lightning_sync.benchmark.tables`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning_sync.benchmark.runs import REFERENCE, RunResult, Target
from lightning_sync.benchmark.ttt import Summary

__all__ = [
    "bandwidth_axes",
    "errorbar_line",
    "median_curve",
    "outside_legend",
    "plot_bandwidth",
    "plot_curves",
    "plot_sync",
    "plot_time_to_target",
    "rate",
    "styles",
]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------------------------------------- looks
#: the colours of the rows other than the reference, in row order: matplotlib's tab10 without its grey (too close to
#: the reference's black and to the target line)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
#: the reference row (ddp): black and solid in every plot, drawn thicker where it is a line
REFERENCE_STYLE = {"color": "black", "linestyle": "-", "marker": "o"}


def styles(labels: Sequence[str], reference: str = REFERENCE) -> dict[str, dict[str, str]]:
    """One look per label, ``{label: {"color": ..., "linestyle": ..., "marker": ...}}``, so that a method looks the same
    in every plot of a report and no two methods look alike, however many there are.

    Assigned in the order given (the table's row order), deterministically: ``reference`` is black and solid
    (:data:`REFERENCE_STYLE`); the k-th other label (k = 0, 1, ...) gets the colour ``PALETTE[k % 9]``, the line style
    ``LINESTYLES[(k // 9) % 4]`` and the marker ``MARKERS[k % 10]``, so the first 9 differ in colour, the next 9 reuse
    the colours dashed, and so on; the triples are pairwise distinct up to 180 labels, and past that a label whose
    triple is taken gets a colour of its own. A label given twice keeps its first look."""
    looks: dict[str, dict[str, str]] = {}
    used: set[tuple[str, str, str]] = set()
    k = 0
    for label in labels:
        if label in looks:
            continue
        if label == reference:
            looks[label] = dict(REFERENCE_STYLE)
            continue
        look = {
            "color": PALETTE[k % len(PALETTE)],
            "linestyle": LINESTYLES[(k // len(PALETTE)) % len(LINESTYLES)],
            "marker": MARKERS[k % len(MARKERS)],
        }
        j = k
        while (look["color"], look["linestyle"], look["marker"]) in used:  # only past 180 labels
            look["color"] = f"#{(j * 0x9E3779B1) % 0x1000000:06x}"  # an odd multiplier: distinct colours mod 2**24
            j += 1
        used.add((look["color"], look["linestyle"], look["marker"]))
        looks[label] = look
        k += 1
    return looks


def _order(labels: Sequence[str] | None, found: Sequence[str]) -> list[str]:
    """The row order: ``labels`` (the table's rows) first, then any other label in the order found."""
    order = list(dict.fromkeys(labels or []))
    return order + [label for label in dict.fromkeys(found) if label not in order]


def outside_legend(ax: Any, handles: list[Any], names: list[str]) -> None:
    """A legend outside the axes, on the right (two columns past 20 entries), so it never covers data."""
    ax.legend(
        handles,
        names,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        ncol=1 if len(names) <= 20 else 2,
        frameon=False,
        handlelength=3.2,
    )


def _save(fig: Any, path: Path) -> Path:
    plt = _pyplot()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- metric over time
def median_curve(
    seeds: Sequence[tuple[Sequence[float], Sequence[float], bool]], hold_reached: bool = True
) -> tuple[list[float], list[float], list[float], list[float]]:
    """``(times, median, low, high)``: the median over seeds of a metric, and its min and max over the seeds, on the
    union of the seeds' evaluation times.

    ``seeds`` holds one ``(times, values, reached)`` per seed, ``times`` ascending. At a time ``t`` of the grid a seed
    contributes the value of its last evaluation at or before ``t`` (a step function carried forward; no
    interpolation), from its first evaluation to its last. Past its last evaluation it contributes nothing, except
    a seed that ``reached`` the target when ``hold_reached``: ``compare`` stops a run at the target, and dropping the
    fastest seeds from the median once they stop would make it rise again, so that it would cross the target later
    than the runs did; such a seed keeps its last value to the end of the grid (the last evaluation of any seed).
    A NaN value (a diverged evaluation) contributes nothing while it is the seed's latest. Where no seed contributes,
    the three values are NaN (a gap in the line)."""
    import bisect
    import statistics

    clean = [([float(t) for t in times], [float(v) for v in values], reached) for times, values, reached in seeds]
    clean = [(times, values, reached) for times, values, reached in clean if times]
    grid = sorted({t for times, _, _ in clean for t in times})
    median: list[float] = []
    low: list[float] = []
    high: list[float] = []
    for t in grid:
        now = []
        for times, values, reached in clean:
            if t < times[0] or (t > times[-1] and not (hold_reached and reached)):
                continue
            value = values[bisect.bisect_right(times, t) - 1]
            if not math.isnan(value):
                now.append(value)
        median.append(statistics.median(now) if now else math.nan)
        low.append(min(now) if now else math.nan)
        high.append(max(now) if now else math.nan)
    return grid, median, low, high


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _seed_series(result: RunResult, target: Target) -> tuple[list[float], list[float], bool] | None:
    """A run's evaluations as ``(times, values, reached the target)``; None if it recorded none."""
    evals = [rec for rec in result.records if rec.get("event") == "eval"]
    points = sorted((_number(e.get("wall_s")), _number(e.get("value"))) for e in evals)
    points = [(t, v) for t, v in points if not math.isnan(t)]
    if not points:
        return None
    values = [v for _, v in points]
    reached = any(v >= target.value if target.mode == "max" else v <= target.value for v in values if not math.isnan(v))
    return [t for t, _ in points], values, reached


def _curves_figure(
    results: Sequence[RunResult], target: Target, title: str = "", labels: Sequence[str] | None = None
) -> Any:
    """The figure of :func:`plot_curves` (not saved; tests inspect it). Each method's median line is the Line2D whose
    gid is the method's label."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    plt = _pyplot()
    series: dict[str, list[tuple[list[float], list[float], bool]]] = {}
    for r in results:
        s = _seed_series(r, target)
        if s is not None:
            series.setdefault(r.label, []).append(s)
    order = _order(labels, [r.label for r in results])
    looks = styles(order)
    fig, ax = plt.subplots(figsize=(10, 5.5))
    handles: list[Any] = []
    names: list[str] = []
    for i, label in enumerate(order):
        if label not in series:
            continue
        times, median, low, high = median_curve(series[label])
        look = looks[label]
        reference = label == REFERENCE
        ax.fill_between(
            times, low, high, step="post", color=look["color"], alpha=0.14 if reference else 0.08, linewidth=0
        )
        (line,) = ax.plot(
            times,
            median,
            drawstyle="steps-post",
            color=look["color"],
            linestyle=look["linestyle"],
            marker=look["marker"],
            markevery=(0.02 + 0.011 * (i % 8), 0.12),  # a few markers, staggered between methods
            markersize=5,
            linewidth=2.8 if reference else 1.6,
            zorder=4 if reference else 3,
            gid=label,
        )
        handles.append(line)
        names.append(f"{label} (reference, {len(series[label])} seeds)" if reference else label)
    ax.axhline(target.value, linestyle="--", color="grey", linewidth=1.2, zorder=2, gid="target")
    handles += [
        Line2D([], [], linestyle="--", color="grey", linewidth=1.2),
        Patch(facecolor="grey", alpha=0.25, linewidth=0),
    ]
    names += [f"target {target.describe()}", "min-max over seeds"]
    ax.set_xlim(left=0)
    ax.set_xlabel("wall time since the start of fit (s)")
    ax.set_ylabel(target.metric + (" (log scale)" if target.mode == "min" else ""))
    if target.mode == "min":
        from matplotlib.ticker import FuncFormatter, LogFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 20, not 2x10^1
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))  # less if wide
    ax.grid(True, which="both", alpha=0.25)
    seeds = sorted({len(v) for v in series.values()})
    over = "/".join(map(str, seeds)) if seeds else "0"
    ax.set_title(
        (title + "\n" if title else "")
        + f"median over {over} seed(s) of {target.metric}, band min-max over seeds, a seed's last value carried "
        "forward",
        fontsize=10,
    )
    if not series:
        ax.text(0.5, 0.5, "no evaluation recorded", transform=ax.transAxes, ha="center", color="grey")
    outside_legend(ax, handles, names)
    return fig


def plot_curves(
    results: Sequence[RunResult],
    target: Target,
    path: Path,
    title: str = "",
    labels: Sequence[str] | None = None,
) -> Path:
    """The metric against wall time: one line per method, the **median over its seeds** (see :func:`median_curve`:
    on the union of the seeds' evaluation times, each seed's last evaluation carried forward as a step function, a
    seed counted from its first evaluation to its last, or to the end once it reached the target), a shaded band from
    the min to the max over the seeds, the target dashed; ddp thick and black (the reference). Each method has its
    look from :func:`styles` (``labels``: the table's rows, in order, so the looks agree with the report's other
    plots); the legend is outside the axes. A lower-is-better target (``mode == "min"``: loss, perplexity) is drawn
    on a log axis."""
    return _save(_curves_figure(results, target, title, labels), path)


# ---------------------------------------------------------------------------------------------- time to target bars
def _ttt_figure(
    rows: Sequence[dict[str, Any]], target: Target, title: str = "", labels: Sequence[str] | None = None
) -> Any:
    """The figure of :func:`plot_time_to_target` (not saved; tests inspect it). A bar that has a mean is the Rectangle
    whose gid is the method's label; a missed method's bar is gid ``"missed:<label>"``, spanning the axes (its width
    is the axes', not a time); the text beside a bar is gid ``"note:<label>"``."""
    from matplotlib.patches import Rectangle
    from matplotlib.transforms import blended_transform_factory

    plt = _pyplot()
    order = _order(labels, [row["method"] for row in rows])
    looks = styles(order)
    by_method = {row["method"]: row for row in rows}
    shown = [m for m in order if m in by_method]
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.42 * max(len(shown), 1)))
    across = blended_transform_factory(ax.transAxes, ax.transData)  # x: axes fraction, y: the row
    ends = [
        v
        for row in rows
        if row.get("mean_s") is not None
        for v in (row["mean_s"], row.get("max_s") if row.get("max_s") is not None else row["mean_s"])
    ]
    right = max(ends) * 1.35 if ends else 1.0  # room for the notes beside the bars
    height = 0.7
    for y, method in enumerate(shown):
        row = by_method[method]
        reference = method == REFERENCE
        colour = looks[method]["color"]
        if "reached" not in row:  # no run of the method completed
            ax.text(
                0.01,
                y,
                "failed: " + str(row.get("error", "no run"))[:80],
                transform=across,
                va="center",
                fontsize=8,
                color="grey",
                style="italic",
            )
            continue
        runs = f"{row['reached'] or 0}/{row['runs']}"
        mean = row.get("mean_s")
        if mean is None:
            ax.add_patch(
                Rectangle(
                    (0, y - height / 2),
                    1,
                    height,
                    transform=across,
                    fill=False,
                    hatch="///",
                    edgecolor=colour,
                    linewidth=0.8,
                    gid=f"missed:{method}",
                )
            )
            ax.text(
                0.01,
                y,
                f"missed ({runs} reached)",
                transform=across,
                va="center",
                fontsize=9,
                gid=f"note:{method}",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5},
            )
            continue
        (bar,) = ax.barh(y, mean, height=height, color=colour, edgecolor="black" if reference else colour)
        bar.set_gid(method)
        low = row.get("min_s") if row.get("min_s") is not None else mean
        high = row.get("max_s")
        ax.errorbar(
            mean,
            y,
            xerr=[[mean - low], [(high if high is not None else right) - mean]],
            fmt="none",
            ecolor="0.25",
            elinewidth=1,
            capsize=3,
            zorder=3,
        )
        star = " *" if row.get("dropped_extremes") else ""
        if reference:
            note = f"{mean:.1f} s{star}  reference"
        elif row.get("speedup") is not None:
            note = f"{mean:.1f} s{star}  {row['speedup']:.2f}x"
        else:
            note = f"{mean:.1f} s{star}"
        if high is None:
            note += "  (slowest run missed)"
        ax.text(
            (high if high is not None else mean) + right * 0.01,
            y,
            note,
            va="center",
            fontsize=8,
            fontweight="bold" if reference else "normal",
            gid=f"note:{method}",
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
            zorder=4,
        )
    ref = by_method.get(REFERENCE, {}).get("mean_s")
    if ref is not None:  # the reference's mean across the chart: a bar left of it is faster than ddp
        ax.axvline(ref, color="black", linestyle=":", linewidth=1, zorder=1, gid="reference")
    ax.set_yticks(range(len(shown)), [f"{m} (reference)" if m == REFERENCE else m for m in shown])
    for tick in ax.get_yticklabels():
        if tick.get_text() == f"{REFERENCE} (reference)":
            tick.set_fontweight("bold")
    ax.set_ylim(len(shown) - 0.5, -0.5)  # the first row on top, as in the table
    ax.set_xlim(0, right)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    dropped = any(row.get("dropped_extremes") for row in rows)
    ax.set_xlabel(
        "time to target (s): mean over seeds"
        + (" (*: fastest and slowest dropped)" if dropped else "")
        + "; whiskers: fastest to slowest run"
    )
    ax.set_title(
        (title + "\n" if title else "")
        + f"time to {target.describe()}; beside a bar: its mean and speedup vs {REFERENCE} ({REFERENCE}'s mean dotted)",
        fontsize=10,
    )
    return fig


def plot_time_to_target(
    rows: Sequence[dict[str, Any]],
    target: Target,
    path: Path,
    title: str = "",
    labels: Sequence[str] | None = None,
) -> Path:
    """A bar per method of its time to target, from :func:`table_rows`' rows (the table's numbers: the mean of
    :func:`~lightning_sync.benchmark.ttt.summarize_runs`), in the table's row order, top to bottom (so the chart
    reads beside the table): whiskers from the fastest to the slowest run, the mean and the speedup vs ddp beside each
    bar (``2.09x``: ddp's mean over the method's); ddp's bar black and labelled ``reference``. A missed mean is a
    hatched empty bar across the axes labelled ``missed`` (never a number); a method none of whose runs completed
    says ``failed``. Colours from :func:`styles` (``labels``: the table's rows)."""
    return _save(_ttt_figure(rows, target, title, labels), path)


# ---------------------------------------------------------------------------------------------- sync over steps
def _sync_figure(results: Sequence[RunResult], labels: Sequence[str] | None = None) -> Any:
    """The figure of :func:`plot_sync` (not saved); a method's lines have its label as gid."""
    plt = _pyplot()
    first: dict[str, RunResult] = {}
    for r in results:
        first.setdefault(r.label, r)
    order = _order(labels, list(first))
    looks = styles(order)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    handles: dict[str, Any] = {}
    for ax, key, name in zip(axes, ("sync/lssr", "sync/period", "sync/ics_fraction"), ("LSSR", "period", "ICS share")):
        for label in order:
            if label not in first:
                continue
            points = [(h["step"], h[key]) for h in first[label].history if key in h and "step" in h]
            if not points:
                continue
            look = looks[label]
            (line,) = ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                color=look["color"],
                linestyle=look["linestyle"],
                marker=look["marker"],
                markevery=0.15,
                markersize=4,
                linewidth=2.4 if label == REFERENCE else 1.4,
                gid=label,
            )
            handles.setdefault(label, line)
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
    if handles:
        outside_legend(axes[-1], list(handles.values()), list(handles))
    fig.suptitle("sync behaviour over steps (the first seed of each method)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_sync(results: Sequence[RunResult], path: Path, labels: Sequence[str] | None = None) -> Path:
    """LSSR, period and ICS share over steps (``SyncStats``' logged values; the first seed of each method), each
    method in its look from :func:`styles` (``labels``: the table's rows), the legend outside the axes."""
    return _save(_sync_figure(results, labels), path)


# ---------------------------------------------------------------------------------------------- bandwidth
def rate(bits_per_second: float) -> str:
    """A link's bandwidth in bits/s as a tick label: ``1 Gbit/s``, ``100 Mbit/s``."""
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g} {unit}"
    return f"{bits_per_second:g} bit/s"


def errorbar_line(
    ax: Any,
    method: str,
    look: dict[str, str],
    xs: Sequence[float],
    ys: Sequence[float],
    low: Sequence[float],
    high: Sequence[float],
    missed: Sequence[float],
    missed_at: float,
    reference: bool = False,
) -> tuple[Any, str] | None:
    """One method's values against bandwidth: a line through ``(xs, ys)`` with error bars ``low`` below and ``high``
    above each point, in the method's ``look`` (:func:`styles`; thicker and on top for the ``reference``), its line
    given the method's name as gid; each bandwidth in ``missed`` an ``x`` at ``missed_at`` (an edge of the axes: a
    missed value is never a number). Returns the legend's handle and name (``"<method> (missed)"`` when every value
    was missed), or ``None`` when there is nothing to draw."""
    handle = None
    if xs:
        handle = ax.errorbar(
            xs,
            ys,
            yerr=[low, high],
            marker=look["marker"],
            linestyle=look["linestyle"],
            color=look["color"],
            linewidth=2.6 if reference else 1.5,
            capsize=3,
            zorder=4 if reference else 3,
        )
        handle[0].set_gid(method)  # the line through the values (not its caps)
    if missed:
        dots = ax.scatter(missed, [missed_at] * len(missed), marker="x", color=look["color"], zorder=4)
        handle = handle or dots
    if handle is None:
        return None
    return handle, method if xs else f"{method} (missed)"


def bandwidth_axes(ax: Any, bandwidths: Sequence[float], value: Callable[[float], str]) -> None:
    """Log-log axes of a value against link bandwidth: a tick at each of ``bandwidths`` (bits/s) labelled as a rate
    (:func:`rate`), the values' ticks labelled by ``value`` (e.g. ``lambda v: f"{v:g}"``)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(bandwidths, [rate(bw) for bw in bandwidths])
    ax.xaxis.set_minor_formatter(NullFormatter())
    formatter = FuncFormatter(lambda v, _: value(v))
    ax.yaxis.set_major_formatter(formatter)
    ax.yaxis.set_minor_formatter(formatter)


def _bandwidth_figure(
    summaries: dict[float, dict[str, Summary]], target: Target, title: str = "", labels: Sequence[str] | None = None
) -> Any:
    """The figure of :func:`plot_bandwidth` (not saved); a method's line has its label as gid."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    finite = [
        v for per in summaries.values() for s in per.values() for v in (s.mean_s, s.min_s, s.max_s) if v is not None
    ]
    top = max(finite) * 2.0 if finite else 1.0
    found: list[str] = []
    for per in summaries.values():
        found += [m for m in per if m not in found]
    order = _order(labels, found)
    looks = styles(order)
    handles: list[Any] = []
    names: list[str] = []
    for method in order:
        if method not in found:
            continue
        look = looks[method]
        reference = method == REFERENCE
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
        drawn = errorbar_line(ax, method, look, xs, ys, lo, hi, missed, top, reference)
        if drawn is not None:
            handles.append(drawn[0])
            names.append(drawn[1])
    bandwidth_axes(ax, sorted(summaries), lambda v: f"{v:g}")
    ax.grid(True, which="major", alpha=0.3)
    ax.set_xlabel("link bandwidth (emulated; latency as given)")
    ax.set_ylabel("time to target (s)")
    ax.set_title(title or f"time to {target.describe()} (x on top: missed)", fontsize=10)
    if handles:
        outside_legend(ax, handles, names)
    return fig


def plot_bandwidth(
    summaries: dict[float, dict[str, Summary]],
    target: Target,
    path: Path,
    title: str = "",
    labels: Sequence[str] | None = None,
) -> Path:
    """Time to target against link bandwidth (bits/s), log-log, one line per method through its means, min-max as
    error bars; a missed mean is an ``x`` on the top edge (never a number), so where a method starts to beat ddp
    (the crossover) is visible. Each method in its look from :func:`styles` (``labels``: the table's rows, so a
    method failed at one link does not shift the others' looks), the legend outside the axes."""
    return _save(_bandwidth_figure(summaries, target, title, labels), path)
