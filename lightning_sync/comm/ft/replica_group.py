"""One replica group's membership in the torchft quorum (:class:`ReplicaGroupComm`: torchft's ``Manager`` over a
:class:`~lightning_sync.comm.ft.process_group.CountedProcessGroupGloo`): quorum, commit, the averages over the
quorum (also in flight, :class:`PendingAllReduce`) and a small all-gather."""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceOp

from lightning_sync.comm.accounting import CommStats
from lightning_sync.comm.ft._torchft import Manager, PGTransport
from lightning_sync.comm.ft.errors import FaultToleranceError, _short
from lightning_sync.comm.ft.lighthouse import _lighthouse_help
from lightning_sync.comm.ft.process_group import CountedProcessGroupGloo
from lightning_sync.comm.link import LinkClock

__all__ = ["PendingAllReduce", "QuorumInfo", "ReplicaGroupComm"]

log = logging.getLogger(__name__)


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
        group_rank, group_world_size: this process among its replica group's processes (one process per group, or
            a sharded group's ranks: each a member of its shard index's quorum, :mod:`~lightning_sync.comm.ft.shard`).
        store_addr: the address of this membership's own ``TCPStore``, served on a free port for as long as it lives:
            other groups connect to the one of a quorum's primary to build the process group, so ``store_addr`` must
            be reachable from them. Its own store, not the default process group's: torchft keys the rendezvous by
            quorum id, and a later membership in the same process (another fit, against a restarted lighthouse whose
            ids start again) would read the earlier one's stale addresses from a shared store.
        store_port: the port of the group's store served by its rank 0's membership (:attr:`store_port` there), for
            the group's other ranks; ``None``: serve it (one process per group, or a group's rank 0).
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
        state_dict: Callable[[], Any],
        load_state_dict: Callable[[Any], None],
        timeout: timedelta,
        quorum_timeout: timedelta,
        connect_timeout: timedelta,
        hostname: str | None = None,
        store_port: int | None = None,
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
        self.store = (
            None
            if store_port is not None
            else TCPStore(store_addr, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        )
        #: the port of the group's store (the one this membership serves, or its rank 0's)
        self.store_port = int(self.store.port) if self.store is not None else int(store_port)
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
                store_port=self.store_port,
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

    def gather_groups(self, obj: Any, tag: str = "setup") -> list[Any] | None:
        """One ``obj`` per live replica group (this group's one member: :meth:`all_gather_object`)."""
        return self.all_gather_object(obj, tag=tag)

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
