"""``lightning-sync compare``: the papers' comparison table on your own model.

Each strategy is trained as its own real run (``lightning-sync fit`` in a subprocess, processes launched by
Lightning), with the same configuration, seed and data; then a table in the spirit of SelSync's Table I is printed
and written as CSV and Markdown, with PNG plots. A strategy that fails is reported in the table with its error and
the others still run.

    lightning-sync compare --strategies bsp,selsync,localsgd --devices 2 --link 1gbit,1ms
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

DEFAULT_STRATEGIES = "bsp,selsync,localsgd,adpsgd,fedavg,osp,asp,ssp,aladdin,sync-switch"


@dataclass
class RunResult:
    """What one strategy's run produced."""

    name: str
    ok: bool = False
    error: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)  # metrics.csv rows (step, wall_s, val/..., sync/...)
    seconds: float = 0.0


def _strategy_class_path(name: str) -> str:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_sync.strategies import STRATEGIES

    ours = sorted(c.strategy_name for c in STRATEGIES if c.strategy_name)
    name = name.replace("-", "_")  # "sync-switch" as the papers write it
    if name not in ours:
        raise ValueError(f"unknown or not yet implemented strategy {name!r}; available: {', '.join(ours)}")
    cls = StrategyRegistry[name]["strategy"]
    return f"{cls.__module__}.{cls.__qualname__}"


WORKLOADS = {
    # name: (packaged base config, final metric, curve metric)
    "digits": ("compare_default.yaml", "test/acc", "val/acc"),
    "text": ("compare_text.yaml", "test/ppl", "val/ppl"),
}


def _packaged_config(filename: str) -> str:
    return str(resources.files("lightning_sync") / "configs" / filename)


def lower_is_better(metric: str) -> bool:
    """Loss and perplexity decrease; accuracy-like metrics increase."""
    return any(word in metric for word in ("loss", "ppl", "perplexity", "error"))


def build_command(
    name: str,
    config: str,
    out: Path,
    devices: int,
    link: str | None,
    strategy_args: dict[str, list[str]],
    extra: list[str],
) -> list[str]:
    """The ``lightning-sync fit`` command line of one run."""
    cmd = [
        sys.executable,
        "-m",
        "lightning_sync.cli",
        "fit",
        "--config",
        config,
        f"--trainer.strategy.class_path={_strategy_class_path(name)}",
        f"--trainer.devices={devices}",
        f"--trainer.default_root_dir={out / name}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={out}",
        f"--trainer.logger.init_args.name={name}",
        "--trainer.logger.init_args.version=0",
        f"--summary_json={out / name / 'summary.json'}",
    ]
    if link:
        cmd.append(f"--trainer.strategy.init_args.link={link}")
    for arg in strategy_args.get(name, []):
        cmd.append(f"--trainer.strategy.init_args.{arg}")
    return cmd + extra


def _read_history(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    rows = []
    with path.open() as f:
        for row in csv.DictReader(f):
            rows.append({k: float(v) for k, v in row.items() if v not in ("", None)})
    return rows


def run_one(name: str, cmd: list[str], out: Path, index: int, total: int, cluster: Any = None) -> RunResult:
    """Run one strategy, streaming its progress lines, and collect its summary and metric history.

    With a :class:`~lightning_sync.cluster.NamespaceCluster`, one process per host is started in its namespace
    (``num_nodes`` = hosts, one device each, torchrun-style environment); rank 0's output is streamed."""
    result = RunResult(name)
    (out / name).mkdir(parents=True, exist_ok=True)
    log_path = out / name / "run.log"
    start = time.perf_counter()
    print(f"[compare] ({index}/{total}) {name}: starting", flush=True)
    others: list[subprocess.Popen] = []
    with log_path.open("w") as log:
        if cluster is None:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()
            )
        else:
            from lightning_sync.launch import free_port

            port = free_port()
            node_cmd = [*cmd, f"--trainer.num_nodes={cluster.hosts}", "--trainer.devices=1"]
            proc = cluster.popen(
                0, node_cmd, cluster.env(0, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            others = [
                cluster.popen(i, node_cmd, cluster.env(i, port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for i in range(1, cluster.hosts)
            ]
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[progress]"):
                print(f"[compare] ({index}/{total}) {name}: {line[len('[progress] ') :].rstrip()}", flush=True)
        code = proc.wait()
        for other in others:
            try:
                code = code or other.wait(timeout=120)
            except subprocess.TimeoutExpired:
                other.kill()
                code = code or 1
    result.seconds = time.perf_counter() - start
    summary_path = out / name / "summary.json"
    if code == 0 and summary_path.exists():
        result.ok = True
        result.summary = json.loads(summary_path.read_text())
        result.history = _read_history(out / name / "version_0" / "metrics.csv")
    else:
        tail = log_path.read_text().strip().splitlines()[-3:]
        result.error = " | ".join(tail)[-300:] or f"exit code {code}"
    status = "done" if result.ok else f"FAILED ({result.error})"
    print(f"[compare] ({index}/{total}) {name}: {status} in {result.seconds:.1f}s", flush=True)
    return result


def _metric_curve(history: list[dict[str, float]], metric: str) -> list[tuple[float, float, float]]:
    """(step, wall seconds, value) of ``metric`` over the run; wall time from SyncStats' ``sync/wall_s`` rows."""
    walls = sorted((r["step"], r["sync/wall_s"]) for r in history if "sync/wall_s" in r and "step" in r)
    curve = []
    for r in history:
        if metric in r and "step" in r:
            before = [w for s, w in walls if s <= r["step"]]
            curve.append((r["step"], before[-1] if before else math.nan, r[metric]))
    return curve


def time_to_reach(curve: list[tuple[float, float, float]], target: float, higher_is_better: bool = True) -> float:
    """First wall time at which the metric reaches ``target``; ``nan`` if it never does."""
    for _, wall, value in curve:
        if (value >= target) if higher_is_better else (value <= target):
            return wall
    return math.nan


def summarize(
    results: list[RunResult], metric: str, curve_metric: str, target: float | None = None
) -> list[dict[str, Any]]:
    """One table row per strategy; differences, time to BSP's final metric (or to ``target``) and speedups are
    relative to ``bsp``."""
    higher = not lower_is_better(curve_metric)
    base = next((r for r in results if r.name == "bsp" and r.ok), None)
    base_final = base.summary["test"].get(metric, base.summary["fit"].get(metric)) if base else None
    base_curve = _metric_curve(base.history, curve_metric) if base else []
    base_target = target if target is not None else (base_curve[-1][2] if base_curve else None)
    base_time = time_to_reach(base_curve, base_target, higher) if base_target is not None else math.nan
    rows = []
    for r in results:
        row: dict[str, Any] = {"strategy": r.name}
        if not r.ok:
            row["error"] = r.error
            rows.append(row)
            continue
        fit, test = r.summary["fit"], r.summary["test"]
        final = test.get(metric, fit.get(metric, math.nan))
        curve = _metric_curve(r.history, curve_metric)
        reach = time_to_reach(curve, base_target, higher) if base_target is not None else math.nan
        row.update(
            steps=fit.get("sync/local_steps", 0.0) + fit.get("sync/sync_steps", 0.0),
            lssr=fit.get("sync/lssr", math.nan),
            final=final,
            diff_vs_bsp=final - base_final if base_final is not None else math.nan,
            bytes_per_rank=fit.get("sync/bytes_sent", math.nan),
            blocked_s=fit.get("sync/blocked_s", math.nan),
            wall_s=r.summary["fit_seconds"],
            time_to_bsp_final_s=reach,
            speedup_vs_bsp=base_time / reach if reach and not math.isnan(reach) else math.nan,
        )
        rows.append(row)
    return rows


COLUMNS = [
    ("strategy", "strategy"),
    ("steps", "steps"),
    ("lssr", "LSSR"),
    ("final", "final metric"),
    ("diff_vs_bsp", "diff vs BSP"),
    ("bytes_per_rank", "bytes sent / rank"),
    ("blocked_s", "blocked s"),
    ("wall_s", "wall s"),
    ("time_to_bsp_final_s", "time to BSP's final s"),
    ("speedup_vs_bsp", "speedup vs BSP"),
]


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if key == "bytes_per_rank":
        return f"{value:,.0f}"
    if key == "steps":
        return f"{value:.0f}"
    if key == "speedup_vs_bsp":
        return f"{value:.2f}x"
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"


def markdown(rows: list[dict[str, Any]], metric: str) -> str:
    header = "| " + " | ".join(label if key != "final" else f"final {metric}" for key, label in COLUMNS) + " |"
    lines = [header, "|" + "---|" * len(COLUMNS)]
    for row in rows:
        if "error" in row:
            error = row["error"].replace("|", "/")[:160]
            lines.append(f"| {row['strategy']} | failed: {error} |" + " |" * (len(COLUMNS) - 2))
        else:
            lines.append("| " + " | ".join(_fmt(k, row.get(k)) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    keys = [k for k, _ in COLUMNS] + ["error"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in keys})


def plot(results: list[RunResult], curve_metric: str, out: Path) -> list[Path]:
    """metric vs wall time, metric vs step, and LSSR / period / ICS share over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ok = [r for r in results if r.ok]
    for x_index, x_label, fname in ((1, "wall time (s)", "metric_vs_time.png"), (0, "step", "metric_vs_step.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in ok:
            curve = _metric_curve(r.history, curve_metric)
            ax.plot([c[x_index] for c in curve], [c[2] for c in curve], marker="o", label=r.name)
        ax.set_xlabel(x_label)
        ax.set_ylabel(curve_metric)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=100)
        plt.close(fig)
        paths.append(out / fname)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label in zip(axes, ("sync/lssr", "sync/period", "sync/ics_fraction"), ("LSSR", "period", "ICS share")):
        for r in ok:
            pts = [(h["step"], h[key]) for h in r.history if key in h and "step" in h]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=r.name)
        ax.set_xlabel("step")
        ax.set_title(label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "sync_over_steps.png", dpi=100)
    plt.close(fig)
    paths.append(out / "sync_over_steps.png")
    return paths


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="lightning-sync compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="base LightningCLI YAML (default: the --workload's)")
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="digits",
        help="embedded workload: digits (CNN, accuracy) or text (character Transformer on Python's help, perplexity)",
    )
    parser.add_argument(
        "--strategies", default=DEFAULT_STRATEGIES, help=f"comma-separated names ({DEFAULT_STRATEGIES})"
    )
    parser.add_argument("--devices", type=int, default=2, help="processes per run (>= 1)")
    parser.add_argument("--link", default=None, help="emulated link for every run, e.g. '1gbit,1ms'")
    parser.add_argument(
        "--cluster",
        default=None,
        metavar="HOSTSxRATE",
        help="run on a namespace cluster of HOSTS hosts with kernel rate-limited links, e.g. 4x1gbit (root, Linux; "
        "one process per host, --devices ignored)",
    )
    parser.add_argument("--out", default="runs/compare", help="output folder (table, plots, each run's logs)")
    parser.add_argument(
        "--metric", default=None, help="final metric of the table, logged at test (default: workload's)"
    )
    parser.add_argument("--curve-metric", default=None, help="metric over time and steps, logged at validation")
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="value of the curve metric whose time to reach is reported (default: BSP's final value)",
    )
    parser.add_argument(
        "--strategy-arg",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="an init argument for one strategy, e.g. selsync.delta=0.05 (repeatable)",
    )
    args, extra = parser.parse_known_args(argv)
    if args.devices < 1:
        parser.error("--devices must be >= 1")
    if args.link:
        from lightning_sync.comm.link import LinkModel

        LinkModel.parse(args.link)  # fail now, not in every run
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    strategy_args: dict[str, list[str]] = {}
    for item in args.strategy_arg:
        name, _, rest = item.partition(".")
        if not rest or "=" not in rest:
            parser.error(f"--strategy-arg must look like NAME.KEY=VALUE, got {item!r}")
        strategy_args.setdefault(name, []).append(rest)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base_config, default_metric, default_curve = WORKLOADS[args.workload]
    config = args.config or _packaged_config(base_config)
    args.metric = args.metric or default_metric
    args.curve_metric = args.curve_metric or default_curve
    cluster = None
    if args.cluster:
        from lightning_sync.cluster import NamespaceCluster

        hosts, _, rate = args.cluster.partition("x")
        if not hosts.isdigit() or not rate:
            parser.error(f"--cluster must look like HOSTSxRATE, e.g. 4x1gbit; got {args.cluster!r}")
        cluster = NamespaceCluster(int(hosts), rate).__enter__()
    results = []
    try:
        for i, name in enumerate(names, 1):
            try:
                cmd = build_command(name, config, out, args.devices, args.link, strategy_args, extra)
            except ValueError as err:
                results.append(RunResult(name, error=str(err)))
                print(f"[compare] ({i}/{len(names)}) {name}: FAILED ({err})", flush=True)
                continue
            results.append(run_one(name, cmd, out, i, len(names), cluster))
    finally:
        if cluster is not None:
            cluster.destroy()
    rows = summarize(results, args.metric, args.curve_metric, args.target)
    table = markdown(rows, args.metric)
    (out / "table.md").write_text(table + "\n")
    write_csv(rows, out / "table.csv")
    plots = plot(results, args.curve_metric, out)
    link = args.link or "none"
    where = f"namespace cluster {args.cluster}" if args.cluster else f"{args.devices} processes"
    print(f"\n## lightning-sync compare: {where}, emulated link {link}, base config {config}\n")
    print(table)
    print(f"\nwritten: {out / 'table.md'}, {out / 'table.csv'}, " + ", ".join(str(p) for p in plots))
    return rows
