"""Start N worker processes the way torchrun/SLURM do (environment variables, ``LOCAL_RANK`` set), so Lightning
launches nothing and one pair of processes can run several ``Trainer.fit`` calls: the import of Lightning
(about 6 s per process here) is paid once per suite instead of once per fit."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    try:
        fn(rank, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_external(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` fresh processes with a torchrun-like environment."""
    mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, start_method="spawn")
