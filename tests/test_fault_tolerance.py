"""Fault-tolerant replica groups on torchft (``fault_tolerance=FaultTolerance(...)``): a run survives a lost replica.

Real processes, a real lighthouse, a real SIGKILL: the test starts ``lightning-sync lighthouse`` on a free port and
three replica groups (``tests/ft_worker.py``, one process each, its own session and rendezvous port), kills one with
SIGKILL in the middle of an epoch and, in the first case, starts it again — with local SGD, streaming DiLoCo, FedAvg
and ADPSGD, with groups of two processes each (a node as one replica: the whole node killed), and with two sharded
groups of two processes (sharded DiLoCo and BSP: every rank a member of its shard index's quorum). Asserted:

* the survivors never restart (one process each, exit status 0) and keep stepping: their step counters go 1, 2, ...
  to the end with no gap, and they sync with two replica groups while the third is gone;
* the restarted group resumes from its peers' state, not from scratch (its first step is a step of theirs), and after
  its first sync holds exactly what they hold (checksums of parameters and buffers at the same torchft step);
* every group reaches the digits workload's target (validation accuracy 0.95) and ends with the same model;
* a checkpoint the restarted group takes after the rejoin resumes (global step, schedule and torchft step go on);
* a group that never comes back: the others finish with one replica group fewer;
* the lighthouse unreachable at start: a clear error naming it, not a hang (on both processes of a two-process group);
  a strategy or argument that cannot run fault-tolerant, two processes that are not one replica, or a replica group
  configured differently from its peers, sharded groups with different shard counts: an error saying why;
* sharded groups: every shard ends bit-identical to the same shard of the other group, and each rank sent its own
  shard's bytes between the groups.

Nothing depends on the machine's speed: the survivors step slowly (a file the workers look at) until the restarted
group has rejoined, every wait is bounded generously and fails the test as a hang, and no duration is asserted.
``LIGHTNING_SYNC_SLOW_TESTS=1`` adds DiLoCo, FedAvg and ADPSGD killed and restarted (about a minute each: kept out of
CI's 30 minutes), local SGD's group that never returns, and the lighthouse gone during the run (every group stops at
its next sync with a clear error).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from launch import free_port

from lightning_sync.launch import kill_session

pytest.importorskip("torchft", reason='fault tolerance needs the "ft" extra: pip install -e ".[ft]"')

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("ft_worker.py")
SLOW = os.environ.get("LIGHTNING_SYNC_SLOW_TESTS") == "1"
GROUPS = 3
TARGET = 0.95  # the digits workload's target (lightning_sync/configs/compare_default.yaml)
KILL_AT = 23  # the victim's global step when it is killed: the middle of its second epoch (14 steps per epoch)
LIMIT_S = 400  # any wait: start-up of four Lightning processes and the whole run on a loaded 2-core machine
RUNS = {
    # period 4, syncing after every 4th step (steps 3, 7, ...): DiLoCo's schedule, torchft's LocalSGD's
    "localsgd": dict(args={"period": 4, "offset": 3, "verify_sync": True}, max_steps=90),
    # an outer optimizer with momentum: its state (and the global parameters) travel to a restarted group
    "diloco": dict(
        args={"sync_every": 4, "outer_optimizer": {"name": "sgd", "lr": 0.7, "momentum": 0.5, "nesterov": True}},
        max_steps=126,
    ),
    # streaming: 2 fragments, each all-reduce in flight for one step over the quorum, committed when applied
    "diloco_streaming": dict(
        args={
            "sync_every": 4,
            "fragments": 2,
            "delay": 1,
            "outer_optimizer": {"name": "sgd", "lr": 0.7, "momentum": 0.5, "nesterov": True},
            "verify_sync": True,
        },
        max_steps=126,
    ),
    # 2 of the 3 groups (2 of 2 while one is gone) drawn per round among the quorum's members, 4 rounds per epoch
    "fedavg": dict(args={"fraction": 0.6, "syncs_per_epoch": 4}, max_steps=90),
    # period 1 for the first epoch, then adapting from S_k, all-reduced over the quorum inside each sync's commit
    "adpsgd": dict(args={"p_init": 2, "warmup_epochs": 1, "max_period": 6, "verify_sync": True}, max_steps=90),
    # DDP's semantics: the gradients averaged over the quorum every step (a quorum at every step's end)
    "bsp": dict(args={"verify_sync": True}, max_steps=126),
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class Run:
    """A lighthouse and replica-group processes in ``out``; everything it started is killed at the end."""

    def __init__(self, out: Path, strategy: str, groups: int = GROUPS) -> None:
        self.out = out
        self.strategy = strategy
        self.groups = groups
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def lighthouse(self) -> None:
        log = self.out / "lighthouse.log"
        cmd = [sys.executable, "-m", "lightning_sync.cli", "lighthouse", "--bind", f"[::]:{self.port}"]
        cmd += ["--min-replicas", "1", "--join-timeout-ms", "3000", "--heartbeat-timeout-ms", "1500"]
        self._popen(cmd, log)

    def group(self, group: int, tag: str = "", **extra) -> subprocess.Popen:
        cfg = dict(
            strategy=self.strategy,
            lighthouse=self.url,
            group=group,
            groups=self.groups,
            out=str(self.out),
            slow=0.3,
            connect_timeout=60,
            save=str(self.out / f"end_g{group}{tag}.ckpt"),
            **RUNS[self.strategy],
        )
        cfg.update(extra)
        return self._popen([sys.executable, str(WORKER), json.dumps(cfg)], self.out / f"g{group}{tag}.log")

    def _popen(self, cmd: list[str], log: Path) -> subprocess.Popen:
        env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        self.logs.append(log)
        with log.open("w") as f:
            proc = subprocess.Popen(
                cmd, env=env, cwd=self.out, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def progress(self, group: int) -> list[dict]:
        path = self.out / f"progress_g{group}.jsonl"
        if not path.exists():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                break
        return records

    def wait_until(self, what: str, done, watch: list[subprocess.Popen]) -> None:
        deadline = time.monotonic() + LIMIT_S
        while not done():
            if any(p.poll() is not None for p in watch):
                pytest.fail(f"a process exited while waiting for {what}\n{self.dump()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {LIMIT_S} s (hang)\n{self.dump()}")
            time.sleep(0.05)

    def finish(self, procs: list[subprocess.Popen]) -> list[int]:
        deadline = time.monotonic() + LIMIT_S
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"a replica group still runs {LIMIT_S} s on (hang)\n{self.dump()}")
        return [p.returncode for p in procs]

    def results(self, group: int) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.out.glob(f"result_g{group}_*.json"))]

    def dump(self) -> str:
        return "\n".join(f"--- {log.name} (last 3000 chars)\n{log.read_text()[-3000:]}" for log in self.logs)

    def close(self) -> None:
        for p in self.procs:
            kill_session(p)


@pytest.fixture
def run_dir(tmp_path):
    runs: list[Run] = []

    def make(strategy: str, groups: int = GROUPS) -> Run:
        run = Run(tmp_path, strategy, groups)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()


def _by_pid(records: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in records:
        out.setdefault(r["pid"], []).append(r)
    return out


def _committed_syncs(records: list[dict]) -> dict[int, list[int]]:
    """torchft step -> checksum of the parameters and buffers right after the sync that committed it."""
    return {r["ft_step"]: r["checksum"] for r in records if r["synced"] and r["committed"]}


def _start_and_kill(
    run: Run, restart: bool, procs_per_group: int = 1, kill_at: int = KILL_AT, **extra
) -> tuple[list[subprocess.Popen], subprocess.Popen | None, int]:
    """Start the lighthouse and the groups, SIGKILL every process of group 1 at ``kill_at`` (a node lost), start it
    again if ``restart``."""
    (run.out / "slow").touch()  # every group steps slowly until the test says otherwise
    run.lighthouse()
    procs = [run.group(g, procs=procs_per_group, **extra) for g in range(run.groups)]
    victim = procs[1]
    run.wait_until(
        f"replica group 1 at step {kill_at}", lambda: any(r["step"] >= kill_at for r in run.progress(1)), procs
    )
    os.killpg(victim.pid, signal.SIGKILL)  # the group's session: its first process and those Lightning started
    assert victim.wait(timeout=60) == -signal.SIGKILL
    killed_at = max(r["step"] for r in run.progress(1))
    back = None
    if restart:
        back = run.group(1, tag="b", procs=procs_per_group, **extra)
        run.wait_until(
            "the restarted replica group's first step",
            lambda: any(r["pid"] == back.pid for r in run.progress(1)),
            [p for g, p in enumerate(procs) if g != 1] + [back],
        )
    (run.out / "slow").unlink()
    return procs, back, killed_at


def _check_survivors(run: Run, codes: list[int], survivors: list[int], max_steps: int, kill_at: int = KILL_AT) -> None:
    dump = run.dump()
    for g in survivors:
        assert codes[g] == 0, f"replica group {g} exited with {codes[g]}\n{dump}"
        runs = _by_pid(run.progress(g))
        assert len(runs) == 1, f"replica group {g} restarted ({len(runs)} processes)"
        steps = [r["step"] for r in next(iter(runs.values()))]
        assert steps == list(range(1, max_steps + 1)), f"replica group {g}'s steps have a gap: {steps}"
        syncs = [r for r in run.progress(g) if r["synced"]]
        assert any(r["replicas"] == run.groups - 1 for r in syncs), f"group {g} never synced without the lost group"
        assert all(r["committed"] for r in syncs if r["step"] > kill_at + 8), "a sync failed well after the kill"
        (result,) = run.results(g)
        assert result["val_acc"] >= TARGET, f"replica group {g} ends at validation accuracy {result['val_acc']}"
        assert result["global_step"] == max_steps


@pytest.mark.timeout(3 * LIMIT_S)
@pytest.mark.parametrize(
    "strategy",
    [
        "localsgd",
        "diloco_streaming",
        "bsp",
        *(
            pytest.param(name, marks=pytest.mark.skipif(not SLOW, reason="LIGHTNING_SYNC_SLOW_TESTS=1"))
            for name in ("diloco", "fedavg", "adpsgd")
        ),
    ],
)
def test_a_killed_replica_group_restarts_and_rejoins_while_the_others_keep_training(strategy, run_dir):
    run = run_dir(strategy)
    _kill_restart_and_check(run, RUNS[strategy]["max_steps"])


@pytest.mark.timeout(3 * LIMIT_S)
@pytest.mark.parametrize(
    "strategy",
    ["localsgd", pytest.param("bsp", marks=pytest.mark.skipif(not SLOW, reason="LIGHTNING_SYNC_SLOW_TESTS=1"))],
)
def test_a_replica_group_of_two_processes_is_one_replica_that_survives_losing_a_node(strategy, run_dir):
    """A replica group is a node of 2 processes (``replica_size="node"``: exact data parallelism inside, the method
    between groups; its first process is the group's member of the quorum and the other follows it): the whole node
    is killed and started again, and everything asserted for one-process groups holds."""
    run = run_dir(strategy)
    results = _kill_restart_and_check(run, RUNS[strategy]["max_steps"], procs_per_group=2, kill_at=20)
    between = "params" if strategy == "localsgd" else "grads"
    for result in results:
        assert result["world_size"] == 2
        # inside the group: the exact gradient all-reduce every step, and the leader's results shared
        assert result["bytes"].get("intra/grads", 0) > 0 and result["bytes"].get(f"intra/{between}", 0) > 0, result
        assert result["bytes"].get(between, 0) > 0  # between groups: the leader's averages


@pytest.mark.timeout(3 * LIMIT_S)
@pytest.mark.parametrize(
    "strategy",
    [
        "diloco",
        "bsp",
        *(
            pytest.param(name, marks=pytest.mark.skipif(not SLOW, reason="LIGHTNING_SYNC_SLOW_TESTS=1"))
            for name in ("diloco_streaming", "localsgd")
        ),
    ],
)
def test_a_killed_sharded_replica_group_restarts_heals_every_shard_and_rejoins(strategy, run_dir):
    """2 replica groups of 2 processes, each group's model sharded with FSDP2 over its processes (sharded DiLoCo with
    outer Nesterov momentum): every rank is a member of its shard index's quorum (a torchft Manager per rank), so each
    rank averages its own shard with the same shard of the other group. The whole group 1 is killed and started again;
    everything asserted for unsharded groups holds (the survivor never restarts and has no step gap, the restarted
    group resumes at one of its steps, bit-identical after its first sync, and from its checkpoint), and rank by rank:
    every shard ends bit-identical to the same shard of the other group, and each rank sent its own shard's bytes.
    ``LIGHTNING_SYNC_SLOW_TESTS=1`` adds streaming DiLoCo (2 fragments of each rank's shard, each in flight for a
    step over its shard index's quorum) and local SGD. Sharded BSP (FSDP2 inside each group, every step each rank's
    local gradient shard averaged over its shard index's quorum, held at every step's end) is checked the same way:
    its bytes between the groups are gradients (tag ``grads``), one all-reduce of the rank's shard per step."""
    run = run_dir(strategy, groups=2)
    # slower survivors until the rejoin: a group of two processes takes long to start on a loaded machine
    args = {**RUNS[strategy]["args"], "verify_sync": True}  # every sync: each shard checked across the groups
    results = _kill_restart_and_check(
        run, RUNS[strategy]["max_steps"], procs_per_group=2, kill_at=20, sharded=True, slow=0.5, args=args
    )
    leaders = {0: results[0]["pid"], 1: results[1]["pid"]}  # group 1: the restarted run's first process
    shards = {}
    for g in range(2):
        files = [json.loads(p.read_text()) for p in run.out.glob(f"shard_g{g}_r1_*.json")]
        (shards[g],) = [f for f in files if f["leader"] == leaders[g]]
    assert shards[0]["checksum"] == shards[1]["checksum"], "shard 1 differs between the replica groups"
    assert shards[0]["checksum"] != results[0]["checksum"]  # each rank holds its own shard, not the whole model
    if strategy == "diloco_streaming":  # its fragments' bytes: a range of each shard per sync
        return
    between = "grads" if strategy == "bsp" else "params"
    for rank0, rank1 in ((results[0], shards[0]), (results[1], shards[1])):
        assert rank0["world_size"] == 2 and rank1["flat_bytes"] > 0
        # between groups every rank sends its own shard: k all-reduces over 2 groups of its shard (exactly its bytes
        # each, gloo's ring for 2), the same k on both ranks; nothing of the whole model inside the group
        sent = [rank0["bytes"].get(between, 0), rank1["bytes"].get(between, 0)]
        k, rest = divmod(sent[0], rank0["flat_bytes"])
        assert k > 0 and rest == 0 and sent[1] == k * rank1["flat_bytes"], (sent, rank0, rank1)
        intra = rank0["bytes"].get(f"intra/{between}", 0)
        if strategy == "bsp":  # the floating buffers alone (FSDP2 leaves each rank its own): averaged in the group
            assert 0 < intra <= RUNS[strategy]["max_steps"] * rank0["flat_bytes"] / 100, (intra, rank0)
        else:
            assert intra == 0, rank0


@pytest.mark.timeout(3 * LIMIT_S)
def test_a_lost_process_takes_its_two_process_group_down_and_the_other_groups_go_on(run_dir):
    """Only the second process of group 1 is killed: the group's first process fails at its next collective inside
    the group and exits with an error; the other groups finish without group 1."""
    run = run_dir("localsgd")
    (run.out / "slow").touch()
    run.lighthouse()
    procs = [run.group(g, procs=2) for g in range(GROUPS)]
    run.wait_until("replica group 1 at step 20", lambda: any(r["step"] >= 20 for r in run.progress(1)), procs)
    children = subprocess.run(["pgrep", "-P", str(procs[1].pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 1, children  # the process Lightning started for the group's second rank
    os.kill(int(children[0]), signal.SIGKILL)
    assert procs[1].wait(timeout=LIMIT_S) != 0, "the group's first process went on without its second"
    (run.out / "slow").unlink()
    codes = run.finish([procs[0], procs[2]])
    _check_survivors(run, [codes[0], None, codes[1]], [0, 2], RUNS["localsgd"]["max_steps"], kill_at=20)
    assert run.results(1) == []


def _kill_restart_and_check(
    run: Run, max_steps: int, procs_per_group: int = 1, kill_at: int = KILL_AT, **extra
) -> list[dict]:
    """Group 1 killed and restarted; the survivors' and the restarted group's checks; a checkpoint the restarted group
    took resumes. Returns the groups' results (``extra``: the workers' configuration, e.g. ``sharded=True``)."""
    procs, back, killed_at = _start_and_kill(run, True, procs_per_group, kill_at, **extra)
    survivors = [g for g in range(run.groups) if g != 1]
    codes = run.finish([back if g == 1 else p for g, p in enumerate(procs)])
    _check_survivors(run, [None if g == 1 else c for g, c in enumerate(codes)], survivors, max_steps, kill_at)
    assert codes[1] == 0, f"the restarted replica group exited with {codes[1]}\n{run.dump()}"

    runs = _by_pid(run.progress(1))
    assert set(runs) == {procs[1].pid, back.pid}
    first = runs[back.pid][0]
    # it resumed from its peers' state, mid-run, at one of their steps: not from scratch, not from its own past
    assert first["step"] > killed_at + 1, f"the restarted group started at step {first['step']}"
    assert [r["step"] for r in runs[back.pid]] == list(range(first["step"], max_steps + 1))
    # Lightning's loops came with the state: the same epoch and position in it as the peers at that step
    peer = {r["step"]: r for r in run.progress(0)}[first["step"]]
    assert (first["epoch"], first["batch"]) == (peer["epoch"], peer["batch"])
    # after its first sync it holds exactly what its peers hold after theirs (same torchft step)
    mine = [r for r in runs[back.pid] if r["synced"]]
    assert mine and mine[0]["committed"] and mine[0]["replicas"] == run.groups
    peers = _committed_syncs(run.progress(0))
    assert mine[0]["ft_step"] in peers and mine[0]["checksum"] == peers[mine[0]["ft_step"]]
    for g in survivors[1:]:
        assert _committed_syncs(run.progress(g))[mine[0]["ft_step"]] == peers[mine[0]["ft_step"]]
    results = [
        [r for r in run.results(1) if r["pid"] == back.pid][0] if g == 1 else run.results(g)[0]
        for g in range(run.groups)
    ]
    assert len({r["checksum"] for r in results}) == 1, "the replica groups end with different models"
    assert results[1]["val_acc"] >= TARGET and results[1]["global_step"] == max_steps
    assert results[1]["metrics"]["ft_heals"] >= 1 and results[0]["bytes"].get("recovery", 0) > 0

    # a checkpoint the restarted group took after the rejoin resumes: steps, schedule and torchft's step go on
    ckpt = run.out / "end_g1b.ckpt"
    assert ckpt.exists() and Path(f"{ckpt}.rank0").exists()
    more = 8
    resumed = run.group(
        1,
        tag="r",
        resume=str(ckpt),
        max_steps=max_steps + more,
        join_timeout=2,
        save=None,
        procs=procs_per_group,
        **extra,
    )
    assert run.finish([resumed]) == [0], run.dump()
    after = _by_pid(run.progress(1))[resumed.pid]
    assert [r["step"] for r in after] == list(range(max_steps + 1, max_steps + more + 1))
    (result,) = [r for r in run.results(1) if r["pid"] == resumed.pid]
    assert result["strategy_step"] == max_steps + more
    # torchft's step as saved (the step's end, before the final average), plus the commit of the resumed start
    assert result["ft_step_at_start"] == runs[back.pid][-1]["ft_step"] + 1
    return results


@pytest.mark.timeout(3 * LIMIT_S)
@pytest.mark.parametrize(
    "strategy",
    ["diloco", pytest.param("localsgd", marks=pytest.mark.skipif(not SLOW, reason="LIGHTNING_SYNC_SLOW_TESTS=1"))],
)
def test_a_replica_group_that_never_returns_leaves_the_others_to_finish_with_one_fewer(strategy, run_dir):
    run = run_dir(strategy)
    max_steps = RUNS[strategy]["max_steps"]
    procs, _, _ = _start_and_kill(run, restart=False)
    codes = run.finish([procs[0], procs[2]])
    _check_survivors(run, [codes[0], None, codes[1]], [0, 2], max_steps)
    for g in (0, 2):
        syncs = [r for r in run.progress(g) if r["synced"]]
        assert all(r["replicas"] == GROUPS - 1 for r in syncs if r["step"] > KILL_AT + 8)
        # the user is told: a warning when the quorum lost the group, and no heal counted for a survivor's start
        text = (run.out / f"g{g}.log").read_text()
        assert f"this sync's quorum has {GROUPS - 1} of {GROUPS} replica groups (the last one had {GROUPS})" in text
        assert run.results(g)[0]["metrics"]["ft_heals"] == 0
    assert run.results(0)[0]["checksum"] == run.results(2)[0]["checksum"]
    assert run.results(1) == []


@pytest.mark.timeout(LIMIT_S)
def test_an_unreachable_lighthouse_at_start_is_a_clear_error_not_a_hang(tmp_path, single_process):
    import lightning.pytorch as pl

    from lightning_sync import FaultTolerance, LocalSGDStrategy
    from lightning_sync.comm.ft import FaultToleranceError
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    ft = FaultTolerance(lighthouse=url, replica_group=0, replica_groups=2, connect_timeout=timedelta(seconds=2))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=LocalSGDStrategy(fault_tolerance=ft),
        max_steps=2,
        **quiet_trainer_kwargs(),
    )
    with pytest.raises(FaultToleranceError, match=r"cannot reach the torchft lighthouse at http://127\.0\.0\.1:\d+"):
        trainer.fit(DigitsCNN(), DigitsDataModule())


@pytest.mark.timeout(LIMIT_S)
@pytest.mark.skipif(not SLOW, reason="LIGHTNING_SYNC_SLOW_TESTS=1")
def test_a_lighthouse_gone_during_the_run_stops_every_group_at_its_next_sync_with_a_clear_error(run_dir):
    run = run_dir("localsgd")
    run.lighthouse()
    lighthouse = run.procs[0]
    procs = [run.group(g, groups=2, timeout=10, max_steps=400) for g in range(2)]
    run.wait_until("step 10", lambda: any(r["step"] >= 10 for r in run.progress(0)), procs)
    kill_session(lighthouse)
    assert run.finish(procs) == [1, 1], run.dump()
    for g, log in enumerate(run.logs[1:]):
        text = log.read_text()
        assert (
            f"replica group 'replica_{g}' could not get a quorum from the lighthouse at {run.url} within 10 s" in text
        )


@pytest.mark.timeout(LIMIT_S)
def test_a_replica_group_of_two_processes_stops_on_every_process_with_the_cause(run_dir):
    """Two processes that are not one replica (``replica_size=None``: each its own) cannot be one replica group; a
    leader that cannot reach the lighthouse stops its group's other process with the same cause."""
    run = run_dir("localsgd")
    run.lighthouse()
    flat = run.group(0, groups=2, procs=2, replica_size=None)
    assert run.finish([flat]) == [1], run.dump()
    text = run.logs[-1].read_text()
    assert text.count("with 2 processes in this replica group: they must form one replica") == 2, text[-3000:]
    assert "replica_size='node'" in text

    run.url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    lost = run.group(0, tag="x", groups=2, procs=2, connect_timeout=2)
    assert run.finish([lost]) == [1], run.dump()
    text = run.logs[-1].read_text()
    assert "the replica group's leader (rank 0) could not join: FaultToleranceError" in text, text[-3000:]
    assert text.count(f"cannot reach the torchft lighthouse at {run.url}") >= 2


@pytest.mark.timeout(LIMIT_S)
def test_sharded_replica_groups_with_different_shard_counts_or_no_lighthouse_stop_with_the_cause(run_dir):
    """A sharded group of 2 processes and one of 1 (each shard index averages with the same shard of the other groups:
    the second shard has no peer) stop, every process, with an error naming the shard counts; a sharded group whose
    rank 0 cannot reach the lighthouse stops on both processes with that cause."""
    run = run_dir("localsgd", groups=2)
    run.lighthouse()
    procs = [run.group(0, procs=2, sharded=True, timeout=10), run.group(1, sharded=True, timeout=10)]
    assert run.finish(procs) == [1, 1], run.dump()
    for log, processes in zip(run.logs[1:], (2, 1)):
        text = log.read_text()
        cause = "replica group 1 shards its model over 1 process(es), replica group 0 over 2: sharded replica groups"
        assert text.count(cause) == processes, text[-3000:]
        assert "must have the same shard count" in text and "all groups stop" in text
    assert run.results(0) == [] and run.results(1) == []

    run.url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    lost = run.group(0, tag="x", procs=2, sharded=True, connect_timeout=2)
    assert run.finish([lost]) == [1], run.dump()
    text = run.logs[-1].read_text()
    assert "the replica group's leader (rank 0) could not join: FaultToleranceError" in text, text[-3000:]
    assert text.count(f"cannot reach the torchft lighthouse at {run.url}") >= 2


@pytest.mark.timeout(LIMIT_S)
def test_replica_groups_configured_differently_stop_with_an_error_naming_the_difference(run_dir):
    run = run_dir("localsgd")
    run.lighthouse()
    procs = [run.group(0, groups=2), run.group(1, groups=2, args={"period": 8, "offset": 7})]
    assert run.finish(procs) == [1, 1], run.dump()
    for log in run.logs[1:]:
        text = log.read_text()
        assert "FaultToleranceError: fault tolerance: replica group 1's config is" in text, text[-3000:]
        assert "'period': 8" in text and "'period': 4" in text and "all groups stop" in text
    assert run.results(0) == [] and run.results(1) == []


def test_fault_tolerance_is_refused_where_it_cannot_work_and_validated(monkeypatch):
    from lightning_sync import (
        ADPSGDStrategy,
        ALADDINStrategy,
        ASPStrategy,
        BSPStrategy,
        DiLoCoStrategy,
        FaultTolerance,
        FedAvgStrategy,
        LocalSGDStrategy,
        OSPStrategy,
        SelSyncStrategy,
        SSPStrategy,
        SyncSwitchStrategy,
    )

    ft = FaultTolerance(lighthouse="http://127.0.0.1:29510", replica_group=1, replica_groups=3)
    assert ft.replica_id == "replica_1" and ft.min_replicas == 1
    LocalSGDStrategy(period=4, fault_tolerance=ft)
    DiLoCoStrategy(sync_every=4, fragments=2, fault_tolerance=ft)
    DiLoCoStrategy(sync_every=4, fragments=2, delay=1, fault_tolerance=ft)
    FedAvgStrategy(fraction=0.5, fault_tolerance=ft)
    ADPSGDStrategy(fault_tolerance=ft)
    BSPStrategy(fault_tolerance=ft)
    BSPStrategy(bucket_cap_mb=None, fault_tolerance=ft)
    with pytest.raises(ValueError, match="does not support find_unused_parameters=True: which parameters no rank used"):
        BSPStrategy(find_unused_parameters=True, fault_tolerance=ft)
    with pytest.raises(ValueError, match="must be None for SelSyncStrategy, which cannot run fault-tolerant: .*vote"):
        SelSyncStrategy(fault_tolerance=ft)
    for cls in (OSPStrategy, ASPStrategy, SSPStrategy, ALADDINStrategy, SyncSwitchStrategy):
        with pytest.raises(ValueError, match=f"{cls.__name__}, which cannot run fault-tolerant"):
            cls(fault_tolerance=ft)
    for codec in ("int8", "int4", "int2"):
        with pytest.raises(ValueError, match=f"does not support compression='{codec}'"):
            LocalSGDStrategy(fault_tolerance=ft, compression=codec)
    with pytest.raises(ValueError, match="fault_tolerance must be a lightning_sync.FaultTolerance"):
        LocalSGDStrategy(fault_tolerance={"lighthouse": "http://x:1"})

    for env in ("TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"):
        monkeypatch.delenv(env, raising=False)
    with pytest.raises(ValueError, match="lighthouse must be the lighthouse's URL"):
        FaultTolerance(replica_group=0, replica_groups=2)
    with pytest.raises(ValueError, match="replica_groups is not given and NUM_REPLICA_GROUPS is not set"):
        FaultTolerance(lighthouse="http://h:1", replica_group=0)
    with pytest.raises(ValueError, match=r"replica_group must be in \[0, replica_groups=2\)"):
        FaultTolerance(lighthouse="http://h:1", replica_group=2, replica_groups=2)
    with pytest.raises(ValueError, match="min_replicas must be an integer in"):
        FaultTolerance(lighthouse="http://h:1", replica_group=0, replica_groups=2, min_replicas=3)
    with pytest.raises(ValueError, match="timeout must be a datetime.timedelta"):
        FaultTolerance(lighthouse="http://h:1", replica_group=0, replica_groups=2, timeout=-1)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "2")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "4")
    from_env = FaultTolerance()
    assert (from_env.lighthouse, from_env.replica_group, from_env.replica_groups) == ("http://lighthouse:29510", 2, 4)
