"""Start local worker processes the way torchrun or SLURM would: environment variables with ``LOCAL_RANK`` set,
so Lightning launches nothing itself and each process can run several ``Trainer.fit`` calls.

Used by the benchmarks and tests: Lightning's own spawn launcher re-imports Lightning (seconds per process)
for every fit; here the import is paid once per process for a whole series of runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def kill_session(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and every process of its session if it is still running (started with
    ``start_new_session=True``, so whatever it launched goes too), and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, AttributeError):  # AttributeError: no killpg (Windows)
            proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait for anything but the kernel
        pass


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, threads: int | None, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        fn(rank, *args)
    finally:
        from lightning_sync.comm import destroy_default_group

        destroy_default_group()  # a spawned worker with a live gloo group aborts at exit about half the time


def launch_local(fn: Callable[..., Any], world_size: int, *args: Any, threads: int | None = 1) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` fresh processes on this host with a torchrun-like environment.

    ``threads`` sets ``torch.set_num_threads`` in each worker (1 by default, so that more ranks than cores do not
    oversubscribe the machine). ``fn`` must be importable (defined at module level).
    """
    mp.start_processes(
        _entry, args=(fn, world_size, free_port(), threads, args), nprocs=world_size, start_method="spawn"
    )


def quiet_trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """``Trainer`` arguments for scripted runs (benchmarks, tests): no logger, checkpoints, progress bar, model
    summary or sanity validation, unless ``overrides`` say otherwise."""
    kwargs: dict[str, Any] = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    kwargs.update(overrides)
    return kwargs
