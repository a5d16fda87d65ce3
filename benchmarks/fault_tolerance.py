"""Time to target when a replica is lost: fault-tolerant replica groups (torchft) against stop-and-resume with DDP.

The words workload (``lightning_sync/configs/compare_words.yaml``: a word-level Transformer of 38 MB, validation
perplexity 17 as the target, evaluated every epoch of 25 batches per replica) on ``--groups`` replicas (3) at an
emulated ``--link`` (1 Gbit/s, 1 ms), every process its own (one per replica, started here, one thread each). Rows,
per seed:

* ``plain`` — the method (``--strategy``: local SGD by default, DiLoCo, or BSP — DDP's update every step) without
  fault tolerance: one world of 3 processes;
* ``ft`` — the same method with ``fault_tolerance=FaultTolerance(...)``: 3 replica groups and a lighthouse,
  uninterrupted (against ``plain``: the price of fault tolerance without failures, goal <= 3%);
* ``ft_kill`` — the same, with replica group 1 killed (SIGKILL) when it reaches ``--kill-at`` (30%) of the steps
  ``ft`` needed to reach the target and started again at once: it rejoins at the next sync with its peers' state
  (goal: within 1.15x of ``ft``);
* ``ddp`` — Lightning's DDP (``CountedDDPStrategy``, the same link emulation), uninterrupted;
* ``ddp_kill`` — DDP with rank 1 killed the same way: every rank stops (``PeerFailure``), and all three are started
  again from the last checkpoint (``ModelCheckpoint`` every ``--ckpt-every`` steps, ``last.ckpt``): today's
  stop-and-resume.

A row's **time to target** is the wall time from the launch of its processes (start-up included, as a restarted
process's is) to the end of the first evaluation whose validation perplexity met the target, on any process; then
its processes are stopped. ``ft_kill`` also reports the restarted group's start-up (relaunch to its first step) and
the survivors' longest pause between two steps after the kill (the time they lost: goal <= the start-up plus one
sync). Every process appends its steps and evaluations to ``<out>/<row>/seed<N>/*.jsonl``; ``results.json`` holds
the table's numbers.

    python benchmarks/fault_tolerance.py --seeds 3                                  # the measurement (long)
    python benchmarks/fault_tolerance.py --seeds 1 --max-epochs 3 --limit-train-batches 6 --target 1e9   # a smoke test
    python benchmarks/fault_tolerance.py --rows plain,ft --seeds 3 --max-epochs 4 --target 0  # cost, same steps
    python benchmarks/fault_tolerance.py --strategy diloco --sharded 2 --rows plain,ft,ft_kill   # sharded groups

``--sharded N``: every replica is N processes whose model is sharded with FSDP2 over them (``sharded=True,
replica_size="node"``; the word model's ``configure_model`` shards each encoder layer, the embedding, the projection
and the output layer, then the rest with the root): ``plain`` is one world of ``--groups`` x N processes,
``ft``/``ft_kill`` are ``--groups`` jobs of N processes each (every rank a member of its shard index's torchft
quorum), and ``ft_kill`` kills the whole group 1 (its session: every process of it). The reference rows of a
sharded model are Lightning's own FSDP2 (``ModelParallelStrategy`` over all ``--groups`` x N ranks, the same link
emulation: ``CountedFSDP2Strategy``, compare's ``fsdp2`` row): ``fsdp2`` uninterrupted and ``fsdp2_kill``, node 1 (its
N processes) killed at 30 % of ``fsdp2``'s steps, every rank stopped, all restarted from ``last.ckpt`` (Lightning's
distributed checkpoint directory, saved every ``--ckpt-every`` steps). The DDP rows are refused with ``--sharded``
(DDP does not shard), the FSDP2 rows without it.

    python benchmarks/fault_tolerance.py --strategy diloco --sharded 2 --rows ft,ft_kill,fsdp2,fsdp2_kill
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("plain", "ft", "ft_kill", "ddp", "ddp_kill", "fsdp2", "fsdp2_kill")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------- one process
def worker(cfg: dict[str, Any]) -> None:
    """One process of a row: a replica group (``ft``) or one rank of a world (``plain``, ``ddp``)."""
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch
    import yaml
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_sync  # noqa: F401  (registers the strategy names)
    from lightning_sync import BSPStrategy, DiLoCoStrategy, FaultTolerance, LocalSGDStrategy
    from lightning_sync.compare import packaged_config
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.strategies import CountedDDPStrategy, CountedFSDP2Strategy

    torch.set_num_threads(cfg["threads"])
    out = Path(cfg["dir"])
    me = f"{cfg['who']}{cfg['index']}"
    steps_file = out / f"steps_{me}.jsonl"
    evals_file = out / "evals.jsonl"

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.local_rank:  # a sharded replica's first process speaks for it
                return
            with steps_file.open("a") as f:
                f.write(json.dumps({"pid": os.getpid(), "step": trainer.global_step, "time": time.time()}) + "\n")

        def on_validation_end(self, trainer, pl_module) -> None:
            if trainer.sanity_checking or not trainer.is_global_zero:
                return
            value = float(trainer.callback_metrics.get("val/ppl", math.nan))
            record = {"who": me, "pid": os.getpid(), "step": trainer.global_step, "time": time.time(), "ppl": value}
            with evals_file.open("a") as f:
                f.write(json.dumps(record) + "\n")

    config = yaml.safe_load(packaged_config("words").read_text())

    def build(entry: dict[str, Any]) -> Any:
        # the word model shards itself in configure_model over the mesh a strategy gives it: device_mesh["shard"]
        # (sharded=True) or device_mesh["data_parallel"] (ModelParallelStrategy)
        module, _, name = entry["class_path"].rpartition(".")
        return getattr(importlib.import_module(module), name)(**(entry.get("init_args") or {}))

    timeout = timedelta(seconds=cfg["timeout"])
    kwargs: dict[str, Any] = dict(link=cfg["link"], timeout=timeout, sync_stats=False)
    shards = cfg.get("sharded") or 1  # processes per replica, the model sharded with FSDP2 over them
    if shards > 1:
        kwargs.update(sharded=True, replica_size="node")
    if cfg["kind"] == "ft":
        kwargs["fault_tolerance"] = FaultTolerance(
            lighthouse=cfg["lighthouse"],
            replica_group=cfg["index"],
            replica_groups=cfg["groups"],
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg["timeout"] * 5),
        )
    if cfg["strategy"] == "ddp":
        strategy: Any = CountedDDPStrategy(link=cfg["link"], timeout=timeout)
    elif cfg["strategy"] == "fsdp2":  # Lightning's ModelParallelStrategy, FSDP2 over every rank of every node
        strategy = CountedFSDP2Strategy(link=cfg["link"], timeout=timeout)
    elif cfg["strategy"] == "localsgd":
        strategy = LocalSGDStrategy(**cfg["args"], **kwargs)
    elif cfg["strategy"] == "bsp":
        strategy = BSPStrategy(**cfg["args"], **kwargs)
    else:
        strategy = DiLoCoStrategy(**cfg["args"], **kwargs)
    callbacks: list[pl.Callback] = [Record()]
    if cfg.get("ckpt_every"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=cfg["ckpt_dir"], every_n_train_steps=cfg["ckpt_every"], save_top_k=0, save_last=True
            )
        )
    pl.seed_everything(cfg["seed"], verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=shards,
        num_nodes=1 if cfg["kind"] == "ft" else cfg["world"],
        strategy=strategy,
        max_epochs=cfg["max_epochs"],
        limit_train_batches=cfg["limit_train_batches"],
        check_val_every_n_epoch=1,
        callbacks=callbacks,
        **quiet_trainer_kwargs(enable_checkpointing=bool(cfg.get("ckpt_every"))),
    )
    trainer.fit(build(config["model"]), build(config["data"]), ckpt_path=cfg.get("resume"))


# ----------------------------------------------------------------------------------------------- one row
class Row:
    """The processes of one row and seed, their records, and the row's clock (started at the first launch)."""

    def __init__(self, name: str, seed: int, args: argparse.Namespace) -> None:
        self.name, self.seed, self.args = name, seed, args
        self.dir = Path(args.out) / name / f"seed{seed}"
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob("*.jsonl"):
            stale.unlink()
        self.kind = "ft" if name.startswith("ft") else "dist"
        self.strategy = name.removesuffix("_kill") if name.startswith(("ddp", "fsdp2")) else args.strategy
        self.procs: dict[int, subprocess.Popen] = {}
        self.lighthouse: subprocess.Popen | None = None
        self.t0 = time.time()
        self.port = free_port()
        self.events: dict[str, float] = {}

    def _env(self, index: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["OMP_NUM_THREADS"] = str(self.args.threads)
        if self.kind == "ft":
            return dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        if self.args.sharded > 1:  # a node per replica: Lightning starts its other processes
            return dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), NODE_RANK=str(index))
        world = self.args.groups
        return dict(
            env,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.port),
            WORLD_SIZE=str(world),
            RANK=str(index),
            LOCAL_RANK="0",
            NODE_RANK=str(index),
        )

    def start_lighthouse(self) -> None:
        lport = free_port()
        self.url = f"http://127.0.0.1:{lport}"
        cmd = [sys.executable, "-m", "lightning_sync.cli", "lighthouse", "--bind", f"[::]:{lport}"]
        cmd += ["--min-replicas", "1", "--heartbeat-timeout-ms", str(self.args.heartbeat_ms)]
        path = self.dir / "lighthouse.log"
        with path.open("w") as log:
            self.lighthouse = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # running before the row's clock starts, as a cluster's lighthouse is (and not competing with its start-up)
        deadline = time.time() + 120
        while "lighthouse listening on" not in path.read_text():
            if self.lighthouse.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the lighthouse did not start: {path.read_text()[-2000:]}")
            time.sleep(0.1)

    def launch(self, index: int, resume: str | None = None) -> None:
        a = self.args
        cfg = dict(
            kind=self.kind,
            who="g" if self.kind == "ft" else "r",
            index=index,
            world=a.groups,
            groups=a.groups,
            strategy=self.strategy,
            args=a.strategy_args,
            link=a.link,
            seed=self.seed,
            max_epochs=a.max_epochs,
            limit_train_batches=a.limit_train_batches,
            threads=a.threads,
            timeout=a.timeout,
            dir=str(self.dir),
            lighthouse=getattr(self, "url", None),
            resume=resume,
            sharded=a.sharded,
        )
        if self.strategy in ("ddp", "fsdp2"):
            cfg.update(ckpt_every=a.ckpt_every, ckpt_dir=str(self.dir / "ckpt"))
        log = (self.dir / f"{cfg['who']}{index}.log").open("a")
        self.procs[index] = subprocess.Popen(
            [sys.executable, __file__, "worker", json.dumps(cfg)],
            env=self._env(index),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def steps(self, who: str) -> list[dict[str, Any]]:
        path = self.dir / f"steps_{who}.jsonl"
        return _read_jsonl(path)

    def reached(self) -> dict[str, Any] | None:
        hits = [e for e in _read_jsonl(self.dir / "evals.jsonl") if e["ppl"] <= self.args.target]
        return min(hits, key=lambda e: e["time"]) if hits else None

    def stop(self) -> None:
        for p in [*self.procs.values(), self.lighthouse]:
            if p is not None and p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def run_row(name: str, seed: int, args: argparse.Namespace, kill_step: int | None) -> dict[str, Any]:
    row = Row(name, seed, args)
    who = "g" if row.kind == "ft" else "r"
    try:
        if row.kind == "ft":
            row.start_lighthouse()
        row.t0 = time.time()
        for i in range(args.groups):
            row.launch(i)
        killed = restarted = False
        deadline = row.t0 + args.row_timeout
        while True:
            hit = row.reached()
            if hit is not None:
                break
            if time.time() > deadline:
                print(f"  {name} seed {seed}: no target within {args.row_timeout} s", flush=True)
                break
            if kill_step is not None and not killed:
                mine = row.steps(f"{who}1")
                if mine and mine[-1]["step"] >= kill_step:
                    if args.sharded > 1:  # the whole sharded group: every process of its session
                        os.killpg(row.procs[1].pid, signal.SIGKILL)
                    else:
                        os.kill(row.procs[1].pid, signal.SIGKILL)
                    row.procs[1].wait()
                    row.events["kill"] = time.time()
                    killed = True
                    if row.kind == "ft":  # the lost group comes back at once; the others go on
                        row.launch(1)
                        row.events["relaunch"] = time.time()
                        restarted = True
            if killed and not restarted and row.kind == "dist":
                # DDP: every rank stops (PeerFailure); then all restart from the last checkpoint
                if all(p.poll() is not None for p in row.procs.values()):
                    row.events["all_stopped"] = time.time()
                    for p in row.procs.values():  # a node's other processes, should one outlive its first
                        try:
                            os.killpg(p.pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    last = row.dir / "ckpt" / "last.ckpt"
                    for i in range(args.groups):
                        row.launch(i, resume=str(last) if last.exists() else None)
                    row.events["relaunch"] = time.time()
                    row.events["resumed_from_step"] = _ckpt_step(last)
                    restarted = True
            alive = [p for p in row.procs.values() if p.poll() is None]
            if not alive and (kill_step is None or restarted):
                row.events["end"] = time.time()
                codes = [p.returncode for p in row.procs.values()]
                print(f"  {name} seed {seed}: every process exited (status {codes}) before the target", flush=True)
                break
            time.sleep(0.1)
        hit = row.reached()
        result: dict[str, Any] = {
            "row": name,
            "seed": seed,
            "time_s": None if hit is None else hit["time"] - row.t0,
            "steps": None if hit is None else hit["step"],
            "kill_step": kill_step,
            # the whole run, when it ended before reaching the target (its budget: with an unreachable --target, the
            # rows' wall times compare the methods' costs over the same steps)
            "wall_s": row.events["end"] - row.t0 if "end" in row.events else None,
        }
        if "kill" in row.events:
            result.update(_lost_time(row, who))
        return result
    finally:
        row.stop()


def _ckpt_step(path: Path) -> int | None:
    if not path.is_file():  # none, or a distributed checkpoint's directory (read from the steps: _lost_time)
        return None
    import torch

    return int(torch.load(path, map_location="cpu", weights_only=False).get("global_step", -1))


def _lost_time(row: Row, who: str) -> dict[str, Any]:
    """After the kill: the restarted process's start-up (relaunch to its first step), and the longest pause between
    two steps of a survivor (FT: the time the survivors lost; DDP: the restart of everything)."""
    kill, relaunch = row.events["kill"], row.events.get("relaunch")
    out: dict[str, Any] = {"resumed_from_step": row.events.get("resumed_from_step")}
    if relaunch is not None and row.kind == "dist" and out["resumed_from_step"] is None:
        # a distributed checkpoint (a directory): the step before the relaunched first process's first step
        firsts = [s["step"] for s in row.steps(f"{who}0") if s["time"] >= relaunch]
        out["resumed_from_step"] = firsts[0] - 1 if firsts else None
    if relaunch is not None:
        pid = row.procs[1].pid
        firsts = [s["time"] for s in row.steps(f"{who}1") if s["pid"] == pid]
        out["restart_startup_s"] = (firsts[0] - relaunch) if firsts else None
    pauses = []
    for i in range(row.args.groups):
        if i == 1:
            continue
        times = [s["time"] for s in row.steps(f"{who}{i}")]
        gaps = [b - a for a, b in zip(times, times[1:]) if b >= kill]
        if gaps:
            pauses.append(max(gaps))
    out["survivor_max_pause_s"] = max(pauses) if pauses else None
    return out


# ----------------------------------------------------------------------------------------------- the table
def _mean(values: list[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else statistics.fmean(values)


def table(results: list[dict[str, Any]], rows: list[str]) -> str:
    lines = [
        "| row | time to target (s), per seed | mean | steps | vs ft | restart start-up (s) | longest pause (s) "
        "| whole run without target (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_row = {r: [x for x in results if x["row"] == r] for r in rows}
    ft_mean = _mean([x["time_s"] for x in by_row.get("ft", [])])
    for r in rows:
        xs = by_row[r]
        times = [x["time_s"] for x in xs]
        mean = _mean(times)
        per_seed = ", ".join("missed" if t is None else f"{t:.1f}" for t in times)
        ratio = f"{mean / ft_mean:.3f}x" if mean is not None and ft_mean else ""
        steps = ", ".join("-" if x["steps"] is None else str(x["steps"]) for x in xs)

        def fmt(key: str, xs: list[dict[str, Any]] = xs) -> str:
            vals = [x.get(key) for x in xs if x.get(key) is not None]
            return ", ".join(f"{v:.1f}" for v in vals)

        mean_text = "missed" if mean is None else f"{mean:.1f}"
        lines.append(
            f"| {r} | {per_seed} | {mean_text} | {steps} | {ratio} | {fmt('restart_startup_s')} | "
            f"{fmt('survivor_max_pause_s')} | {fmt('wall_s')} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=("localsgd", "diloco", "bsp"), default="localsgd")
    parser.add_argument(
        "--strategy-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the method's arguments (default for localsgd: period=5 offset=4, a sync ending every epoch of 25; "
        "for diloco: sync_every=5)",
    )
    parser.add_argument(
        "--rows",
        default=None,
        help="which rows, in order (default plain,ft,ft_kill,ddp,ddp_kill; with --sharded "
        "plain,ft,ft_kill,fsdp2,fsdp2_kill)",
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--groups", type=int, default=3, help="replicas (replica groups, or DDP ranks)")
    parser.add_argument(
        "--sharded", type=int, default=1, metavar="N", help="processes per replica, the model sharded over them"
    )
    parser.add_argument("--link", default="1gbit,1ms")
    parser.add_argument("--kill-at", type=float, default=0.3, help="fraction of the uninterrupted run's steps")
    parser.add_argument("--max-epochs", type=int, default=12)
    parser.add_argument("--limit-train-batches", type=int, default=25)
    parser.add_argument("--target", type=float, default=17.0, help="validation perplexity to reach")
    parser.add_argument("--ckpt-every", type=int, default=25, help="DDP's checkpoint period in steps (an epoch)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--timeout", type=int, default=120, help="collective timeout of every row (s)")
    parser.add_argument("--heartbeat-ms", type=int, default=2000, help="the lighthouse's heartbeat timeout")
    parser.add_argument("--row-timeout", type=int, default=3600, help="give up a row after this (s)")
    parser.add_argument("--out", default="runs/fault_tolerance")
    args = parser.parse_args(argv)
    if args.rows is None:
        args.rows = ",".join(ROWS[:5] if args.sharded <= 1 else ROWS[:3] + ROWS[5:])
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        parser.error(f"--rows: unknown {bad}; choose from {', '.join(ROWS)}")
    args.rows = rows
    if args.sharded < 1:
        parser.error(f"--sharded must be >= 1, got {args.sharded}")
    if args.sharded > 1 and any(r.startswith("ddp") for r in rows):
        parser.error("--rows: DDP does not shard a model; with --sharded the reference rows are fsdp2, fsdp2_kill")
    if args.sharded == 1 and any(r.startswith("fsdp2") for r in rows):
        parser.error("--rows: the fsdp2 rows shard the model over every rank: pass --sharded N (N >= 2)")
    defaults = {"localsgd": {"period": 5, "offset": 4}, "diloco": {"sync_every": 5}, "bsp": {}}[args.strategy]
    for item in args.strategy_arg:
        key, eq, value = item.partition("=")
        if not eq:
            parser.error(f"--strategy-arg {item!r}: expected KEY=VALUE")
        try:
            defaults[key] = json.loads(value)
        except json.JSONDecodeError:
            defaults[key] = value
    args.strategy_args = defaults
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = args.max_epochs * args.limit_train_batches
    results: list[dict[str, Any]] = []
    for seed in range(args.seeds):
        for name in args.rows:
            kill_step = None
            if name.endswith("_kill"):
                base = next((x for x in results if x["row"] == name[: -len("_kill")] and x["seed"] == seed), None)
                steps = base["steps"] if base and base["steps"] else budget
                kill_step = max(1, int(round(args.kill_at * steps)))
            print(f"{name} seed {seed}" + (f" (kill at step {kill_step})" if kill_step else ""), flush=True)
            result = run_row(name, seed, args, kill_step)
            print(f"  -> {json.dumps(result)}", flush=True)
            results.append(result)
            (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    text = table(results, args.rows)
    print(
        f"\n{args.strategy} {args.strategy_args}, {args.groups} replicas"
        + (f" of {args.sharded} shards" if args.sharded > 1 else "")
        + f", link {args.link}, target ppl "
        f"{args.target}, kill at {args.kill_at:.0%}\n"
    )
    print(text)
    (out / "table.md").write_text(text + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
