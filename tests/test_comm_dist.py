"""The Communicator over a real 2-process gloo group (torch.multiprocessing, no Lightning).

One spawn runs every check; each worker returns its observations through a file and the parent asserts.
"""

import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_sync.comm import CommStats, Communicator, FlatState, LinkModel
from lightning_sync.comm.cost import gloo_ring_allreduce_bytes
from lightning_sync.launch import free_port

WORLD = 2
# emulated transfers long against scheduling jitter (tens of ms on a loaded 2-core machine), with latency and
# bandwidth terms of similar size so that dropping or doubling either one is seen
DELAY_LINK = LinkModel(bandwidth="20mbit", latency="300ms")
NUMEL = 250_000  # 1 MB of float32: 400 ms at 20 Mbit/s, + 300 ms latency
COMPUTE_S = 0.3  # real compute while an asynchronous transfer is in flight
#: slack above an emulated time: sleep overshoot, the real collective, one descheduling (measured: under 10 ms)
SLACK_S = 0.25


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    res: dict = {}
    try:
        # 1. accounting of a plain all-reduce and correctness of avg
        stats = CommStats()
        comm = Communicator(stats)
        t = torch.full((1001,), float(rank + 1))
        comm.all_reduce(t, op="avg", tag="params")
        res["avg_ok"] = bool((t == 1.5).all())
        res["bytes_params"] = stats.bytes_sent["params"]
        res["blocking"] = stats.blocking["params"]

        # 2. a parameter sync of a model through its flat buffer: bytes equal the analytic count
        torch.manual_seed(rank)
        net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 10))
        flat = FlatState(net)
        stats2 = CommStats()
        comm2 = Communicator(stats2)
        comm2.all_reduce_many(flat.state_tensors(), op="avg", tag="params")
        res["model_numel"] = flat.numel()
        res["model_bytes_params"] = stats2.bytes_sent["params"]
        res["model_ops"] = stats2.ops["params"]
        res["checksum"] = flat.checksum(flat.state_tensors()).tolist()

        # 3. link emulation on a blocking collective: added delay = latency + bytes / bandwidth
        big = torch.ones(NUMEL)
        plain = Communicator(CommStats())
        plain.barrier()
        t0 = time.perf_counter()
        plain.all_reduce(big, tag="x")
        res["plain_s"] = time.perf_counter() - t0
        slow_stats = CommStats()
        slow = Communicator(slow_stats, link=DELAY_LINK)
        plain.barrier()
        t0 = time.perf_counter()
        slow.all_reduce(big, tag="x")
        res["emulated_s"] = time.perf_counter() - t0
        res["emulated_bytes"] = slow_stats.bytes_sent["x"]
        res["emulated_blocked_s"] = slow_stats.blocked_seconds["x"]

        # 4. an async handle under emulation completes after work launched after it has started
        events = []
        plain.barrier()
        launch = time.perf_counter()
        handle = slow.all_reduce(big, tag="async", async_op=True)
        events.append(("launched", time.perf_counter() - launch))
        compute_start = time.perf_counter()
        events.append(("compute_start", compute_start - launch))
        a = torch.randn(200, 200)
        while time.perf_counter() - compute_start < COMPUTE_S:  # real compute while the handle is in flight
            a = torch.tanh(a @ a.T / 200)
        events.append(("compute_end", time.perf_counter() - launch))
        res["completed_before_wait"] = handle.is_completed()
        handle.wait()
        events.append(("handle_complete", handle.completed_at - launch))
        res["events"] = events
        res["async_blocked_s"] = slow_stats.blocked_seconds["async"]
        res["async_blocking"] = slow_stats.blocking["async"]

        # 5. a host-prepared all-reduce: prepare and collective on the driver thread, the caller goes on at once
        host_stats = CommStats()
        host = Communicator(host_stats, link=DELAY_LINK)
        vote = torch.zeros(3)
        seen: dict = {}
        gate = threading.Event()

        def prepare() -> None:
            seen["thread"] = threading.current_thread().name
            gate.wait(5.0)  # the caller is still running when prepare runs: it released the gate
            vote.copy_(torch.tensor([1.0, float(rank), 2.0 * rank]))

        plain.barrier()
        t0 = time.perf_counter()
        handle = host.all_reduce_from_host(vote, prepare, op="sum", tag="vote")
        res["host_launch_s"] = time.perf_counter() - t0
        gate.set()
        handle.wait()
        res["host_vote"] = vote.tolist()
        res["host_thread"] = seen["thread"]
        res["host_bytes"] = host_stats.bytes_sent["vote"]
        res["host_ops"], res["host_blocking"] = host_stats.ops["vote"], host_stats.blocking["vote"]
        res["host_blocked_s"] = host_stats.blocked_seconds["vote"]

        def broken() -> None:
            raise RuntimeError("prepare failed")

        try:  # every rank fails before its collective: no rank waits on the other
            host.all_reduce_from_host(torch.zeros(1), broken, tag="vote").wait()
            res["host_error"] = None
        except RuntimeError as err:
            res["host_error"] = str(err)
        host.close()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm")
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=WORLD, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_all_reduce_average_and_accounting(results):
    for r in results:
        assert r["avg_ok"]
        assert r["bytes_params"] == gloo_ring_allreduce_bytes(1001, 4, WORLD, 0) == 1001 * 4
        assert r["blocking"] == 1


def test_parameter_sync_bytes_equal_analytic_count(results):
    # params + BatchNorm running mean/var, float32, one all-reduce; ring on 2 ranks sends the buffer once
    numel = (64 * 32 + 32) + (32 + 32) + (32 * 10 + 10) + (32 + 32)
    for r in results:
        assert r["model_numel"] == numel
        assert r["model_ops"] == 1
        assert r["model_bytes_params"] == 2 * (WORLD - 1) * numel * 4 // WORLD
    assert results[0]["checksum"] == results[1]["checksum"]  # bit-identical after the average


def test_link_emulation_adds_latency_plus_bytes_over_bandwidth(results):
    expected = DELAY_LINK.delay(NUMEL * 4)
    assert expected == pytest.approx(0.3 + 0.4)
    for r in results:
        assert r["emulated_bytes"] == NUMEL * 4
        # the emulated transfer follows the real collective: at least its delay (exact). Without the latency
        # (0.4 s) or the bandwidth term (0.3 s) it is too short; with either counted twice (1.0 s, 1.1 s) or bits
        # taken for bytes, too long
        assert r["emulated_s"] >= expected
        assert r["emulated_blocked_s"] >= expected
        added = r["emulated_s"] - r["plain_s"]
        assert added < expected + SLACK_S


def test_async_handle_overlaps_later_work_under_emulation(results):
    expected = DELAY_LINK.delay(NUMEL * 4)
    for r in results:
        ev = dict(r["events"])
        order = [name for name, _ in sorted(r["events"], key=lambda e: e[1])]
        assert order == ["launched", "compute_start", "compute_end", "handle_complete"]
        assert not r["completed_before_wait"]  # 0.3 s of compute < 0.7 s of emulated transfer
        assert ev["handle_complete"] >= expected
        # only the part of the transfer not hidden behind compute was spent blocked: expected - 0.3 s (0.4 s), where
        # a transfer that starts at the wait (or a wait that ignores the compute) blocks >= 0.7 s
        assert r["async_blocked_s"] < expected - COMPUTE_S / 2
        assert r["async_blocking"] == 0


def test_host_prepared_all_reduce_runs_off_the_calling_thread(results):
    """``all_reduce_from_host``: ``prepare`` fills the tensor on the driver thread (it waits for the caller, which
    has already returned), the sum arrives, bytes are the analytic count (recorded once, not blocking), the
    emulated link delays it, and an error in ``prepare`` is re-raised by ``wait``."""
    for r in results:
        assert r["host_vote"] == [2.0, 1.0, 2.0]  # sum over ranks 0 and 1
        assert r["host_thread"].startswith("comm-driver-gloo")
        # did not wait for prepare (which waits for the caller up to 5 s); the launch creates the driver's process
        # group (a meeting with the other rank), hence 2 s on a loaded machine
        assert r["host_launch_s"] < 2.0
        assert r["host_bytes"] == gloo_ring_allreduce_bytes(3, 4, WORLD, 0) == 12
        assert r["host_ops"] == 1 and r["host_blocking"] == 0
        assert r["host_blocked_s"] >= DELAY_LINK.latency_seconds  # the wait was charged with the emulated transfer
        assert r["host_error"] == "prepare failed"
