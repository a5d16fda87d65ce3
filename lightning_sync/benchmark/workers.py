"""Runs of a comparison in worker processes started once (``compare --workers``, the default off a cluster).

A ``compare`` grid is many short fits: on the packaged workloads a run trains for seconds to minutes, and a fresh
``lightning-sync fit`` costs a Python start and a Lightning import (~6 s on this project's 2-core machine) for every
process of every run. Here the ``devices`` processes are started once, torchrun-style (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``: Lightning launches nothing), and each runs the grid's fits one after
the other: the same ``lightning-sync fit`` arguments (base config + the run's overlay), through the same
:class:`~lightning_sync.trainer_cli.SyncCLI`, in the same order as the subprocess mode.

**What this changes for timing, and what it does not.** Time to target is measured by
:class:`~lightning_sync.benchmark.TimeToTarget` from the ``setup`` of ``fit`` in both modes, so neither counts the
interpreter's start. What differs is what is warm when the clock starts: in a fresh process the first fit pays
first-time costs inside its time (lazy initialisation of torch kernels and of gloo's transport, the embedded dataset
read from its package); in a worker those are paid once. So that no row is favoured by where it falls in the order,
every worker start (the first, and a restart after a failed or killed run) begins with an untimed **warm-up fit**:
Lightning's DDP on the workload at the grid's first link and seed, cut to a few steps and one short validation, in
a scratch folder; every timed fit then starts warm. Between fits a worker keeps its default process group
(Lightning creates it at the first fit and reuses it) and nothing else: each fit seeds every generator again
(``seed_everything``), builds its own model, data, strategy and communicator, and the strategies' own process groups
are created per fit. ``tests/test_workers.py`` checks that a run trains the same steps to the same metric values in a
worker as in its own process.

**Failures.** A run that raises on any rank ends the workers (a process group whose peer failed cannot be trusted);
the run is reported failed with its error, and new workers continue with the next run. ``--run-timeout`` kills the
workers when a run exceeds it (what that run recorded still counts) and the next run starts in new workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from lightning_sync.benchmark.runs import RunResult, describe, finish_run

__all__ = ["PlannedRun", "run_in_workers", "worker_main"]

#: the lines a worker (rank 0) prints to tell the parent where it is in the plan
_BEGIN, _END, _FAILED, _WARM = "[worker] begin ", "[worker] end ", "[worker] failed ", "[worker] warm"
#: what cuts the warm-up fit short: a few steps, one short validation, no stop at the target
WARMUP_ARGS = (
    "--trainer.max_epochs=1",
    "--trainer.max_steps=-1",
    "--trainer.limit_train_batches=3",
    "--trainer.limit_val_batches=2",
)


@dataclass
class PlannedRun:
    """One run of the grid: where its result goes, its ``fit`` arguments (after ``lightning-sync``), and its
    progress label. ``args`` is empty for a row that cannot run (``result.error`` says why)."""

    result: RunResult
    args: list[str]
    progress: str


# ---------------------------------------------------------------------------------------------- worker side
def _emit(line: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def worker_main(plan_path: str, start: int) -> None:
    """One worker process: the warm-up fit, then the plan's runs from ``start`` on, each a ``SyncCLI`` fit in this
    process. Exits at once (status 1) when a run raises: the parent starts new workers for the next run."""
    from lightning_sync.comm import destroy_default_group
    from lightning_sync.trainer_cli import cli_main

    plan = json.loads(Path(plan_path).read_text())
    runs: list[dict[str, Any]] = plan["runs"]
    try:
        if plan.get("warmup"):
            cli_main(list(plan["warmup"]))
        _emit(_WARM)
        for index in range(start, len(runs)):
            if not runs[index]["args"]:
                continue
            _emit(f"{_BEGIN}{index}")
            cli_main(list(runs[index]["args"]))
            _emit(f"{_END}{index}")
    except BaseException as err:  # noqa: BLE001  (report it, whatever it is, and leave: the group is not trusted)
        traceback.print_exc()
        message = f"{type(err).__name__}: {err}".replace("\n", " | ")
        _emit(f"{_FAILED}{message[:500]}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    destroy_default_group()


# ---------------------------------------------------------------------------------------------- parent side
def _start_workers(plan_path: Path, start: int, devices: int, logs: Path, nodes: bool) -> list[subprocess.Popen]:
    """``devices`` worker processes, torchrun-style; ``nodes``: each a one-device node of its own (``NODE_RANK=r``,
    ``LOCAL_RANK=0``: the ranks sharing GPU 0), else one node of ``devices`` local ranks."""
    from lightning_sync.launch import free_port

    port = free_port()
    procs: list[subprocess.Popen] = []
    for rank in range(devices):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(devices),
            RANK=str(rank),
            LOCAL_RANK="0" if nodes else str(rank),
            NODE_RANK=str(rank) if nodes else "0",
            PYTHONUNBUFFERED="1",
        )
        cmd = [sys.executable, "-m", "lightning_sync.benchmark.workers", str(plan_path), str(start)]
        if rank == 0:
            out: Any = subprocess.PIPE
        else:
            out = (logs / f"rank{rank}.start{start}.log").open("w")
        procs.append(
            subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        )
    return procs


def run_in_workers(
    planned: list[PlannedRun],
    devices: int,
    out: Path,
    warmup_args: list[str] | None,
    run_timeout: float | None = None,
    clock_start: float | None = None,
    nodes: bool = False,
    on_done: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Run ``planned`` in ``devices`` worker processes started once (again after a failure or a timeout); return
    the results in plan order. ``warmup_args``: the untimed warm-up fit every worker start begins with (``None``:
    none). Prints a progress line per run with the total wall time so far (from ``clock_start``). ``nodes``: each
    worker a one-device node (``NODE_RANK=r``, ``LOCAL_RANK=0``), as ranks sharing one GPU are laid out.
    ``on_done``: called with each run's result as soon as it has one (a run that cannot start too)."""
    from lightning_sync.launch import kill_session

    clock_start = time.perf_counter() if clock_start is None else clock_start
    logs = out / "workers"
    logs.mkdir(parents=True, exist_ok=True)
    plan_path = out / "workers" / "plan.json"
    plan_path.write_text(json.dumps({"warmup": warmup_args, "runs": [{"args": p.args} for p in planned]}, indent=1))
    total = len(planned)
    index = 0
    while index < total:
        if not planned[index].args:  # a row that cannot run: reported, the others still run
            p = planned[index]
            print(f"[compare] {p.progress}: FAILED ({p.result.error})", flush=True)
            if on_done is not None:
                on_done(p.result)
            index += 1
            continue
        procs = _start_workers(plan_path, index, devices, logs, nodes)
        index = _follow(procs, planned, index, logs, run_timeout, clock_start, on_done)
        for proc in procs:
            kill_session(proc)
    return [p.result for p in planned]


def _follow(
    procs: list[subprocess.Popen],
    planned: list[PlannedRun],
    start: int,
    logs: Path,
    run_timeout: float | None,
    clock_start: float,
    on_done: Callable[[RunResult], None] | None = None,
) -> int:
    """Read rank 0's lines until the workers end; fill in the results (each passed to ``on_done``); return the index
    of the next run to start."""
    from lightning_sync.launch import kill_session

    current: int | None = None
    began = 0.0
    log: TextIO = (logs / f"rank0.start{start}.log").open("w")
    finished = start  # every run before this one is done
    lock = threading.Lock()
    state: dict[str, Any] = {"deadline": None, "killed": False}

    def watchdog() -> None:  # a rank that exits with an error, or a run past its timeout, ends every worker
        while all(p.poll() is None for p in procs) or procs[0].poll() is None:
            time.sleep(0.2)
            with lock:
                deadline = state["deadline"]
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed or (deadline is not None and time.perf_counter() > deadline):
                with lock:
                    state["killed"] = not failed
                for p in procs:
                    kill_session(p)
                return

    guard = threading.Thread(target=watchdog, daemon=True)
    guard.start()
    error = ""
    assert procs[0].stdout is not None
    try:
        for line in procs[0].stdout:
            if line.startswith(_BEGIN):
                current = int(line[len(_BEGIN) :])
                began = time.perf_counter()
                log.close()
                run_dir = planned[current].result.run_dir
                run_dir.mkdir(parents=True, exist_ok=True)
                log = (run_dir / "run.log").open("w")
                print(f"[compare] {planned[current].progress}: starting", flush=True)
                with lock:
                    state["deadline"] = None if run_timeout is None else began + run_timeout
                continue
            log.write(line)
            if line.startswith(_END) and current is not None:
                _finish(planned[current], time.perf_counter() - began, 0, "", False, run_timeout, clock_start, on_done)
                finished, current = current + 1, None
                with lock:
                    state["deadline"] = None
            elif line.startswith(_FAILED):
                error = line[len(_FAILED) :].strip()
            elif line.startswith("[progress]") and current is not None:
                print(f"[compare] {planned[current].progress}: {line[len('[progress] ') :].rstrip()}", flush=True)
    finally:
        log.close()
    procs[0].wait()
    guard.join(timeout=5)
    for p in procs:
        kill_session(p)
    if current is not None:  # the run in progress did not end: it failed, or was killed at its timeout
        killed = bool(state["killed"])
        if not error:
            error = _other_rank_error(logs, start) or f"a worker exited with status {procs[0].returncode}"
        _finish(planned[current], time.perf_counter() - began, 1, error, killed, run_timeout, clock_start, on_done)
        return current + 1
    if finished < len(planned) and any(planned[i].args for i in range(finished, len(planned))):
        # the workers ended before the next run began: their start-up (the warm-up fit, a fit of Lightning's DDP on
        # the workload) failed, which no row can get past: every run left is reported failed with that reason
        reason = error or _other_rank_error(logs, start) or f"a worker exited with status {procs[0].returncode}"
        for p in planned[finished:]:
            if p.args:
                _finish(p, 0.0, 1, f"worker start-up failed: {reason}", False, run_timeout, clock_start, on_done)
            else:
                print(f"[compare] {p.progress}: FAILED ({p.result.error})", flush=True)
                if on_done is not None:
                    on_done(p.result)
    return len(planned)


def _other_rank_error(logs: Path, start: int) -> str:
    """The last lines of the first other rank's log that shows a traceback (why a run ended there)."""
    for path in sorted(logs.glob(f"rank*.start{start}.log")):
        text = path.read_text(errors="replace").strip().splitlines()
        if any("Error" in line for line in text[-20:]):
            return f"{path.name}: " + " | ".join(text[-3:])[-300:]
    return ""


def _finish(
    p: PlannedRun,
    seconds: float,
    code: int,
    error: str,
    killed: bool,
    run_timeout: float | None,
    clock_start: float,
    on_done: Callable[[RunResult], None] | None = None,
) -> None:
    result = p.result
    result.seconds = seconds
    result.killed = killed
    finish_run(result, code, error, run_timeout)
    so_far = time.perf_counter() - clock_start
    print(f"[compare] {p.progress}: {describe(result)}; {seconds:.1f}s in all, {so_far:.0f}s so far", flush=True)
    if on_done is not None:
        on_done(result)


if __name__ == "__main__":  # a worker: python -m lightning_sync.benchmark.workers PLAN START
    worker_main(sys.argv[1], int(sys.argv[2]))
