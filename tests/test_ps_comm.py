"""The parameter server's transport with 3 real processes (gloo point-to-point, server and mailbox threads):
every push applied exactly once, SSP's bound, ALADDIN's period, bytes equal to the analytic count, clean
shutdown. No Lightning here; the strategies on top are tested in test_ps_strategies.py."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from launch import run_external

WORLD = 3
TOTAL = 1003  # elements; shards of at most 100 -> 11 shards over 3 ranks
STEPS = {0: 40, 1: 55, 2: 70}  # ranks push different numbers of times


def _run_all(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    for mode in ("asp", "ssp", "aladdin"):
        _run(rank, mode, out_dir)
    _run_link(rank, out_dir)


LINK_PUSHES = 8
LINK_BANDWIDTH = 800e3  # bit/s: a shard message of ~1.4 KB takes ~14 ms


def _run_link(rank: int, out_dir: str) -> None:
    """With link emulation, every rank receives pushes (server thread) and replies (mailbox thread) at the same
    time; both go through the rank's one incoming link, so receiving them all takes at least their bits over the
    bandwidth — not half of it, as two independent sleeping threads would give."""
    import torch

    from lightning_sync.comm import CommStats, Communicator, LinkModel
    from lightning_sync.comm.ps import HEADER_BYTES, ParameterServer
    from lightning_sync.core.ps import ShardPlan, ShardServer

    stats = CommStats()
    comm = Communicator(stats)
    plan = ShardPlan(TOTAL, WORLD, 100)
    server = ShardServer(plan.gather(torch.zeros(TOTAL), rank), WORLD, mode="aladdin", period=1)
    link = LinkModel(bandwidth=LINK_BANDWIDTH, latency=0.0)
    ps = ParameterServer(plan, server, stats, link=link, timeout=timedelta(seconds=60))
    delta = torch.ones(TOTAL)
    comm.barrier()
    start = time.perf_counter()
    for _ in range(LINK_PUSHES):  # ALADDIN with period 1: every push is answered with the server's parameters
        ps.push(delta, 0, want_reply=False, wait=False)
    ps.flush()  # this worker's pushes applied by every server, and every reply to them received
    comm.barrier()  # so every message to every rank has been received
    elapsed = time.perf_counter() - start
    shard_msg = {s: HEADER_BYTES + 4 * plan.numel(s) for s in ps.servers}
    received = LINK_PUSHES * (len(ps.peers) * shard_msg[rank] + sum(shard_msg[s] for s in ps.remote_servers))
    res = {"elapsed": elapsed, "received_bits": 8.0 * received, "replies": dict(ps.params_received)}
    ps.finish_epoch(0)
    ps.flush()
    comm.barrier()
    ps.close(comm)
    Path(out_dir, f"link_rank{rank}.json").write_text(json.dumps(res))


def _run(rank: int, mode: str, out_dir: str) -> None:
    import torch

    from lightning_sync.comm import CommStats, Communicator
    from lightning_sync.comm.ps import HEADER_BYTES, ParameterServer
    from lightning_sync.core.ps import ShardPlan, ShardServer

    stats = CommStats()
    comm = Communicator(stats)
    init = torch.arange(TOTAL, dtype=torch.float32)
    plan = ShardPlan(TOTAL, WORLD, 100)
    server = ShardServer(plan.gather(init, rank), WORLD, mode=mode, staleness=2, period=3)
    ps = ParameterServer(plan, server, stats, timeout=timedelta(seconds=60))
    flat = init.clone()
    gen = torch.Generator().manual_seed(rank)
    pushed = torch.zeros(TOTAL)
    for _ in range(STEPS[rank]):
        # small integers: float32 sums stay exact, so "applied exactly once" is checked bit for bit
        delta = torch.randint(-3, 4, (TOTAL,), generator=gen).float()
        pushed += delta
        if mode == "aladdin":
            ps.push(delta, 0, want_reply=False, wait=False)
            ps.take_params(flat, alpha=0.25)
        else:
            ps.push(delta, 0, want_reply=True, wait=True)
            ps.wait_params()
            ps.take_params(flat)
        if rank == 0:
            time.sleep(0.003)  # a slower rank
    mix_ok = None
    if mode == "aladdin":
        # a known state: fill up to a trigger with zero deltas, flush (replies arrive before the acknowledgement),
        # then check the mixing arithmetic x <- (1 - a) x + a x~ shard by shard
        zero = torch.zeros(TOTAL)
        ps.take_params(flat, alpha=0.25)
        while ps.pushes % 3 != 0:
            ps.push(zero, 0, want_reply=False, wait=False)
        ps.flush()
        before = flat.clone()
        expected = before.clone()
        for s in ps.servers:
            plan.scatter(ps._inbox[s], s, expected)
        expected = 0.75 * before + 0.25 * expected
        applied = ps.take_params(flat, alpha=0.25)
        mix_ok = sorted(s for s, _ in applied) == ps.servers and bool(torch.allclose(flat, expected))
    ps.finish_epoch(0)
    ps.flush()
    comm.barrier()
    gathered = ps.global_params(comm, torch.empty(TOTAL), tag="gather")
    all_pushed = comm.all_gather(pushed).sum(0)
    res = {
        # ASP/SSP add every delta; ALADDIN adds the accumulated deltas with weight 1/n (a lost or repeated push
        # would be off by >= 1/3 somewhere)
        "exact": bool(
            torch.equal(gathered, init + all_pushed)
            if mode != "aladdin"
            else torch.allclose(gathered, init + all_pushed / WORLD, rtol=0, atol=1e-3)
        ),
        "pushes": ps.pushes,
        "params_received": {str(k): v for k, v in ps.params_received.items()},
        "pull_log": server.pull_log,
        "push_bytes": stats.bytes_sent["push"],
        "push_bytes_expected": ps.pushes * sum(HEADER_BYTES + 4 * plan.numel(s) for s in ps.remote_servers),
        "pull_bytes": stats.bytes_sent["pull"],
        "replies": server.replies,
        "mix_ok": mix_ok,
    }
    ps.close(comm)
    res["threads_after_close"] = [t.name for t in threading.enumerate() if t.name.startswith("ps-")]
    Path(out_dir, f"{mode}_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps_comm")
    run_external(_run_all, WORLD, str(out))  # one set of processes runs the three modes one after the other
    return out


def _load(out_dir, mode):
    return [json.loads((out_dir / f"{mode}_rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(params=["asp", "ssp", "aladdin"])
def run(request, out_dir):
    return request.param, _load(out_dir, request.param)


def test_every_push_is_applied_exactly_once(run):
    # the change of the global parameters is exactly the sum of every delta every rank pushed
    mode, res = run
    assert all(r["exact"] for r in res)
    pad = 3 if mode == "aladdin" else 1  # ALADDIN's run ends with zero pushes up to a multiple of its period
    assert [r["pushes"] for r in res] == [-(-STEPS[r] // pad) * pad for r in range(WORLD)]


def test_push_bytes_equal_the_analytic_count(run):
    _, res = run
    for r in res:
        assert r["push_bytes"] == r["push_bytes_expected"]


@pytest.mark.parametrize("mode", ["asp", "ssp"])
def test_asp_and_ssp_answer_every_push_and_ssp_bounds_staleness(out_dir, mode):
    res = _load(out_dir, mode)
    for rank, r in enumerate(res):
        # every server replied once to every push of every worker
        assert r["replies"] == [STEPS[w] for w in range(WORLD)]
        assert set(r["params_received"].values()) == {STEPS[rank]}
    if mode == "ssp":
        log = [row for r in res for row in r["pull_log"]]
        assert len(log) == sum(STEPS.values()) * WORLD
        # at every pull no worker was more than s=2 steps ahead of the slowest still training
        assert max(clock - slowest for _, clock, slowest in log) <= 2


def test_aladdin_sends_global_parameters_every_period_pushes_and_mixes_with_alpha(out_dir):
    res = _load(out_dir, "aladdin")
    for rank, r in enumerate(res):
        # from every server, at every 3rd push (the loop's pushes, then zero pushes up to the next multiple of 3)
        assert set(r["params_received"].values()) == {-(-STEPS[rank] // 3)}
        assert r["mix_ok"]


def test_clean_shutdown_leaves_no_thread(run):
    _, res = run
    assert all(r["threads_after_close"] == [] for r in res)


def test_a_ranks_pushes_and_replies_share_its_one_emulated_incoming_link(out_dir):
    # the push and pull payload messages a rank received took at least their bits over the link's bandwidth: the
    # server's and the mailbox's receiving threads queue on one link (the old per-thread sleeps gave about half)
    for rank in range(WORLD):
        r = json.loads((out_dir / f"link_rank{rank}.json").read_text())
        assert set(r["replies"].values()) == {LINK_PUSHES}
        assert r["elapsed"] >= 0.97 * r["received_bits"] / LINK_BANDWIDTH, r
