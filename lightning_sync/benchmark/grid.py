"""A comparison's grid: what every run shares (:class:`Grid`), every (link, seed, row) run planned in order (its
folder, overlay and ``fit`` arguments written, :func:`plan_grid`), the workers' warm-up fit, and the runs themselves
(:func:`run_grid`: in worker processes started once, or each its own ``lightning-sync fit``). ``lightning-sync
compare`` (:mod:`lightning_sync.compare`) parses the command line into a grid and runs it."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lightning_sync.benchmark.runs import (
    REFERENCE,
    Row,
    RunResult,
    Target,
    build_command,
    make_row,
    overlay,
    run_one,
    slug,
)
from lightning_sync.benchmark.workers import WARMUP_ARGS, PlannedRun, run_in_workers

__all__ = ["Grid", "place", "plan_grid", "run_grid", "warmup_args"]


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


def plan_grid(
    grid: Grid,
    groups: list[tuple[str, str | None]],
    rows: list[Row],
    rows_for: Callable[[str, int], list[Row]] | None = None,
) -> list[PlannedRun]:
    """Every (link, seed, row) run, in that order (the rows of one seed run back to back, so a change in the
    machine's load falls on all methods alike): its folder, overlay and ``fit`` arguments written, or the reason it
    cannot run. ``rows_for(group, seed)``: the rows of that link and seed, when they are not ``rows`` everywhere
    (``compare --project-ddp``: DDP's step timing in place of its row at a projected link)."""

    def rows_of(group: str, seed: int) -> list[Row]:
        return rows if rows_for is None else rows_for(group, seed)

    planned: list[PlannedRun] = []
    total = sum(len(rows_of(group, seed)) for group, _ in groups for seed in grid.seeds)
    for group, link in groups:
        for seed in grid.seeds:
            for row in rows_of(group, seed):
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
    rows_for: Callable[[str, int], list[Row]] | None = None,
) -> list[RunResult]:
    """Every (link, seed, row) run (:func:`plan_grid`'s order, ``rows_for`` as there); a row that cannot run is a
    failed result, the others still run. With :attr:`Grid.workers` the runs go through worker processes started
    once (:mod:`lightning_sync.benchmark.workers`), else each is its own ``lightning-sync fit``. ``on_done`` is
    called with each run's result as soon as it has one."""
    clock_start = time.perf_counter()
    planned = plan_grid(grid, groups, rows, rows_for)
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
