"""A sharded replica group on torchft: every rank is a member of its shard index's quorum (:class:`ShardMember`).

torchft's HSDP layout: a replica group whose model is sharded with FSDP2 over its ranks runs one torchft ``Manager``
per rank (``group_rank`` / ``group_world_size``). The group's rank 0 serves the group's store and torchft's manager
server, which gathers its ranks' quorum and commit requests and speaks for the group to the lighthouse: every rank
of a group sees the same quorum and the same commit verdict (one rank's failed collective fails the commit of all).
Each rank configures its own reconfigurable process group from the quorum, keyed by its group rank (torchft's
``<store>/torchft/<quorum id>/<group rank>``): one process group per shard index, over the ranks that hold that
shard in every live group. The averages of a sync run there, each rank on its own shard, and a group that is behind
receives each shard from the same shard of a live group (torchft's ``PGTransport`` over that process group, counted
as ``"recovery"`` as for unsharded groups).

:func:`join_sharded` builds a rank's membership (rank 0 first: a lighthouse it cannot reach stops every rank of the
group with its error); :class:`ShardMember` is the interface :class:`~lightning_sync.comm.ft.ReplicaGroupComm` and
:class:`~lightning_sync.comm.ft.ReplicaMirror` have, for one rank: the averages over this shard index's quorum, and
over the group's own communicator what every rank must decide alike (:meth:`ShardMember.agree`) and the members'
configurations (:meth:`ShardMember.gather_groups`: shard 0's gather, shared inside the group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from torch import Tensor

from lightning_sync.comm.communicator import Communicator
from lightning_sync.comm.ft.errors import FaultToleranceError
from lightning_sync.comm.ft.replica_group import PendingAllReduce, QuorumInfo, ReplicaGroupComm

__all__ = ["ShardMember", "join_sharded"]


class ShardMember:
    """One rank of a sharded replica group in torchft's quorum (see the module docstring).

    Args:
        inner: this rank's :class:`~lightning_sync.comm.ft.ReplicaGroupComm` (``group_rank`` = its rank in the group).
        group: the communicator over the group's ranks (its shards; its rank 0 is the group's rank 0).
    """

    def __init__(self, inner: ReplicaGroupComm, group: Communicator) -> None:
        self.inner = inner
        self.group = group

    def agree(self, value: Any) -> Any:
        """The group's rank 0's ``value`` on every rank of the group (its clock decides a wait alike everywhere)."""
        return self.group.broadcast_object(value, src=0, tag="ft")

    # ------------------------------------------------------------------ quorum and commit (torchft's, per rank)
    def quorum(self, timeout: timedelta | None = None) -> QuorumInfo:
        return self.inner.quorum(timeout)

    def commit(self) -> bool:
        """torchft's ``should_commit``: the manager server gathers every rank's, so the group commits as one."""
        return self.inner.commit()

    @property
    def step(self) -> int:
        return self.inner.step

    def why(self) -> str:
        return self.inner.why()

    def report_error(self, err: BaseException) -> None:
        self.inner.report_error(err)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensors: Sequence[Tensor], op: str = "avg", tag: str = "params") -> bool:
        """Over this shard index's quorum: each rank's shard with the same shard of the other live groups."""
        return self.inner.all_reduce(tensors, op=op, tag=tag)

    def all_reduce_async(self, tensors: Sequence[Tensor], op: str = "avg", tag: str = "params") -> PendingAllReduce:
        return self.inner.all_reduce_async(tensors, op=op, tag=tag)

    def all_gather_object(self, obj: Any, tag: str = "setup") -> list[Any] | None:
        """Every quorum member's ``obj`` for this shard index (e.g. a shard's checksum), in replica-rank order."""
        return self.inner.all_gather_object(obj, tag=tag)

    def gather_groups(self, obj: Any, tag: str = "setup") -> list[Any] | None:
        """One ``obj`` per live replica group, the same on every rank of this group: shard 0's gather (every group has
        a rank 0, whatever its shard count), shared inside the group. The members' configurations are compared on it,
        so a group with another shard count, whose other shard indices have no peer, fails with the cause."""
        gathered = self.inner.all_gather_object(obj, tag=tag) if self.group.rank == 0 else None
        return self.group.broadcast_object(gathered, src=0, tag="ft")

    # ------------------------------------------------------------------ state and shutdown
    def state_dict(self) -> dict[str, int]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.inner.load_state_dict(state)

    def shutdown(self) -> None:
        self.inner.shutdown()


def join_sharded(group: Communicator, build: Callable[[int, int, int | None], ReplicaGroupComm]) -> ShardMember:
    """This rank's membership of a sharded replica group: ``build(group_rank, group_world_size, store_port)`` makes
    its :class:`~lightning_sync.comm.ft.ReplicaGroupComm`. The group's rank 0 joins first (it serves the group's
    store and torchft's manager server, and reaches the lighthouse); its outcome and its store's port go to the
    other ranks over ``group``, which then join through it.

    Raises:
        FaultToleranceError: rank 0 could not join (the lighthouse unreachable...): its error on rank 0, and on the
            other ranks an error quoting it.
    """
    rank, size = group.rank, group.world_size
    inner, failed, outcome = None, None, None
    if rank == 0:
        try:
            inner = build(0, size, None)
            outcome = ("ok", inner.store_port)
        except Exception as err:  # the group's other ranks stop with the same cause
            failed = err
            outcome = ("error", f"{type(err).__name__}: {err}")
    outcome = group.broadcast_object(outcome, src=0, tag="ft")
    if failed is not None:
        raise failed
    if outcome[0] == "error":
        raise FaultToleranceError(f"fault tolerance: the replica group's leader (rank 0) could not join: {outcome[1]}")
    if inner is None:
        inner = build(rank, size, int(outcome[1]))
    return ShardMember(inner, group)
