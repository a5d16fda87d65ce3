"""Dynamic work assignment for the parameter-server methods: one shared batch counter per epoch.

Asynchronous ranks run at their own pace, so rather than a fixed share of the epoch each rank claims the next batch
position from a counter in a ``TCPStore`` hosted by rank 0 (an atomic ``add``): each position is trained by exactly
one rank, and a faster rank claims more. :meth:`WorkCounter.exhaust` ends an epoch on every rank at its next claim.
The same store carries small control messages (:meth:`WorkCounter.post` / :meth:`WorkCounter.poll`: Sync-Switch
releases its parked ranks with them).

Accounting: every request is counted under the tag ``"work"`` (the bytes of TCPStore's request) and the claims'
waits as blocked time. A request that fails because the store (on rank 0) is unreachable raises a
:class:`~lightning_sync.comm.fault.PeerFailure`.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from lightning_sync.comm.accounting import CommStats
from lightning_sync.comm.communicator import Communicator
from lightning_sync.comm.fault import failures

__all__ = ["WorkCounter"]


class WorkCounter:
    """Dynamic work assignment: one shared counter per epoch in a ``TCPStore`` hosted by rank 0.

    ``claim(epoch)`` returns the next unclaimed batch position of that epoch (``add`` is atomic in the store), so
    each position goes to exactly one rank and a faster rank claims more. ``exhaust(epoch)`` pushes the counter
    past any dataset, ending the epoch on every rank at its next claim (used to stop all ranks on SIGTERM).
    """

    #: a position past any dataset: a claim that returns it (or more) finds the epoch's data consumed
    EXHAUSTED = 1 << 40

    #: bytes of one ``add`` request in TCPStore's protocol: command byte, 8-byte key length, key, int64 value
    @staticmethod
    def request_bytes(key: str) -> int:
        return 1 + 8 + len(key.encode()) + 8

    def __init__(
        self, comm: Communicator, host: str, stats: CommStats, timeout: timedelta, prefix: str = "work"
    ) -> None:
        self.stats = stats
        self.prefix = prefix
        self.rank = comm.rank
        port = 0
        master = None
        if comm.rank == 0:
            master = dist.TCPStore(host, 0, comm.world_size, True, timeout=timeout, wait_for_workers=False)
            port = master.port
        port = comm.broadcast_object(port, src=0, tag="setup")
        self.store = (
            master if master is not None else dist.TCPStore(host, port, comm.world_size, False, timeout=timeout)
        )
        self.claims: dict[int, int] = {}

    def _key(self, epoch: int, segment: int = 0) -> str:
        return f"{self.prefix}/{epoch}" if segment == 0 else f"{self.prefix}/{epoch}/{segment}"

    def claim(self, epoch: int, segment: int = 0) -> int:
        """The next unclaimed position of ``epoch``'s counter (``segment`` > 0: a fresh counter of the same epoch,
        for a run that starts claiming part-way through an epoch; the caller adds its offset)."""
        key = self._key(epoch, segment)
        self.stats.record_launch("work", self.request_bytes(key), blocking=True)
        start = time.perf_counter()
        with failures("a work-assignment claim (store on rank 0)"):
            value = int(self.store.add(key, 1)) - 1
        self.stats.record_blocked("work", time.perf_counter() - start)
        self.claims[epoch] = self.claims.get(epoch, 0) + 1
        return value

    def own(self, epoch: int) -> None:
        """Count a position of ``epoch`` this rank takes without asking the store (its own first batch of the epoch):
        :attr:`claims` stays the number of positions the rank took, plus its one claim past the end."""
        self.claims[epoch] = self.claims.get(epoch, 0) + 1

    def exhaust(self, epoch: int) -> None:
        key = self._key(epoch)
        self.stats.record_launch("work", self.request_bytes(key), blocking=True)
        with failures("ending the epoch on the work counter (store on rank 0)"):
            self.store.add(key, self.EXHAUSTED)

    def post(self, name: str, value: str) -> None:
        """Publish a small control message under ``name`` (read by :meth:`poll` on any rank)."""
        key = f"{self.prefix}/msg/{name}"
        self.stats.record_launch("work", self.request_bytes(key) + len(value.encode()), blocking=True)
        with failures("posting a message on the work counter's store (on rank 0)"):
            self.store.set(key, value)

    def poll(self, name: str) -> str | None:
        """The message posted under ``name``, or ``None`` if none was posted yet (never blocks)."""
        key = f"{self.prefix}/msg/{name}"
        self.stats.record_launch("work", self.request_bytes(key), blocking=True)
        with failures("polling the work counter's store (on rank 0)"):
            if not self.store.check([key]):
                return None
            return bytes(self.store.get(key)).decode()

    def close(self) -> None:
        self.store = None  # type: ignore[assignment]
