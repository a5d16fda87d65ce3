"""``lightning-sync compare``: time to a fixed quality target, every method against Lightning's own DDP.

Each method is trained as real runs (``lightning-sync fit`` in a subprocess, processes launched by Lightning) with the
same workload configuration, once per seed and per link; every run stops at the first evaluation that meets the
workload's target (or at its budget). A table per link gives each method's time to target over the seeds (MLPerf
style: mean after dropping the fastest and slowest from 5 seeds on, min, max, runs that reached it; a run that never
does is missed, never a number) and its speedup over ``ddp`` (Lightning's ``DDPStrategy`` under the same emulated
link), with a plot of time to target against bandwidth. A method that fails is reported with its error and the
others still run.

    lightning-sync compare --workload vgg --devices 4 --link 100mbit,1ms --link 1gbit,1ms --link 10gbit,1ms
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from lightning_sync.benchmark.recipes import load_recipe, recipe_path
from lightning_sync.benchmark.runs import (
    REFERENCE,
    Row,
    RunResult,
    Target,
    apply_class_overrides,
    base_lr,
    build_command,
    find_target,
    load_config,
    make_row,
    overlay,
    run_one,
    slug,
)
from lightning_sync.benchmark.workers import WARMUP_ARGS, PlannedRun, run_in_workers
from lightning_sync.comm.compression import COMPRESSIONS


def default_strategies() -> str:
    """``ddp`` and every strategy of the pack (``lightning_sync.strategies.STRATEGIES``, so a new one is a row)."""
    from lightning_sync.strategies import STRATEGIES

    return ",".join([REFERENCE] + [cls.strategy_name for cls in STRATEGIES if cls.strategy_name])


#: name -> (packaged base config, what it is); each config names its target (a TimeToTarget callback), its
#: evaluation frequency (every epoch, epochs sized by limit_train_batches) and its budget (max_epochs)
WORKLOADS = {
    "demo": (
        "compare_demo.yaml",
        "the words model, small (5 MB), on 2 processes: a minute a fit at 100 Mbit/s (lightning-sync demo)",
    ),
    "digits": ("compare_default.yaml", "the demo CNN on scikit-learn's digits: compute-bound, the control"),
    "text": ("compare_text.yaml", "a character Transformer on Python's own help text (perplexity)"),
    "vgg": ("compare_vgg.yaml", "VGG-11-shaped on the digits, the FC head holds the bytes: communication-bound"),
    "words": (
        "compare_words.yaml",
        "a word-level Transformer LM on Python's help text, embedding-heavy: communication-bound (perplexity)",
    ),
}


def packaged_config(workload: str) -> Path:
    """The packaged base config of ``workload``."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(sorted(WORKLOADS))}, got {workload!r}")
    return Path(str(resources.files("lightning_sync") / "configs" / WORKLOADS[workload][0]))


def _strategy_class_path(name: str) -> str:
    """The class path a strategy name runs as (``ddp``: Lightning's DDPStrategy, measured)."""
    from lightning_sync.benchmark.runs import resolve_strategy

    return resolve_strategy(name)[1]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str], argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="lightning-sync compare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="digits",
        help="packaged workload: " + "; ".join(f"{k}: {v[1]}" for k, v in WORKLOADS.items()),
    )
    parser.add_argument("--config", default=None, help="base LightningCLI YAML (default: the --workload's)")
    parser.add_argument(
        "--strategies",
        default=None,
        help="comma-separated registered names; 'ddp': Lightning's DDPStrategy, the reference (default: ddp and "
        "every strategy of the pack); NAME+CODEC (bf16, fp16, int8) adds NAME's compressed row, e.g. localsgd+bf16; "
        "NAME@KEY=VALUE[@...] a row with those arguments, e.g. selsync@vote=exact beside selsync",
    )
    parser.add_argument(
        "--devices", type=int, default=None, help="processes per run (>= 1; default: the config's trainer.devices)"
    )
    parser.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="BANDWIDTH[,LATENCY]",
        help="emulated link for every run, e.g. '1gbit,1ms'; repeat for a bandwidth sweep (a table per link and a "
        "plot of time to target against bandwidth). Default: no emulation",
    )
    parser.add_argument("--seeds", type=int, default=3, help="runs per method, seeds seed-base..seed-base+N-1 (>= 1)")
    parser.add_argument(
        "--seed-base", type=int, default=None, help="first seed (default: the config's seed_everything, or 0)"
    )
    parser.add_argument(
        "--recipes",
        nargs="?",
        const="add",
        choices=["add", "only"],
        default=None,
        help="tuned rows from RECIPES_DIR/<workload>/<strategy>.yaml: 'add' (the default when given) puts "
        "'<strategy> (tuned)' next to each default row that has a recipe; 'only': tuned rows replace the default "
        "rows that have one",
    )
    parser.add_argument(
        "--recipes-dir",
        default="examples/recipes",
        help="the folder of <workload>/<strategy>.yaml recipes (default examples/recipes, read from the current "
        "directory: the repository root); a missing <workload> folder is an error",
    )
    parser.add_argument("--target", type=float, default=None, help="override the config's target value")
    parser.add_argument("--metric", default=None, help="override the config's target metric (a validation metric)")
    parser.add_argument(
        "--no-stop",
        action="store_true",
        help="do not stop a run at the target (train the whole budget, e.g. for complete curves)",
    )
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="kill a run after this long (a budget in wall time on top of the config's max_epochs; what it "
        "recorded counts, so a killed run that had not reached the target is missed)",
    )
    parser.add_argument(
        "--cluster",
        default=None,
        metavar="HOSTS[xPROCS]xRATE",
        help="run on a namespace cluster of HOSTS hosts with kernel rate-limited links, e.g. 4x1gbit, each host "
        "running PROCS processes (default 1) that talk over its loopback, e.g. 2x2x1gbit: 2 nodes of 2 devices, "
        "the link between hosts only (root, Linux; --devices ignored; every method, ddp included, runs as it is: "
        "no emulation; replica_size=node makes each host a replica)",
    )
    parser.add_argument(
        "--accelerator",
        choices=["cpu", "gpu"],
        default=None,
        help="where each run's ranks train (default: the config's trainer.accelerator). gpu: with a GPU per rank, "
        "one each over NCCL; with fewer GPUs than ranks, every rank on GPU 0 over gloo, as one-GPU nodes on one "
        "machine (WORLD_SIZE ranks, NODE_RANK=r, LOCAL_RANK=0; --gpu-layout)",
    )
    parser.add_argument(
        "--gpu-layout",
        choices=["auto", "per-rank", "shared"],
        default="auto",
        help="with --accelerator gpu: 'per-rank' (a GPU each, NCCL), 'shared' (all ranks on GPU 0, gloo, as one-GPU "
        "nodes), 'auto' (per-rank when there are as many GPUs as ranks, else shared)",
    )
    parser.add_argument(
        "--workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the grid in --devices worker processes started once, each fit after an untimed warm-up fit "
        "(default; start-up is paid once, not per run: lightning_sync/benchmark/workers.py says what that changes "
        "for timing); --no-workers: every run is its own 'lightning-sync fit' (always so with --cluster)",
    )
    parser.add_argument("--out", default="runs/compare", help="output folder (tables, plots, every run's files)")
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="FOLDER",
        help="run nothing: re-render the runs of earlier compare outputs as one report in --out (a table per link, "
        "the bandwidth plot over all links), e.g. 5 seeds at 1 Gbit/s and 3 at the other links",
    )
    parser.add_argument(
        "--strategy-arg",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="an init argument for one strategy's rows, e.g. selsync.delta=0.05 (repeatable): its default row and, "
        "with --recipes, its tuned row (over the recipe's arguments)",
    )
    args, extra = parser.parse_known_args(argv)
    if args.devices is not None and args.devices < 1:
        parser.error("--devices must be >= 1")
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.run_timeout is not None and args.run_timeout <= 0:
        parser.error("--run-timeout must be > 0 seconds")
    if args.cluster and args.link:
        parser.error("--cluster runs on kernel rate-limited links; --link would emulate another link on top of them")
    if args.accelerator == "gpu" and args.cluster:
        parser.error("--accelerator gpu with --cluster: the namespace cluster is a CPU harness (one process per host)")
    if args.accelerator == "gpu" and not args.workers:
        parser.error(
            "--accelerator gpu runs in worker processes (the one-GPU-node layout needs them): drop --no-workers"
        )
    if args.recipes and not (Path(args.recipes_dir) / args.workload).is_dir():
        # a missing folder is a wrong place (the default is relative to the current directory), not "no recipes":
        # running the default rows under a tuned table's name would be a silently wrong table
        parser.error(
            f"--recipes: no recipe folder {Path(args.recipes_dir) / args.workload} (--recipes-dir "
            f"{args.recipes_dir!r} is read from {Path.cwd()}); run from the repository root or pass --recipes-dir PATH "
            f"to the folder that holds {args.workload}/<strategy>.yaml"
        )
    return args, extra, parser


def parse_cluster(spec: str, parser: argparse.ArgumentParser) -> tuple[int, int, str]:
    """``--cluster HOSTS[xPROCS]xRATE`` as (hosts, processes per host, rate): ``4x1gbit`` or ``2x2x1gbit``."""
    parts = spec.split("x")
    if len(parts) == 2:
        parts.insert(1, "1")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or int(parts[1]) < 1 or not parts[2]:
        parser.error(
            f"--cluster must look like HOSTSxRATE or HOSTSxPROCSxRATE (PROCS >= 1), e.g. 4x1gbit or 2x2x1gbit; "
            f"got {spec!r}"
        )
    return int(parts[0]), int(parts[1]), parts[2]


def parse_strategy_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """``--strategy-arg NAME.KEY=VALUE`` items as ``{name: ["KEY=VALUE", ...]}`` (``-`` in names read as ``_``)."""
    strategy_args: dict[str, list[str]] = {}
    for item in args.strategy_arg:
        name, _, rest = item.partition(".")
        if not rest or "=" not in rest:
            parser.error(f"--strategy-arg must look like NAME.KEY=VALUE, got {item!r}")
        strategy_args.setdefault(name.replace("-", "_"), []).append(rest)
    return strategy_args


def build_rows(args: argparse.Namespace, workload: str, lr: float | None, parser: argparse.ArgumentParser) -> list[Row]:
    """The table's rows: each named strategy's default row and, with ``--recipes``, its tuned row."""
    names = [n.strip() for n in (args.strategies or default_strategies()).split(",") if n.strip()]
    strategy_args = parse_strategy_args(args, parser)
    rows: list[Row] = []
    for entry in names:
        head, *variant = entry.split("@")
        name, _, codec = head.partition("+")
        key = name.replace("-", "_")
        try:
            default = make_row(name, strategy_args.get(key, []))
            if codec:
                compress_row(default, codec)
            if variant:
                variant_row(default, variant)
        except ValueError as err:  # reported in the table; the other rows still run
            rows.append(Row(label=entry, strategy=name, class_path="", sync_stats=False, error=str(err)))
            continue
        path = recipe_path(args.recipes_dir, workload, default.strategy)
        tuned = None
        if args.recipes and default.strategy != REFERENCE:
            if path.exists():
                tuned = make_row(name, strategy_args.get(key, []), recipe=load_recipe(path), lr=lr)
                if codec:
                    compress_row(tuned, codec)
                if variant:
                    variant_row(tuned, variant)
            else:
                print(
                    f"[compare] no recipe for {default.strategy} on {workload} ({path}): default row only", flush=True
                )
        if args.recipes != "only" or default.strategy == REFERENCE or tuned is None:
            rows.append(default)
        if tuned is not None:
            rows.append(tuned)
    return rows


def variant_row(row: Row, items: list[str]) -> None:
    """Make ``row`` a variant ``<strategy>@KEY=VALUE[@...]`` (``selsync@vote=exact``): those init arguments for this
    row only, labelled ``selsync (vote=exact)`` so it sits beside the strategy's other rows in one table."""
    if row.strategy == REFERENCE:
        raise ValueError("ddp@KEY=VALUE: the ddp row is Lightning's own DDPStrategy, the reference; it has no variants")
    for item in items:
        if "=" not in item or not item.partition("=")[0]:
            raise ValueError(f"a row variant must look like NAME@KEY=VALUE, e.g. selsync@vote=exact; got @{item!r}")
    row.cli_args.extend(items)
    label, tuned = row.label.removesuffix(" (tuned)"), row.label.endswith(" (tuned)")
    row.label = f"{label} ({', '.join(items)})" + (" (tuned)" if tuned else "")


def compress_row(row: Row, codec: str) -> None:
    """Make ``row`` the compressed variant ``<strategy>+<codec>`` (``localsgd+bf16``): the strategy's
    ``compression`` argument set to ``codec``, labelled so it sits beside the uncompressed row."""
    if codec not in COMPRESSIONS:
        raise ValueError(f"compression suffix '+{codec}' must be one of {', '.join(COMPRESSIONS)} (e.g. localsgd+bf16)")
    if row.strategy == REFERENCE:
        raise ValueError(
            "ddp+<codec>: the ddp row is Lightning's own DDPStrategy under the link-emulation communication hook; "
            "compressing its buckets would need a second hook on top of it. Compare against a compressed "
            "lightning_sync row instead (bsp+bf16 is DDP's update with bf16 all-reduces)"
        )
    if any(arg.partition("=")[0] == "compression" for arg in row.cli_args) or "compression" in row.init_args:
        raise ValueError(
            f"{row.strategy}+{codec}: compression is also set by --strategy-arg or the recipe; set it once"
        )
    row.cli_args.append(f"compression={codec}")
    row.label = f"{row.strategy}+{codec}" + (" (tuned)" if row.tuned else "")


def _link_groups(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(label, emulated link) of each group of runs: one per --link, or one without emulation / on the cluster."""
    if args.cluster:
        return [(f"cluster {args.cluster}", None)]
    if not args.link:
        return [("none", None)]
    from lightning_sync.comm.link import LinkModel

    for spec in args.link:
        LinkModel.parse(spec)  # fail now, not in every run
    return [(spec, spec) for spec in args.link]


@dataclass
class Grid:
    """What every run of a comparison shares: the base config (as written to ``out``), the target, the seeds, the
    devices, the extra ``fit`` arguments, whether runs stop at the target, a wall-time cap and the cluster."""

    config: dict[str, Any]
    base_path: Path
    target: Target
    seeds: list[int]
    devices: int
    out: Path
    extra: list[str] = field(default_factory=list)
    stop: bool = True
    run_timeout: float | None = None
    cluster: Any = None
    procs_per_host: int = 1  #: processes on every host of the cluster (Trainer devices; num_nodes = hosts)
    workers: bool = True  #: run in worker processes started once (not on a cluster): benchmark/workers.py
    accelerator: str | None = None  #: "gpu": every rank on a GPU (see ``shared_gpu``); None: the config's
    shared_gpu: bool = False  #: every rank on GPU 0 over gloo, as one-GPU nodes on one machine


def plan_grid(grid: Grid, groups: list[tuple[str, str | None]], rows: list[Row]) -> list[PlannedRun]:
    """Every (link, seed, row) run, in that order (the rows of one seed run back to back, so a change in the
    machine's load falls on all methods alike): its folder, overlay and ``fit`` arguments written, or the reason it
    cannot run."""
    planned: list[PlannedRun] = []
    total = len(groups) * len(grid.seeds) * len(rows)
    for group, link in groups:
        for seed in grid.seeds:
            for row in rows:
                run_dir = grid.out / slug(group) / slug(row.label) / f"seed{seed}"
                result = RunResult(row.label, seed, group, run_dir)
                progress = f"({len(planned) + 1}/{total}) {group} {row.label} seed {seed}"
                if row.error:  # unknown strategy: reported, the others still run
                    result.error = row.error
                    planned.append(PlannedRun(result, [], progress))
                    continue
                run_dir.mkdir(parents=True, exist_ok=True)
                over = place(grid, overlay(grid.config, row, seed, run_dir, grid.devices, link, grid.target, grid.stop))
                overlay_path = run_dir / "overlay.yaml"
                overlay_path.write_text(yaml.safe_dump(over, sort_keys=False))
                cmd = build_command(grid.base_path, overlay_path, row, run_dir, grid.extra)
                (run_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
                planned.append(PlannedRun(result, cmd[3:], progress))  # after "python -m lightning_sync.cli"
    return planned


def warmup_args(grid: Grid, groups: list[tuple[str, str | None]]) -> list[str]:
    """The untimed warm-up fit each worker start begins with: Lightning's DDP (the reference row, which any
    workload config must run: a row's own bad argument must not fail the warm-up) at the first link and seed, cut
    short (:data:`~lightning_sync.benchmark.workers.WARMUP_ARGS`), in ``out/workers/warmup``."""
    row = make_row(REFERENCE)
    run_dir = grid.out / "workers" / "warmup"
    run_dir.mkdir(parents=True, exist_ok=True)
    over = place(
        grid, overlay(grid.config, row, grid.seeds[0], run_dir, grid.devices, groups[0][1], grid.target, False)
    )
    overlay_path = run_dir / "overlay.yaml"
    overlay_path.write_text(yaml.safe_dump(over, sort_keys=False))
    return build_command(grid.base_path, overlay_path, row, run_dir, grid.extra)[3:] + list(WARMUP_ARGS)


def place(grid: Grid, over: dict[str, Any]) -> dict[str, Any]:
    """A run's overlay with ``--accelerator``: ``gpu`` with a GPU per rank as it is (Lightning's NCCL); with the ranks
    sharing GPU 0, each rank a one-GPU node (``devices=1``, ``num_nodes`` = ranks) over gloo, which carries CUDA
    tensors (the layout ``tests/test_gpu.py`` and ``benchmarks/overhead.py`` use on a one-GPU machine)."""
    if grid.accelerator is None:
        return over
    trainer = over["trainer"]
    trainer["accelerator"] = grid.accelerator
    if grid.shared_gpu:
        trainer["devices"], trainer["num_nodes"] = 1, grid.devices
        init_args = trainer["strategy"].setdefault("init_args", {})
        init_args["process_group_backend"] = "gloo"
    return over


def run_grid(
    grid: Grid,
    groups: list[tuple[str, str | None]],
    rows: list[Row],
    on_done: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Every (link, seed, row) run (:func:`plan_grid`'s order); a row that cannot run is a failed result, the others
    still run. With :attr:`Grid.workers` the runs go through worker processes started once
    (:mod:`lightning_sync.benchmark.workers`), else each is its own ``lightning-sync fit``. ``on_done`` is called
    with each run's result as soon as it has one."""
    clock_start = time.perf_counter()
    planned = plan_grid(grid, groups, rows)
    if grid.workers and grid.cluster is None:
        return run_in_workers(
            planned,
            grid.devices,
            grid.out,
            warmup_args(grid, groups),
            grid.run_timeout,
            clock_start,
            grid.shared_gpu,
            on_done,
        )
    results: list[RunResult] = []
    for p in planned:
        if not p.args:
            print(f"[compare] {p.progress}: FAILED ({p.result.error})", flush=True)
            results.append(p.result)
        else:
            cmd = [sys.executable, "-m", "lightning_sync.cli", *p.args]
            results.append(
                run_one(p.result, cmd, p.progress, grid.cluster, grid.run_timeout, clock_start, grid.procs_per_host)
            )
        if on_done is not None:
            on_done(results[-1])
    return results


def prepare(args: argparse.Namespace, extra: list[str], parser: argparse.ArgumentParser) -> Grid:
    """The grid of a parsed ``compare`` command line: the base config (with ``--model``/``--data`` class changes
    applied, their init_args reset), the target, the seeds; the base config is written to ``out``."""
    config_path = Path(args.config) if args.config else packaged_config(args.workload)
    if not config_path.exists():
        parser.error(f"--config {config_path}: no such file")
    config = load_config(config_path)
    config, extra, notes = apply_class_overrides(config, extra)
    try:
        target = find_target(config, args.metric, args.target)
    except ValueError as err:
        parser.error(str(err))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base_path = out / "base_config.yaml"
    base_path.write_text(f"# {config_path}, as compare ran it\n" + yaml.safe_dump(config, sort_keys=False))
    for note in notes:
        print(f"[compare] {note}", flush=True)
    seed_base = args.seed_base if args.seed_base is not None else int(config.get("seed_everything") or 0)
    if args.devices is None:
        devices = (config.get("trainer") or {}).get("devices", 2)
        args.devices = devices if isinstance(devices, int) and devices >= 1 else 2
    return Grid(
        config=config,
        base_path=base_path,
        target=target,
        seeds=[seed_base + i for i in range(args.seeds)],
        devices=args.devices,
        out=out,
        extra=extra,
        stop=not args.no_stop,
        run_timeout=args.run_timeout,
        workers=args.workers,
        accelerator=args.accelerator,
        shared_gpu=args.accelerator == "gpu" and _shared_gpu(args.gpu_layout, args.devices, parser),
    )


def _shared_gpu(layout: str, devices: int, parser: argparse.ArgumentParser) -> bool:
    """Whether the ranks share GPU 0 (over gloo) rather than one GPU each (NCCL)."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        parser.error("--accelerator gpu: no CUDA GPU on this machine")
    if layout == "per-rank" and gpus < devices:
        parser.error(f"--gpu-layout per-rank needs a GPU per rank: {devices} ranks, {gpus} GPU(s); use shared")
    return layout == "shared" or (layout == "auto" and gpus < devices)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the grid (or, with ``--merge``, re-render earlier runs); returns ``{"tables": {link: rows}, "runs":
    [RunResult], "target": Target}``."""
    argv = list(sys.argv[2:] if argv is None else argv)
    args, extra, parser = parse_args(argv)
    command = "lightning-sync compare " + shlex.join(argv)
    if args.merge:
        return merge(args.merge, Path(args.out), command)
    try:
        groups = _link_groups(args)
    except ValueError as err:
        parser.error(str(err))
    grid = prepare(args, extra, parser)
    rows = build_rows(args, args.workload, base_lr(grid.config), parser)
    if args.cluster:
        hosts, procs, rate = parse_cluster(args.cluster, parser)
        grid.procs_per_host = procs
    where = f"namespace cluster {args.cluster}" if args.cluster else f"{args.devices} processes"
    labels = [r.label for r in rows]
    # what ran, written as the runs finish: a compare stopped before its report (killed, interrupted, an error
    # while rendering) leaves runs.csv and summary.json, which `--merge` re-renders
    _write_summary(grid.out, command, where, grid.target, labels, groups, tables=None)
    done: list[RunResult] = []

    def on_done(result: RunResult) -> None:
        from lightning_sync.benchmark import report

        done.append(result)
        report.write_runs(done, grid.out / "runs.csv")

    if args.cluster:
        from lightning_sync.cluster import NamespaceCluster

        grid.cluster = NamespaceCluster(hosts, rate).__enter__()
    try:
        results = run_grid(grid, groups, rows, on_done)
    finally:
        if grid.cluster is not None:
            grid.cluster.destroy()
    return write_report(grid.out, groups, labels, results, grid.target, where, command)


def _write_summary(
    out: Path,
    command: str,
    where: str,
    target: Target,
    labels: list[str],
    groups: list[tuple[str, str | None]],
    tables: dict[str, list[dict[str, Any]]] | None,
) -> Path:
    """``out/summary.json``: the command, where it ran, the target, the rows and links; ``tables`` once the report
    is written (until then ``"complete": false``: the runs so far are in ``runs.csv``)."""
    summary: dict[str, Any] = {
        "command": command,
        "where": where,
        "target": {"metric": target.metric, "value": target.value, "mode": target.mode},
        "labels": labels,
        "groups": [list(g) for g in groups],
    }
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
) -> dict[str, Any]:
    """Tables per link (Markdown, CSV), every run (CSV), plots; printed and written under ``out``."""
    from lightning_sync.benchmark import report
    from lightning_sync.comm.link import LinkModel

    out.mkdir(parents=True, exist_ok=True)
    report.write_runs(results, out / "runs.csv")  # first: a table or plot that fails leaves every run listed
    tables: dict[str, list[dict[str, Any]]] = {}
    by_bandwidth: dict[float, dict[str, Any]] = {}
    written: list[Path] = []
    for group, link in groups:
        runs = [r for r in results if r.link == group]
        seeds = len({r.seed for r in runs})
        rows = report.table_rows(labels, runs)
        tables[group] = rows
        folder = out / slug(group)
        folder.mkdir(parents=True, exist_ok=True)
        text = report.markdown(rows, target)
        (folder / "table.md").write_text(text + "\n\n" + report.legend(target, seeds, rows) + "\n")
        report.write_csv(rows, folder / "table.csv")
        written += [folder / "table.md", folder / "table.csv"]
        title = f"{where}, link {group}"
        written.append(report.plot_curves(runs, target, folder / "metric_vs_time.png", title, labels))
        written.append(report.plot_time_to_target(rows, target, folder / "time_to_target.png", title, labels))
        written.append(report.plot_sync(runs, folder / "sync_over_steps.png", labels))
        if link is not None:
            by_bandwidth[LinkModel.parse(link).bits_per_second] = {
                row["method"]: row["summary"] for row in rows if "summary" in row
            }
        print(f"\n## lightning-sync compare: {where}, emulated link {group}\n")
        print(text)
        print("\n" + report.legend(target, seeds, rows))
    written.append(out / "runs.csv")
    if by_bandwidth:
        path = out / "time_to_target_vs_bandwidth.png"
        written.append(report.plot_bandwidth(by_bandwidth, target, path, labels=labels))
    written.append(_write_summary(out, command, where, target, labels, groups, tables))
    print("\nwritten: " + ", ".join(str(p) for p in written))
    return {"tables": tables, "runs": results, "target": target}


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
    return write_report(out, groups, labels, results, Target(metric, value, mode), " / ".join(sorted(wheres)), command)
