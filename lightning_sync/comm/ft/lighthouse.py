"""The torchft lighthouse: it forms a *quorum* of the replica groups that ask for one (every live group, without the
ones whose heartbeats stopped). :func:`serve_lighthouse` runs one in this process, :func:`lighthouse_main` is
``lightning-sync lighthouse``; :func:`check_lighthouse` says how to start one when none answers."""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from lightning_sync.comm.ft._torchft import LighthouseClient, LighthouseServer
from lightning_sync.comm.ft.errors import FaultToleranceError

__all__ = ["check_lighthouse", "lighthouse_main", "run_lighthouse", "serve_lighthouse"]


def _lighthouse_help(url: str) -> str:
    return (
        f"Start it first: `lightning-sync lighthouse --bind [::]:{_port_of(url)} --min-replicas 1` (or torchft's "
        "`torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 --bind [::]:"
        f"{_port_of(url)}`), and check that this host can reach {url}."
    )


def _port_of(url: str) -> str:
    tail = url.rsplit(":", 1)
    return tail[1].split("/")[0] if len(tail) == 2 and tail[1].split("/")[0].isdigit() else "29510"


def check_lighthouse(url: str, timeout: timedelta) -> None:
    """Raise :class:`FaultToleranceError` (naming ``url`` and how to start a lighthouse) unless a lighthouse answers at
    ``url`` within ``timeout``."""
    try:
        client = LighthouseClient(url, connect_timeout=timeout)
        del client
    except Exception as err:  # noqa: BLE001 - torchft raises RuntimeError with the transport's message
        raise FaultToleranceError(
            f"fault tolerance: the torchft lighthouse at {url} cannot be reached within "
            f"{timeout.total_seconds():g} s ({err}). {_lighthouse_help(url)}"
        ) from err


def serve_lighthouse(
    bind: str = "[::]:29510",
    min_replicas: int = 1,
    join_timeout_ms: int = 10_000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 5_000,
) -> Any:
    """Start a torchft lighthouse in this process (a Rust server on its own threads) and return it (``.address()``,
    ``.shutdown()``). ``min_replicas``: the fewest replica groups a new quorum may have; ``join_timeout_ms``: how long
    a quorum waits for replica groups that are alive (heartbeating) but have not asked yet; ``heartbeat_timeout_ms``:
    after how long without a heartbeat a replica group counts as gone (a killed one is dropped from the next quorum
    after this)."""
    return LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


def lighthouse_main(argv: Sequence[str] | None = None) -> None:
    """``lightning-sync lighthouse``: run a torchft lighthouse in the foreground until SIGINT or SIGTERM."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="lightning-sync lighthouse",
        description="Run the torchft lighthouse that fault-tolerant replica groups "
        "(fault_tolerance=FaultTolerance(...)) join; it forms a quorum of the live replica groups at each of their "
        "syncs. Equivalent to torchft's `torchft_lighthouse`.",
    )
    parser.add_argument("--bind", default="[::]:29510", help="address and port to listen on (default [::]:29510)")
    parser.add_argument("--min-replicas", type=int, default=1, help="fewest replica groups in a quorum (default 1)")
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=10_000,
        help="how long a quorum waits for live replica groups that have not asked yet (default 10000)",
    )
    parser.add_argument("--quorum-tick-ms", type=int, default=100, help="how often a waiting quorum is re-checked")
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5_000,
        help="a replica group silent for this long is gone: dropped from the next quorum (default 5000)",
    )
    args = parser.parse_args(argv)
    if args.min_replicas < 1:
        parser.error(f"--min-replicas must be >= 1, got {args.min_replicas}")
    run_lighthouse(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )


def run_lighthouse(**kwargs: Any) -> None:
    """:func:`serve_lighthouse`, then block until SIGINT or SIGTERM (``lightning-sync lighthouse``)."""
    try:
        server = serve_lighthouse(**kwargs)
    except Exception as err:  # noqa: BLE001 - e.g. the port is taken
        raise SystemExit(f"lightning-sync lighthouse: cannot start on {kwargs.get('bind')}: {err}") from err
    print(f"lighthouse listening on {server.address()} (min_replicas={kwargs.get('min_replicas', 1)})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()
