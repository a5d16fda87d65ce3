"""The counted reconfigurable process group: torchft's gloo group, rebuilt for each quorum, recording every operation
in the replica's :class:`~lightning_sync.comm.CommStats` and delaying it on its emulated link."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sync.comm.accounting import CommStats
from lightning_sync.comm.cost import allgather_bytes, allreduce_bytes, broadcast_bytes
from lightning_sync.comm.ft._torchft import ProcessGroupGloo
from lightning_sync.comm.link import LinkClock

__all__ = ["CountedProcessGroupGloo"]


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
