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
import shlex
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from lightning_sync.benchmark.grid import Grid, run_grid
from lightning_sync.benchmark.merge import merge, write_report, write_summary
from lightning_sync.benchmark.recipes import load_recipe, recipe_path
from lightning_sync.benchmark.runs import (
    FSDP2,
    LIGHTNING_ROWS,
    REFERENCE,
    Row,
    RunResult,
    apply_class_overrides,
    base_lr,
    find_target,
    load_config,
    make_row,
)
from lightning_sync.comm.compression import COMPRESSIONS, check_compression


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
    "words_wide": (
        "compare_words_wide.yaml",
        "words 4.3x wider (160 MB: embedding 8192, width 384), so that sharding it matters (perplexity)",
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
        "every strategy of the pack); 'fsdp2': Lightning's ModelParallelStrategy, FSDP2 over all ranks (a model "
        "whose configure_model shards, e.g. --workload words); NAME+CODEC (bf16, fp16, int8, int4, int2, "
        "topk:FRACTION, topk:FRACTION+int2 (or +int4, +int8)) adds NAME's compressed row, e.g. localsgd+bf16; "
        "NAME@KEY=VALUE[@...] a row with those arguments, e.g. "
        "selsync@vote=exact beside selsync",
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
    parser.add_argument(
        "--project-ddp",
        action="append",
        default=[],
        metavar="LINK",
        help="at this --link (repeatable), project ddp's time to target instead of running it there (and fsdp2's, "
        "when it is a row): its steps from its run without a link (table 'none'), its per-step and per-evaluation "
        "time at LINK from a run of --project-epochs epochs (or --project-steps steps) beside the other rows; the "
        "row 'ddp (projected)', the table's reference (lightning_sync/benchmark/projection.py)",
    )
    parser.add_argument(
        "--project-epochs", type=int, default=1, help="epochs of each --project-ddp step-timing run (>= 1; default 1)"
    )
    parser.add_argument(
        "--project-steps",
        type=int,
        default=None,
        metavar="N",
        help="time N steps instead (one epoch of N batches and its evaluation; >= 4: the first 2 are left out)",
    )
    parser.add_argument(
        "--project-measured",
        type=int,
        default=1,
        metavar="N",
        help="with --project-ddp: also run ddp to the target at the link for the first N seeds, the row 'ddp "
        "(measured)', to check the projection (0 <= N <= --seeds; default 1)",
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
    if args.project_ddp:
        if args.cluster:
            parser.error("--project-ddp needs ddp's run without a link for its steps; on --cluster every run crosses "
                         "the cluster's links: drop --project-ddp (or run it with --link)")  # fmt: skip
        missing = [link for link in args.project_ddp if link not in args.link]
        if missing:
            parser.error(f"--project-ddp {missing[0]}: not one of the --link values {args.link}; give it as --link too")
        if args.project_epochs < 1:
            parser.error("--project-epochs must be >= 1")
        if args.project_steps is not None and args.project_steps < 4:
            parser.error(f"--project-steps must be >= 4 (the first 2 steps are left out), got {args.project_steps}")
        if not 0 <= args.project_measured <= args.seeds:
            parser.error(f"--project-measured must be in 0..--seeds ({args.seeds}), got {args.project_measured}")
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
    if "," in spec:
        parser.error(
            f"--cluster {spec}: the namespace cluster's links are rate-limited only (tbf): a latency cannot be added "
            "in the kernel here (no netem), and the emulated link's latency on top of them would be hidden behind the "
            "real transfer for asynchronous collectives (DDP's buckets) but not for blocking ones. Give the rate "
            "alone (e.g. 4x25mbit), or use --link 25mbit,50ms for the emulated link with its latency"
        )
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
        if args.recipes and default.strategy not in LIGHTNING_ROWS:
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
        if args.recipes != "only" or default.strategy in LIGHTNING_ROWS or tuned is None:
            rows.append(default)
        if tuned is not None:
            rows.append(tuned)
    return rows


def variant_row(row: Row, items: list[str]) -> None:
    """Make ``row`` a variant ``<strategy>@KEY=VALUE[@...]`` (``selsync@vote=exact``): those init arguments for this
    row only, labelled ``selsync (vote=exact)`` so it sits beside the strategy's other rows in one table."""
    if row.strategy in LIGHTNING_ROWS:
        own = "DDPStrategy" if row.strategy == REFERENCE else "ModelParallelStrategy (FSDP2 over all ranks)"
        raise ValueError(
            f"{row.strategy}@KEY=VALUE: the {row.strategy} row is Lightning's own {own}, the reference; it has no "
            "variants"
        )
    for item in items:
        if "=" not in item or not item.partition("=")[0]:
            raise ValueError(f"a row variant must look like NAME@KEY=VALUE, e.g. selsync@vote=exact; got @{item!r}")
    row.cli_args.extend(items)
    label, tuned = row.label.removesuffix(" (tuned)"), row.label.endswith(" (tuned)")
    row.label = f"{label} ({', '.join(items)})" + (" (tuned)" if tuned else "")


def compress_row(row: Row, codec: str) -> None:
    """Make ``row`` the compressed variant ``<strategy>+<codec>`` (``localsgd+bf16``): the strategy's
    ``compression`` argument set to ``codec``, labelled so it sits beside the uncompressed row."""
    given = codec
    try:
        codec = check_compression(codec) or ""
    except ValueError:
        codec = ""
    if not codec:
        raise ValueError(
            f"compression suffix '+{given}' must be one of {', '.join(COMPRESSIONS)}, or topk:<fraction> with "
            "0 < fraction < 1, optionally with narrow values +int8, +int4 or +int2 (e.g. localsgd+bf16, "
            "diloco+topk:0.01, localsgd+topk:0.02+int2)"
        )
    if row.strategy == FSDP2:
        raise ValueError(
            "fsdp2+<codec>: the fsdp2 row is Lightning's own ModelParallelStrategy (FSDP2's all-gathers and "
            "reduce-scatters as FSDP2 runs them); compare against a compressed sharded row instead (e.g. "
            "bsp+bf16@sharded=true@replica_size=2)"
        )
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
    plan = None
    if args.project_ddp:
        from lightning_sync.benchmark.projection import ProjectionPlan

        if not any(r.label == REFERENCE and not r.error for r in rows):
            parser.error("--project-ddp projects the ddp row: add ddp to --strategies")
        references = tuple(x for x in LIGHTNING_ROWS if any(r.label == x and not r.error for r in rows))
        plan = ProjectionPlan(
            tuple(args.project_ddp),
            args.project_epochs,
            args.project_measured,
            tuple(grid.seeds),
            references=references,
            steps=args.project_steps,
        )
        groups = plan.groups(groups)
    if args.cluster:
        hosts, procs, rate = parse_cluster(args.cluster, parser)
        grid.procs_per_host = procs
    where = f"namespace cluster {args.cluster}" if args.cluster else f"{args.devices} processes"
    labels = [r.label for r in rows]
    group_labels = None if plan is None else plan.group_labels(labels)
    # what ran, written as the runs finish: a compare stopped before its report (killed, interrupted, an error
    # while rendering) leaves runs.csv and summary.json, which `--merge` re-renders
    write_summary(grid.out, command, where, grid.target, labels, groups, tables=None, group_labels=group_labels)
    done: list[RunResult] = []

    def on_done(result: RunResult) -> None:
        from lightning_sync.benchmark import tables

        done.append(result)
        tables.write_runs(done, grid.out / "runs.csv")

    if args.cluster:
        from lightning_sync.cluster import NamespaceCluster

        grid.cluster = NamespaceCluster(hosts, rate).__enter__()
    try:
        results = run_grid(grid, groups, rows, on_done, None if plan is None else plan.rows_for(rows))
    finally:
        if grid.cluster is not None:
            grid.cluster.destroy()
    if plan is not None:
        from lightning_sync.benchmark.projection import project

        results += project(results, plan, grid.out)
    return write_report(grid.out, groups, labels, results, grid.target, where, command, group_labels)
