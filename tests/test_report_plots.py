"""The plots of a `compare` report on synthetic runs (in-process, fast, Agg): one distinct look per method in every
plot, the median-over-seeds curves against wall time, the time-to-target bar chart (missed never a number, speedups
against ddp) and the report writing it beside each table."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from lightning_sync.benchmark import plots, tables  # noqa: E402
from lightning_sync.benchmark.runs import RunResult, Target  # noqa: E402
from lightning_sync.benchmark.ttt import Outcome, summarize_runs  # noqa: E402

PPL = Target("val/ppl", 17.0, "min")


def _look(artist) -> tuple:
    return to_rgba(artist.get_color()), artist.get_linestyle(), artist.get_marker()


def _expected(style: dict[str, str]) -> tuple:
    return to_rgba(style["color"]), style["linestyle"], style["marker"]


def _run(tmp_path: Path, label: str, seed: int, evals: list[tuple[float, float]], ok: bool = True) -> RunResult:
    """A run whose records hold these ``(wall_s, value)`` evaluations of val/ppl."""
    run_dir = tmp_path / label / f"seed{seed}"
    run_dir.mkdir(parents=True)
    records = [{"event": "start", "metric": "val/ppl", "target": 17.0, "mode": "min", "seed": seed}]
    records += [{"event": "eval", "step": 10 * i, "wall_s": t, "value": v} for i, (t, v) in enumerate(evals, 1)]
    (run_dir / "time_to_target.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return RunResult(label, seed, "1gbit,1ms", run_dir, ok=ok)


# ddp's 3 seeds: seed 0 reaches the target (<= 17) at 5 s and stops there, seed 1 starts late (its first evaluation
# at 2 s) and ends at 4 s without reaching it, seed 2 reaches the target at 6 s
DDP_SEEDS = [
    [(1.0, 30.0), (3.0, 20.0), (5.0, 16.0)],
    [(2.0, 28.0), (4.0, 18.0)],
    [(1.0, 32.0), (2.0, 25.0), (6.0, 16.5)],
]
# by hand, on the grid of their evaluation times 1..6 s, each seed's last value carried forward:
# 1 s: 30, 32 | 2 s: 30, 28, 25 | 3 s: 20, 28, 25 | 4 s: 20, 18, 25 | 5 s: 16, 25 (seed 1 ended without the target)
# 6 s: 16 (seed 0 reached it: held), 16.5
DDP_MEDIAN = [31.0, 28.0, 25.0, 20.0, 20.5, 16.25]
DDP_LOW = [30.0, 25.0, 20.0, 18.0, 16.0, 16.0]
DDP_HIGH = [32.0, 30.0, 28.0, 25.0, 25.0, 16.5]


def test_styles_are_pairwise_distinct_for_any_number_of_rows_and_ddp_is_black_solid():
    for n in range(1, 41):
        labels = [f"method{i}" for i in range(n - 1)]
        labels.insert(n // 2, "ddp")
        looks = plots.styles(labels)
        assert list(looks) == labels
        triples = {(to_rgba(s["color"]), s["linestyle"], s["marker"]) for s in looks.values()}
        assert len(triples) == n, n
        assert to_rgba(looks["ddp"]["color"]) == to_rgba("black") and looks["ddp"]["linestyle"] == "-"
        assert all(to_rgba(s["color"]) != to_rgba("black") for label, s in looks.items() if label != "ddp")
        assert plots.styles(labels) == looks  # deterministic
    # the first rows differ in colour; ddp's place does not change the others' looks
    assert len({s["color"] for s in plots.styles([f"m{i}" for i in range(9)]).values()}) == 9
    assert plots.styles(["ddp", "a", "b"])["b"] == plots.styles(["a", "b", "ddp"])["b"]
    many = plots.styles([f"m{i}" for i in range(400)])  # past the 180 triples of the palette: still distinct
    assert len({(s["color"], s["linestyle"], s["marker"]) for s in many.values()}) == 400


def test_median_curve_by_hand_three_seeds():
    seeds = [([t for t, _ in s], [v for _, v in s], min(v for _, v in s) <= 17.0) for s in DDP_SEEDS]
    times, median, low, high = plots.median_curve(seeds)
    assert times == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert median == DDP_MEDIAN and low == DDP_LOW and high == DDP_HIGH
    # without holding the seeds that reached the target, each seed stops at its last evaluation
    _, median, _, _ = plots.median_curve(seeds, hold_reached=False)
    assert median[-1] == 16.5
    # a NaN evaluation counts for nothing while it is the seed's latest; where no seed has a value, a gap
    times, median, low, _ = plots.median_curve([([1.0, 2.0], [math.nan, 20.0], False), ([3.0], [10.0], False)])
    assert times == [1.0, 2.0, 3.0] and math.isnan(median[0]) and median[1:] == [20.0, 10.0] and low[2] == 10.0


def test_plot_curves_draws_one_median_line_per_method_in_its_style(tmp_path):
    results = [_run(tmp_path, "ddp", seed, evals) for seed, evals in enumerate(DDP_SEEDS)]
    results += [_run(tmp_path, "localsgd", seed, [(1.0, 25.0), (2.0 + seed, 16.0)]) for seed in range(3)]
    results.append(RunResult("nope", 0, "1gbit,1ms", tmp_path / "nope", error="unknown strategy"))  # no records
    labels = ["ddp", "nope", "localsgd"]
    fig = plots._curves_figure(results, PPL, "test", labels)
    try:
        ax = fig.axes[0]
        lines = {line.get_gid(): line for line in ax.get_lines() if line.get_gid() in labels}
        assert sorted(lines) == ["ddp", "localsgd"]  # one line per method with evaluations
        assert len([line for line in ax.get_lines() if line.get_gid() in labels]) == 2
        looks = plots.styles(labels)
        for label, line in lines.items():
            assert _look(line) == _expected(looks[label])
        assert lines["ddp"].get_linewidth() > lines["localsgd"].get_linewidth()  # the reference emphasised
        assert list(lines["ddp"].get_xdata()) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        assert list(lines["ddp"].get_ydata()) == DDP_MEDIAN
        # localsgd: 25 until each seed reaches 16 at 2, 3, 4 s (held): median 25, 16, 16 at 2, 3, 4 s
        assert list(lines["localsgd"].get_ydata()) == [25.0, 25.0, 16.0, 16.0]
        (target,) = [line for line in ax.get_lines() if line.get_gid() == "target"]
        assert list(target.get_ydata()) == [17.0, 17.0] and target.get_linestyle() == "--"
        assert ax.get_yscale() == "log"  # lower is better (perplexity)
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend[:2] == ["ddp (reference, 3 seeds)", "localsgd"]
        bbox = ax.get_legend().get_bbox_to_anchor().transformed(ax.transAxes.inverted())
        assert bbox.x0 > 1.0  # outside the axes: never over the data
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def _rows(times: dict[str, list[float | None]]) -> list[dict]:
    results = []
    for label, seeds in times.items():
        for seed, t in enumerate(seeds):
            r = RunResult(label, seed, "1gbit,1ms", Path("/nonexistent"), ok=label != "nope", error="")
            if label == "nope":
                r.error = "unknown strategy"
            else:
                r.outcome = Outcome(reached=t is not None, time_s=t)
            results.append(r)
    return tables.table_rows(list(times), results)


def test_time_to_target_bars_missed_never_a_number_ddp_marked_speedups_against_ddp(tmp_path):
    times = {
        "ddp": [10.0, 12.0, 14.0],
        "localsgd": [4.0, 5.0, 6.0],
        "asp": [10.0, None, 20.0],
        "bsp": [20.0, 24.0, 28.0],
        "nope": [None],
    }
    rows = _rows(times)
    fig = plots._ttt_figure(rows, PPL, "test")
    try:
        ax = fig.axes[0]
        bars = {p.get_gid(): p for p in ax.patches if isinstance(p, Rectangle) and p.get_gid()}
        notes = {t.get_gid()[5:]: t.get_text() for t in ax.texts if (t.get_gid() or "").startswith("note:")}
        # a bar per method with a mean, as long as the table's mean (summarize_runs)
        for label in ("ddp", "localsgd", "bsp"):
            assert bars[label].get_width() == pytest.approx(summarize_runs(times[label]).mean_s)
        # missed: no bar with a length, a hatched bar across the axes labelled missed, no time anywhere in its label
        assert "asp" not in bars
        missed = bars["missed:asp"]
        assert missed.get_hatch() and not missed.get_fill() and missed.get_width() == 1
        fig.canvas.draw()
        span, axes = missed.get_window_extent(), ax.get_window_extent()
        assert (span.x0, span.x1) == pytest.approx((axes.x0, axes.x1))  # its width is the axes', not seconds
        assert notes["asp"] == "missed (2/3 reached)"
        assert "nope" not in bars and any(t.get_text().startswith("failed") for t in ax.texts)
        # ddp: black, named the reference; the others never black
        assert to_rgba(bars["ddp"].get_facecolor()) == to_rgba("black") and "reference" in notes["ddp"]
        assert to_rgba(bars["localsgd"].get_facecolor()) != to_rgba("black")
        assert "ddp (reference)" in [t.get_text() for t in ax.get_yticklabels()]
        # speedup labels: ddp's mean over the method's
        for label in ("localsgd", "bsp"):
            (speedup,) = re.findall(r"([0-9.]+)x", notes[label])
            assert speedup == f"{12.0 / summarize_runs(times[label]).mean_s:.2f}"
        assert notes["localsgd"] == "5.0 s  2.40x" and notes["bsp"] == "24.0 s  0.50x"
        # rows top to bottom in the table's order
        ticks = [t.get_text() for t in ax.get_yticklabels()]
        assert ticks == ["ddp (reference)", "localsgd", "asp", "bsp", "nope"]
        assert ax.yaxis_inverted()
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_bandwidth_and_sync_plots_give_each_method_the_same_look(tmp_path):
    labels = ["ddp", "nope", "selsync", "localsgd"]
    looks = plots.styles(labels)
    summaries = {
        1e8: {"ddp": summarize_runs([40.0]), "selsync": summarize_runs([None]), "localsgd": summarize_runs([8.0])},
        1e9: {"ddp": summarize_runs([10.0]), "selsync": summarize_runs([6.0]), "localsgd": summarize_runs([5.0])},
    }
    fig = plots._bandwidth_figure(summaries, PPL, labels=labels)
    try:
        lines = {line.get_gid(): line for line in fig.axes[0].get_lines() if line.get_gid()}
        assert sorted(lines) == ["ddp", "localsgd", "selsync"]
        for label, line in lines.items():
            assert _look(line) == _expected(looks[label])
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    results = []
    for label in ("selsync", "localsgd"):
        r = _run(tmp_path, label, 0, [(1.0, 20.0)])
        logs = r.run_dir / "logs" / "version_0"
        logs.mkdir(parents=True)
        (logs / "metrics.csv").write_text("step,sync/lssr,sync/period\n1,0.5,2\n2,0.6,2\n")
        results.append(r)
    fig = plots._sync_figure(results, labels)
    try:
        lines = [line for ax in fig.axes for line in ax.get_lines()]
        assert {line.get_gid() for line in lines} == {"selsync", "localsgd"} and len(lines) == 4  # LSSR, period
        for line in lines:
            assert _look(line) == _expected(looks[line.get_gid()])
    finally:
        plt.close(fig)


def test_write_report_writes_the_bar_chart_beside_each_table(tmp_path):
    from lightning_sync.benchmark.merge import write_report

    results = [_run(tmp_path / "runs", "ddp", seed, evals) for seed, evals in enumerate(DDP_SEEDS)]
    results += [_run(tmp_path / "runs", "localsgd", seed, [(1.0, 25.0), (2.0 + seed, 16.0)]) for seed in range(3)]
    for r in results:
        from lightning_sync.benchmark.ttt import outcome, read_records

        r.outcome = outcome(read_records(r.run_dir / "time_to_target.jsonl"))
    out = tmp_path / "out"
    write_report(out, [("1gbit,1ms", "1gbit,1ms")], ["ddp", "localsgd"], results, PPL, "test", "test")
    for name in ("table.md", "metric_vs_time.png", "time_to_target.png", "sync_over_steps.png"):
        assert (out / "1gbit-1ms" / name).stat().st_size > 0, name
    assert (out / "time_to_target_vs_bandwidth.png").stat().st_size > 0
