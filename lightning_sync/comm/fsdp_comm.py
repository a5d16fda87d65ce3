"""FSDP2's own collectives through the pack's accounting: its all-gathers (a module's shards, before its forward and
again before its backward when it was resharded) and reduce-scatters (a module's gradients, after its backward)
carried by a :class:`~lightning_sync.comm.Communicator` over FSDP2's process group, so they are counted, as every
collective of the pack, and delayed on an emulated link.

FSDP2 (torch 2.14) lets a module's collectives be replaced: ``FSDPModule.set_custom_all_gather`` and
``set_custom_reduce_scatter`` take an ``AllGather`` / ``ReduceScatter``
(``torch.distributed.fsdp._fully_shard._fsdp_api``) that allocates the collective's buffers and runs it on the
group FSDP2 passes. :class:`CountedAllGather` and :class:`CountedReduceScatter` run the same collective that
FSDP2's defaults run (``all_gather_single``, ``reduce_scatter_single`` on the same tensors, group and reduce
operation: the values are bit-identical to FSDP2's own) through :meth:`Communicator.all_gather_into` and
:meth:`Communicator.reduce_scatter_into`: bytes sent recorded under the tags :data:`ALL_GATHER` and
:data:`REDUCE_SCATTER` (``"intra/fsdp_all_gather"`` on an intra-replica level), and under link emulation each
collective waits for its emulated transfer.

Both are blocking, as FSDP2 calls them on CPU by default: a module's all-gather is issued with ``async_op=False``
unless the user asks for ``set_unshard_in_backward``-style asynchronous unsharding (``unshard(async_op=True)``),
and then it still completes before returning (``None`` is returned: FSDP2 waits on nothing). On CUDA, FSDP2 issues
its collectives on side streams to overlap them with compute; here the emulated transfer is waited on the host, so
the overlap FSDP2 gets from its streams is not emulated (the link row is then pessimistic for FSDP2 on GPUs).

:func:`count_fsdp_collectives` installs them on every FSDP2 module of a model that holds parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from lightning_sync.comm.accounting import CommStats, LevelStats
from lightning_sync.comm.communicator import Communicator
from lightning_sync.comm.link import LinkClock, LinkModel

__all__ = [
    "ALL_GATHER",
    "REDUCE_SCATTER",
    "CountedAllGather",
    "CountedReduceScatter",
    "FSDPCounting",
    "count_fsdp_collectives",
]

#: the accounting tags of FSDP2's collectives
ALL_GATHER, REDUCE_SCATTER = "fsdp_all_gather", "fsdp_reduce_scatter"


class _Allocate:
    """FSDP2's default allocation (``DefaultAllocMixin``): a plain ``torch.empty``."""

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class FSDPCounting:
    """A rank's counted FSDP2 collectives: one :class:`~lightning_sync.comm.Communicator` per process group FSDP2
    uses (created at its first collective there: a communicator over an existing group is not collective), all
    recording into ``stats`` and sharing one emulated link (``clock``, or a new one on ``link``; neither: counted,
    not delayed)."""

    def __init__(
        self, stats: CommStats | LevelStats, link: LinkModel | None = None, clock: LinkClock | None = None
    ) -> None:
        self.stats = stats
        self.link = link
        self.clock = clock if clock is not None else (LinkClock(link) if link is not None else None)
        self._comms: dict[int, Communicator] = {}

    def comm(self, group: Any) -> Communicator:
        """The communicator over ``group`` (FSDP2's process group of a collective)."""
        if id(group) not in self._comms:
            self._comms[id(group)] = Communicator(self.stats, self.link, group=group, clock=self.clock)
        return self._comms[id(group)]

    @property
    def communicators(self) -> list[Communicator]:
        return list(self._comms.values())


class CountedAllGather(_Allocate, AllGather):
    """FSDP2's all-gather of a module's shards, through ``counting``'s communicator (tag :data:`ALL_GATHER`)."""

    def __init__(self, counting: FSDPCounting) -> None:
        self.counting = counting

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> None:
        self.counting.comm(group).all_gather_into(output_tensor, input_tensor, tag=ALL_GATHER)
        return None


class CountedReduceScatter(_Allocate, ReduceScatter):
    """FSDP2's reduce-scatter of a module's gradients, through ``counting``'s communicator (tag
    :data:`REDUCE_SCATTER`)."""

    def __init__(self, counting: FSDPCounting) -> None:
        self.counting = counting

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> None:
        self.counting.comm(group).reduce_scatter_into(output_tensor, input_tensor, op, tag=REDUCE_SCATTER)
        return None


def count_fsdp_collectives(
    module: nn.Module,
    stats: CommStats | LevelStats,
    link: LinkModel | None = None,
    clock: LinkClock | None = None,
) -> FSDPCounting:
    """Route the all-gathers and reduce-scatters of every FSDP2 module in ``module`` (sharded with ``fully_shard``)
    through the pack's communicators (:class:`FSDPCounting`), recording into ``stats`` (a
    :class:`~lightning_sync.comm.accounting.LevelStats` for the traffic inside a replica:
    ``"intra/fsdp_all_gather"``), emulated on ``link`` (``clock``: share an existing link's clock; neither: counted,
    not delayed). Call it after ``fully_shard`` and before the first forward; returns the counting."""
    from torch.distributed.fsdp import FSDPModule

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("count_fsdp_collectives needs an initialised torch.distributed default process group")
    counting = FSDPCounting(stats, link, clock)
    for sub in module.modules():
        if isinstance(sub, FSDPModule) and sub._get_fsdp_state()._fsdp_param_group is not None:
            sub.set_custom_all_gather(CountedAllGather(counting))
            sub.set_custom_reduce_scatter(CountedReduceScatter(counting))
    return counting
