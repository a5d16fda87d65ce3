"""Host time of each piece of a SelSync vote on a CUDA device (what the training thread pays per step).

    python benchmarks/vote_cost.py      # needs a CUDA GPU; 2 processes sharing GPU 0 over gloo

Each piece is timed alone on the host (``time.perf_counter`` around the call, the device synchronised before each
call and not timed), median of 280 calls after 20 warm-ups, rank 0 printed: the squared norm of an 11.2M-element
gradient (ResNet-18's size), the device tracker's update (``core.DeviceGradientChangeTracker``: ~15 float64 kernels
per step), the vote's composition on the device, the asynchronous all-reduce's launch (raw ``torch.distributed`` and
through the pack's ``Communicator``), the whole device path, and the driver-thread path that replaced it on CUDA
(dot product, non-blocking copy to pinned memory, event, ``Communicator.all_reduce_from_host``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_sync.launch import free_port

NUMEL = 11_200_000


def _time(fn: Callable[[], object], n: int = 300, before: Callable[[], object] | None = None) -> float:
    xs = []
    for _ in range(n):
        if before is not None:
            before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs[20:]) * 1e6


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.cuda.set_device(0)
    from lightning_sync.comm import CommStats, Communicator
    from lightning_sync.core import DeviceGradientChangeTracker, GradientChangeTracker

    grad = torch.randn(NUMEL, device="cuda")
    out: dict[str, float] = {}
    out["squared norm (dot, float64)"] = _time(lambda: torch.dot(grad, grad).double())
    tracker = DeviceGradientChangeTracker(window=25, smoothing=0.25, device="cuda")
    sq = torch.dot(grad, grad).double()

    def update() -> None:
        tracker.update(sq)
        tracker.commit(True)

    for _ in range(60):  # past the window's growth
        update()
    out["device tracker: update + commit"] = _time(update, n=400)
    vote = torch.zeros(5, device="cuda")
    delta = torch.zeros((), dtype=torch.float64, device="cuda")
    finite = torch.ones((), dtype=torch.bool, device="cuda")

    def compose() -> None:
        vote[2:-1].zero_()
        vote[2 + rank].copy_(delta)
        vote[0].copy_(delta >= 0.3)
        vote[1].fill_(0.0)
        vote[-1].copy_(finite)

    out["device vote composition"] = _time(compose)
    handles: list = []

    def wait_all() -> None:
        while handles:
            handles.pop().wait()

    out["dist.all_reduce launch (async, CUDA tensor)"] = _time(
        lambda: handles.append(dist.all_reduce(vote[:4], async_op=True)), before=wait_all
    )
    wait_all()
    comm = Communicator(CommStats())
    out["Communicator.all_reduce launch (async)"] = _time(
        lambda: handles.append(comm.all_reduce(vote[:4], op="sum", tag="vote", async_op=True)), before=wait_all
    )
    wait_all()

    def device_path() -> None:
        tracker.update(torch.dot(grad, grad).double())
        compose()
        handles.append(comm.all_reduce(vote[:4], op="sum", tag="vote", async_op=True))

    out["whole device path (norm, tracker, vote, launch)"] = _time(
        device_path, before=lambda: (wait_all(), tracker.commit(True))
    )
    wait_all()
    host_tracker = GradientChangeTracker(window=25, smoothing=0.25)
    pinned = torch.zeros((), dtype=torch.float64).pin_memory()
    ready = torch.cuda.Event()
    host_vote = torch.zeros(4)

    def thread_path() -> None:
        pinned.copy_(torch.dot(grad, grad).double(), non_blocking=True)
        ready.record()

        def decide() -> None:
            ready.synchronize()
            d = host_tracker.update(float(pinned))
            host_vote.copy_(torch.tensor([float(d >= 0.3), 0.0, d, 0.0]))

        handles.append(comm.all_reduce_from_host(host_vote, decide, op="sum", tag="vote"))

    out["driver-thread path (norm, copy, event, launch)"] = _time(thread_path, before=wait_all)
    wait_all()
    if rank == 0:
        print(f"host time per call, median of 280 ({torch.cuda.get_device_name(0)}, torch {torch.__version__}):")
        for name, us in out.items():
            print(f"  {name:50s} {us:8.1f} us")
    comm.close()
    dist.destroy_process_group()


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("vote_cost.py needs a CUDA GPU")
    mp.start_processes(_worker, args=(free_port(),), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
