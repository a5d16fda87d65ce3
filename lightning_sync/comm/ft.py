"""Fault-tolerant replica groups on torchft: the only code in the pack that touches torchft.

torchft (PyTorch's fault-tolerance library, ``pip install "lightning-sync[ft]"``) provides the pieces; this module
adapts them to the pack's accounting:

* **the lighthouse** (``torchft.coordination.LighthouseServer``, also torchft's ``torchft_lighthouse`` command) forms a
  *quorum* of the replica groups that ask for one: every live group, without the ones whose heartbeats stopped.
  :func:`serve_lighthouse` runs one (``lightning-sync lighthouse``).
* **the Manager** (``torchft.Manager``, one per replica group) asks the lighthouse for a quorum, reconfigures the
  group's process group for the quorum's members, and heals a replica group that is behind (a restarted one) by
  sending it a healthy peer's state; ``should_commit`` then says whether the step's collectives succeeded
  everywhere in the group.
* **the reconfigurable process group** (``torchft.ProcessGroupGloo``): torch's gloo, rebuilt for each new quorum.

:class:`ReplicaGroupComm` wraps them. Every byte goes through one process group, :class:`CountedProcessGroupGloo`, a
``ProcessGroupGloo`` that records each operation in the replica's :class:`~lightning_sync.comm.CommStats` (bytes from
:mod:`~lightning_sync.comm.cost`: gloo's ring over the quorum's members) and delays it on the replica's emulated
:class:`~lightning_sync.comm.LinkClock` — the averages, the configuration check, and the state a healthy peer sends
to a restarted one (torchft's ``PGTransport`` over the same group, instead of its default HTTP transport, so those
bytes are counted too). Not counted: torchft's control plane (heartbeats every 100 ms, quorum and commit requests:
small protobuf messages over gRPC, outside ``torch.distributed``); a quorum is recorded as one operation of 0 bytes
under the tag ``"quorum"``, with the time it blocked, and costs one emulated latency.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceOp

from lightning_sync.comm.accounting import CommStats
from lightning_sync.comm.cost import allgather_bytes, allreduce_bytes, broadcast_bytes
from lightning_sync.comm.link import LinkClock

# torchft's Rust side logs every quorum and commit at INFO to stderr: warnings only, unless the user asked otherwise
# (read when torchft's extension initialises its logger, so before the import)
os.environ.setdefault("RUST_LOG", "warn")

try:  # torchft is optional ("lightning-sync[ft]"); the strategies check for it before they get here
    from torchft import Manager
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.coordination import LighthouseClient, LighthouseServer
    from torchft.process_group import ProcessGroupGloo
except ImportError as _err:  # pragma: no cover - exercised where torchft is not installed
    raise ImportError(
        'fault tolerance needs torchft: pip install "lightning-sync[ft]" (torchft 0.2 and its OpenTelemetry '
        f"dependencies); importing it failed with {type(_err).__name__}: {_err}"
    ) from _err

__all__ = [
    "CountedProcessGroupGloo",
    "FaultToleranceError",
    "PendingAllReduce",
    "MirroredPending",
    "QuorumInfo",
    "ReplicaGroupComm",
    "ReplicaMirror",
    "check_lighthouse",
    "serve_lighthouse",
]

log = logging.getLogger(__name__)

# torchft's PGTransport wraps its pickled metadata with torch.frombuffer on an immutable bytes object (read only)
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=r"torchft\.")


class FaultToleranceError(RuntimeError):
    """A replica group cannot go on: the lighthouse is unreachable, a quorum failed, its state could not be received,
    or its configuration differs from its peers'. The message names the cause and what to do."""


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


# ----------------------------------------------------------------------------------------------- the process group
class _LinkWork(dist._Work):
    """A ``Work`` that is complete when the real operation is and its emulated transfer on the replica's link has
    ended (torchft waits with ``wait()``; the futures are the real operation's)."""

    def __init__(self, work: Any, clock: LinkClock, key: int) -> None:
        super().__init__()
        self._work = work
        self._clock = clock
        self._key = key
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        if not self._done:
            self._clock.sleep_until_complete(self._key)
            self._done = True
        return ok

    def is_completed(self) -> bool:
        if not self._work.is_completed():
            return False
        now = time.perf_counter()
        return self._done or now >= self._clock.completion(self._key, now)

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()


class CountedProcessGroupGloo(ProcessGroupGloo):
    """torchft's reconfigurable gloo process group, accounted: every operation records the bytes this replica sends
    in ``stats`` under :attr:`tag` (gloo's algorithms over the current quorum's members,
    :mod:`~lightning_sync.comm.cost`) and, with a ``clock``, is not complete before its emulated transfer on the
    replica's link (a receive is delayed by the bytes it receives: the transfer costs both ends their link time).
    Operations are counted as blocking (every caller, :class:`ReplicaGroupComm` and torchft's ``PGTransport``, waits on
    them at once) except those :meth:`ReplicaGroupComm.all_reduce_async` launches to overlap with compute."""

    def __init__(self, stats: CommStats, clock: LinkClock | None, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self.stats = stats
        self.clock = clock
        #: the tag the next operations are recorded under (set by :class:`ReplicaGroupComm` around each use)
        self.tag = "ft"
        #: whether the next operations are waited on at once (``False``: launched to overlap with compute)
        self.blocking = True

    def _me(self) -> tuple[int, int]:
        return int(self._rank or 0), int(self.size())

    def _counted(self, work: Any, sent: int, delayed: int | None = None) -> Any:
        self.stats.record_launch(self.tag, sent, blocking=self.blocking)
        if self.clock is None:
            return work
        return _LinkWork(work, self.clock, self.clock.start(sent if delayed is None else delayed, time.perf_counter()))

    def allreduce(self, tensors: list[Tensor], opts: Any) -> Any:
        rank, size = self._me()
        sent = sum(allreduce_bytes(t.numel(), t.element_size(), size, rank, "gloo") for t in tensors)
        return self._counted(super().allreduce(tensors, opts), sent)

    def allgather(self, output_tensors: list[list[Tensor]], input_tensor: list[Tensor], opts: Any) -> Any:
        _, size = self._me()
        sent = sum(allgather_bytes(t.numel() * t.element_size(), size) for t in input_tensor)
        return self._counted(super().allgather(output_tensors, input_tensor, opts), sent)

    def broadcast(self, tensor_list: list[Tensor], opts: Any) -> Any:
        rank, size = self._me()
        payload = sum(t.numel() * t.element_size() for t in tensor_list)
        sent = broadcast_bytes(payload, size, rank, int(opts.rootRank))
        return self._counted(super().broadcast(tensor_list, opts), sent, delayed=payload)

    def send(self, tensors: list[Tensor], dst_rank: int, tag: int) -> Any:
        sent = sum(t.numel() * t.element_size() for t in tensors)
        return self._counted(super().send(tensors, dst_rank, tag), sent)

    def recv(self, tensors: list[Tensor], src_rank: int, tag: int) -> Any:
        received = sum(t.numel() * t.element_size() for t in tensors)
        return self._counted(super().recv(tensors, src_rank, tag), 0, delayed=received)


# ----------------------------------------------------------------------------------------------- the replica group
@dataclass(frozen=True)
class QuorumInfo:
    """One quorum, as this replica group saw it."""

    #: the lighthouse's id of the quorum (a new id: the members changed and the process group was rebuilt)
    quorum_id: int
    changed: bool
    #: this replica group's rank among the quorum's members, and their number
    replica_rank: int
    replica_world_size: int
    #: torchft's step (commits so far) before the quorum and after it (a healed group takes its peers')
    step_before: int
    step: int
    #: whether this group received a peer's state in this quorum
    healed: bool
    #: the error torchft recorded (the process group could not be rebuilt, the state transfer failed), if any
    error: str | None
    seconds: float


class ReplicaGroupComm:
    """One replica group's membership in the torchft quorum and its collectives with the other groups.

    Args:
        stats: the replica's :class:`~lightning_sync.comm.CommStats` (the one accounting path).
        clock: the replica's emulated link (shared with its :class:`~lightning_sync.comm.Communicator`), or ``None``.
        lighthouse: the lighthouse's URL (``http://host:29510``).
        replica_id: this replica group's name (restarts keep it; torchft adds a fresh suffix per process).
        min_replicas: the fewest replica groups a step may commit with.
        group_rank, group_world_size: this process among its replica group's processes (1 process per group for now).
        store_addr, store_port: the replica group's ``TCPStore`` (the default process group's rendezvous); other
            groups connect to the one of a quorum's primary to build the process group, so ``store_addr`` must be
            reachable from them.
        state_dict, load_state_dict: what a healthy group sends a group that is behind, and how that one loads it
            (called from the training thread, inside :meth:`quorum`).
        timeout: collectives, the state transfer and the commit; quorum_timeout: how long a quorum may wait for
            peers (a restarted group waits for its peers' next sync); connect_timeout: reaching the lighthouse.

    Raises:
        FaultToleranceError: the lighthouse cannot be reached within ``connect_timeout``.
    """

    def __init__(
        self,
        stats: CommStats,
        clock: LinkClock | None,
        lighthouse: str,
        replica_id: str,
        min_replicas: int,
        group_rank: int,
        group_world_size: int,
        store_addr: str,
        store_port: int,
        state_dict: Callable[[], Any],
        load_state_dict: Callable[[Any], None],
        timeout: timedelta,
        quorum_timeout: timedelta,
        connect_timeout: timedelta,
        hostname: str | None = None,
    ) -> None:
        self.stats = stats
        self.clock = clock
        self.lighthouse = lighthouse
        self.replica_id = replica_id
        self.timeout = timeout
        self._load = load_state_dict
        self._healed = False
        self.pg = CountedProcessGroupGloo(stats, clock, timeout)
        transport = PGTransport(self.pg, timeout=timeout, device=torch.device("cpu"))
        kwargs: dict[str, Any] = {} if hostname is None else {"hostname": hostname}
        try:
            self.manager = Manager(
                pg=self.pg,
                load_state_dict=self._on_load,
                state_dict=state_dict,
                min_replica_size=min_replicas,
                use_async_quorum=False,  # heal before the step, at the quorum (see the strategies' glue)
                timeout=timeout,
                quorum_timeout=quorum_timeout,
                connect_timeout=connect_timeout,
                rank=group_rank,
                world_size=group_world_size,
                store_addr=store_addr,
                store_port=store_port,
                lighthouse_addr=lighthouse,
                replica_id=replica_id,
                checkpoint_transport=transport,
                init_sync=True,
                **kwargs,
            )
        except Exception as err:  # noqa: BLE001 - torchft's RuntimeError from the Rust client
            text = str(err)
            if "connect" in text.lower():
                raise FaultToleranceError(
                    f"fault tolerance: replica group {replica_id!r} cannot reach the torchft lighthouse at "
                    f"{lighthouse} within {connect_timeout.total_seconds():g} s ({text}). "
                    f"{_lighthouse_help(lighthouse)}"
                ) from err
            raise

    def _on_load(self, state: Any) -> None:
        self._healed = True
        self._load(state)

    # ------------------------------------------------------------------ quorum and commit
    def quorum(self, timeout: timedelta | None = None) -> QuorumInfo:
        """Ask the lighthouse for a quorum and wait for it (torchft's ``start_quorum``, synchronous): the process group
        is rebuilt if the members changed, and a group that is behind receives a peer's state (``load_state_dict`` is
        called before this returns; a group that is ahead sends it). The state transfer is counted under the tag
        ``"recovery"``; the quorum as one operation (0 bytes, one emulated latency) under ``"quorum"``, with the time
        blocked in it. ``timeout`` bounds the wait for the lighthouse's answer (default: ``quorum_timeout``).

        Raises:
            FaultToleranceError: the quorum failed (the lighthouse is gone or timed out).
        """
        manager = self.manager
        before_id, before_step = manager._quorum_id, manager.current_step()
        self._healed = False
        start = time.perf_counter()
        self.pg.tag = "recovery"
        try:
            manager.start_quorum(timeout=timeout)
        except Exception as err:  # noqa: BLE001 - the quorum request itself failed
            waited = (timeout or manager._quorum_timeout).total_seconds()
            raise FaultToleranceError(
                f"fault tolerance: replica group {self.replica_id!r} could not get a quorum from the lighthouse at "
                f"{self.lighthouse} within {waited:g} s: {type(err).__name__}: {err}. The lighthouse is gone or did "
                "not answer; every replica group stops at its next sync. Start the lighthouse again and restart the "
                "replica groups (each resumes from its last checkpoint, or from a live peer)."
            ) from err
        finally:
            self.pg.tag = "ft"
        self.stats.record_launch("quorum", 0, blocking=True)
        if self.clock is not None:  # a request to the lighthouse and its answer: one latency on the emulated link
            self.clock.sleep_until_complete(self.clock.start(0, time.perf_counter()))
        seconds = time.perf_counter() - start
        self.stats.record_blocked("quorum", seconds)
        error = manager.errored()
        return QuorumInfo(
            quorum_id=int(manager._quorum_id),
            changed=manager._quorum_id != before_id,
            replica_rank=int(manager._participating_replica_rank or 0),
            replica_world_size=int(manager._participating_replica_world_size),
            step_before=before_step,
            step=manager.current_step(),
            healed=self._healed,
            error=None if error is None else _short(error.original_exception),
            seconds=seconds,
        )

    def commit(self) -> bool:
        """torchft's ``should_commit``: whether every collective since the quorum succeeded (in this replica group) and
        the quorum had ``min_replicas`` members; a commit advances torchft's step."""
        return bool(self.manager.should_commit())

    @property
    def step(self) -> int:
        return self.manager.current_step()

    @property
    def errored(self) -> bool:
        return self.manager.errored() is not None

    def why(self) -> str:
        """Why this quorum's commit failed (torchft's recorded error), for the log."""
        err = self.manager.errored()
        return "an error in this quorum" if err is None else str(err.original_exception)

    def agree(self, value: Any) -> Any:
        """A decision every process of the replica group takes alike (one process: its own)."""
        return value

    def report_error(self, err: BaseException) -> None:
        """Make this quorum's commit fail (e.g. a sync that could not complete on this side)."""
        self.manager.report_error(err if isinstance(err, Exception) else RuntimeError(str(err)))

    # ------------------------------------------------------------------ collectives over the quorum
    def _run(self, what: str, tag: str, ops: Callable[[], Sequence[Any]]) -> bool:
        """Issue ``ops`` (process-group calls), wait for them, charge the wait to ``tag``. A failure (a peer gone, the
        timeout) is recorded with torchft (this quorum's commit fails) and returns ``False``, never raises."""
        if self.manager.errored() is not None:
            return False
        start = time.perf_counter()
        self.pg.tag = tag
        try:
            for work in ops():
                work.wait()
            return True
        except Exception as err:  # noqa: BLE001 - gloo's error when a peer is gone or times out
            log.warning("replica group %s: %s (%s) failed: %s", self.replica_id, what, tag, _short(err))
            self.manager.report_error(err)
            return False
        finally:
            self.pg.tag = "ft"
            self.stats.record_blocked(tag, time.perf_counter() - start)

    def all_reduce(self, tensors: Sequence[Tensor], op: str = "avg", tag: str = "params") -> bool:
        """All-reduce ``tensors`` in place over the quorum's members (``"avg"``: the sum divided by their number, or
        ``"sum"``). ``False`` when it failed: the tensors are then garbage and this quorum's commit fails."""
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")

        def ops() -> list[Any]:
            out = []
            for t in tensors:
                opts = AllreduceOptions()
                opts.reduceOp = ReduceOp.SUM
                out.append(self.pg.allreduce([t], opts))
            return out

        ok = self._run("all_reduce", tag, ops)
        if ok and op == "avg":
            n = self.manager.num_participants()
            for t in tensors:
                t.div_(n)
        return ok

    def all_reduce_async(self, tensors: Sequence[Tensor], op: str = "avg", tag: str = "params") -> PendingAllReduce:
        """Launch an all-reduce of ``tensors`` over the quorum's members and return at once: the operations are in
        flight while this replica group computes (counted as overlapped, not blocking), until
        :meth:`PendingAllReduce.wait`. No quorum may be held before that wait (the process group would be rebuilt
        under it); the caller commits after it. A launch that fails returns a handle that has failed already."""
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        pending = PendingAllReduce(self, list(tensors), self.manager.num_participants() if op == "avg" else 1, tag)
        if self.manager.errored() is not None:
            pending.ok = False
            return pending
        self.pg.tag, self.pg.blocking = tag, False
        try:
            for t in pending.tensors:
                opts = AllreduceOptions()
                opts.reduceOp = ReduceOp.SUM
                pending.works.append(self.pg.allreduce([t], opts))
        except Exception as err:  # noqa: BLE001 - gloo's error when the group cannot be used
            log.warning("replica group %s: all_reduce (%s) failed at launch: %s", self.replica_id, tag, _short(err))
            self.manager.report_error(err)
            pending.ok = False
        finally:
            self.pg.tag, self.pg.blocking = "ft", True
        return pending

    def all_gather_object(self, obj: Any, tag: str = "setup") -> list[Any] | None:
        """Every quorum member's ``obj`` (pickled), in replica-rank order; ``None`` when the gather failed."""
        payload = pickle.dumps(obj)
        n = self.manager.num_participants()
        length = torch.tensor([len(payload)], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        if not self._run("all_gather", tag, lambda: [self.pg.allgather([lengths], [length], AllgatherOptions())]):
            return None
        longest = int(max(int(x.item()) for x in lengths))
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(n)]
        if not self._run("all_gather", tag, lambda: [self.pg.allgather([bufs], [buf], AllgatherOptions())]):
            return None
        return [pickle.loads(b[: int(x.item())].numpy().tobytes()) for b, x in zip(bufs, lengths)]

    # ------------------------------------------------------------------ state and shutdown
    def state_dict(self) -> dict[str, int]:
        """torchft's step and committed batches (kept in checkpoints: a resumed group must not look behind)."""
        return dict(self.manager.state_dict())

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.manager.load_state_dict(dict(state))

    def shutdown(self) -> None:
        """Stop the Manager (its heartbeats: the lighthouse drops this group after its heartbeat timeout)."""
        try:
            self.manager.shutdown(wait=True)
        finally:
            self.pg.shutdown()


class ReplicaMirror:
    """A replica group of several processes (one Lightning job of a node, exact data parallelism inside): its first
    process (the *leader*) is the group's one member of the torchft quorum (a :class:`ReplicaGroupComm`); the others
    follow it over the replica's own communicator ``intra``. The same interface as :class:`ReplicaGroupComm`, called by
    every process at the same points: the leader runs each operation with the other groups, then broadcasts its outcome
    inside the replica (the quorum's answer and a state received from a peer, an all-reduce's result, a commit's
    verdict), so every process of the group decides alike and holds the same values. Bytes inside the replica are the
    replica level's (``"intra/ft"``, ``"intra/<tag>"``); between groups only the leader sends, as with replica groups
    (:mod:`~lightning_sync.strategies.replicas`).

    Args:
        inner: the leader's :class:`ReplicaGroupComm` (built with ``load_state_dict=mirror.capture``, set once built);
            ``None`` on the other processes.
        intra: the communicator over the replica group's processes (leader = its rank 0).
        load_state_dict: how every process loads a state the leader received from a peer.
        leader: whether this process is the leader (the replica group's rank 0).
    """

    def __init__(
        self, inner: ReplicaGroupComm | None, intra: Any, load_state_dict: Callable[[Any], None], leader: bool
    ) -> None:
        self.inner = inner
        #: whether this process is the group's leader (its ``inner`` is set once it joined the quorum)
        self.leader = leader
        self.intra = intra
        self._load = load_state_dict
        self._captured: Any = None
        self._step = 0
        self._state: dict[str, int] = {}
        self._why = "an error in this quorum"

    def capture(self, state: Any) -> None:
        """The leader's ``load_state_dict`` for torchft: kept until the quorum's outcome is shared."""
        self._captured = state

    def _share(self, value: Any) -> Any:
        return self.intra.broadcast_object(value, src=0, tag="ft")

    def agree(self, value: Any) -> Any:
        """The leader's ``value`` on every process of the group."""
        return self._share(value if self.leader else None)

    # ------------------------------------------------------------------ quorum and commit
    def quorum(self, timeout: timedelta | None = None) -> QuorumInfo:
        payload: Any = None
        if self.leader:
            self._captured = None
            try:
                info = self.inner.quorum(timeout)
                payload = ("ok", info, self._captured, self.inner.state_dict())
            except FaultToleranceError as err:
                payload = ("error", str(err))
            self._captured = None
        payload = self._share(payload)
        if payload[0] == "error":
            raise FaultToleranceError(payload[1])
        _, info, received, state = payload
        self._step, self._state = info.step, state
        if received is not None:
            self._load(received)
        return info

    def commit(self) -> bool:
        verdict = (self.inner.commit(), self.inner.state_dict(), self.inner.why()) if self.leader else None
        committed, self._state, self._why = self._share(verdict)
        self._step = int(self._state.get("step", self._step))
        return bool(committed)

    @property
    def step(self) -> int:
        return self.inner.step if self.leader else self._step

    def why(self) -> str:
        return self.inner.why() if self.leader else self._why

    # ------------------------------------------------------------------ collectives over the quorum
    def _spread(self, ok: bool | None, tensors: Sequence[Tensor], tag: str) -> bool:
        """The leader's outcome, then (on success) its result, to every process of the group."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        self.intra.broadcast(flag, src=0, tag="ft")
        if not int(flag.item()):
            return False
        for t in tensors:
            if t.numel():
                self.intra.broadcast(t, src=0, tag=tag)
        return True

    def all_reduce(self, tensors: Sequence[Tensor], op: str = "avg", tag: str = "params") -> bool:
        ok = self.inner.all_reduce(tensors, op=op, tag=tag) if self.leader else None
        return self._spread(ok, tensors, tag)

    def all_reduce_async(self, tensors: Sequence[Tensor], op: str = "avg", tag: str = "params") -> MirroredPending:
        inner = self.inner.all_reduce_async(tensors, op=op, tag=tag) if self.leader else None
        return MirroredPending(self, inner, list(tensors), tag)

    def all_gather_object(self, obj: Any, tag: str = "setup") -> list[Any] | None:
        gathered = self.inner.all_gather_object(obj, tag=tag) if self.leader else None
        return self._share(gathered)

    # ------------------------------------------------------------------ state and shutdown
    def state_dict(self) -> dict[str, int]:
        return self.inner.state_dict() if self.leader else dict(self._state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._state = dict(state)
        self._step = int(state.get("step", self._step))
        if self.leader:
            self.inner.load_state_dict(state)

    def shutdown(self) -> None:
        if self.leader:
            self.inner.shutdown()


class MirroredPending:
    """:meth:`ReplicaMirror.all_reduce_async`'s handle: the leader's all-reduce in flight; :meth:`wait` shares its
    outcome and result inside the replica group (every process calls it at the same point)."""

    def __init__(self, mirror: ReplicaMirror, inner: PendingAllReduce | None, tensors: list[Tensor], tag: str) -> None:
        self.mirror = mirror
        self.inner = inner
        self.tensors = tensors
        self.tag = tag
        self.ok: bool | None = None

    def is_completed(self) -> bool:
        return self.ok is not None or (self.inner is not None and self.inner.is_completed())

    def wait(self) -> bool:
        if self.ok is None:
            ok = self.inner.wait() if self.inner is not None else None
            self.ok = self.mirror._spread(ok, self.tensors, self.tag)
        return self.ok


class PendingAllReduce:
    """An all-reduce :meth:`ReplicaGroupComm.all_reduce_async` launched: :meth:`wait` once (again: the same answer)."""

    def __init__(self, comm: ReplicaGroupComm, tensors: list[Tensor], divisor: int, tag: str) -> None:
        self.comm = comm
        self.tensors = tensors
        self.divisor = divisor
        self.tag = tag
        self.works: list[Any] = []
        #: ``None`` until waited on; then whether it succeeded (the tensors hold the result) or failed (garbage, and
        #: this quorum's commit fails)
        self.ok: bool | None = None

    def is_completed(self) -> bool:
        return self.ok is not None or all(w.is_completed() for w in self.works)

    def wait(self) -> bool:
        """Wait for the all-reduce (the wait is charged to its tag); a failure (a peer gone, the timeout) is recorded
        with torchft and returns ``False``, never raises. On success an ``"avg"`` is divided by the members' number."""
        if self.ok is not None:
            return self.ok
        start = time.perf_counter()
        try:
            for work in self.works:
                work.wait()
            self.ok = True
        except Exception as err:  # noqa: BLE001 - gloo's error when a peer is gone or times out
            log.warning("replica group %s: all_reduce (%s) failed: %s", self.comm.replica_id, self.tag, _short(err))
            self.comm.manager.report_error(err)
            self.ok = False
        finally:
            self.comm.stats.record_blocked(self.tag, time.perf_counter() - start)
        if self.ok and self.divisor != 1:
            with torch.no_grad():
                for t in self.tensors:
                    t.div_(self.divisor)
        return self.ok


def _short(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(err).__name__}: {text}"
