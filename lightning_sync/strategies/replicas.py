"""Replica groups: exact data parallelism inside a replica of several ranks (a node), the method between replicas.

``SyncStrategy(replica_size=...)`` makes consecutive global ranks one replica: ``"node"`` the ranks of one node
(Lightning's ``devices`` per node), an integer that many ranks (it must divide the world size), ``None`` (default)
every rank a replica — the flat behaviour, unchanged. With groups of more than one rank:

* **inside a replica, every step**: the gradients (and floating buffers) are averaged over the replica's ranks with
  BSP's bucketed all-reduce overlapped with backward (:mod:`~lightning_sync.strategies.overlap`), exact (never
  compressed), before the method's ``_after_backward``: the ranks of a replica step on the same gradient and stay
  bit-identical. The method sees the replica's averaged gradient.
* **between replicas**: the method's syncs (``average_state``, ``average_grads``, DiLoCo's fragments, ADPSGD's
  statistic, the validation average) run on the replica's first rank (its *leader*) over a group of the leaders,
  then the result is broadcast inside the replica. A node's ranks share its network interface, so one sender per
  node is what a real cluster does with its slow link (and what the per-rank link emulation is faithful to). The
  bytes a leader sends between replicas are the method's flat bytes with the number of replicas as the world size;
  the other ranks of a replica send none of them.

Each level has its own communicator: :attr:`ReplicaGroups._intra` over the replica's ranks (operations recorded as
``"intra/<tag>"``, emulated on ``intra_link``, default none) and :attr:`ReplicaGroups._inter` over the leaders (the
strategy's ``link``, sharing the rank's clock with the communicator over all ranks). Control traffic over all ranks
— the SIGTERM check, SelSync's vote (every rank of a replica casts the same vote from the same averaged gradient:
one all-reduce per step, as flat, instead of a leaders' all-reduce plus a broadcast in the replica), Lightning's own
collectives, ``verify_sync``'s checksums, checkpoints — stays on the communicator over all ranks and counts as
traffic between replicas.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_sync.comm import Communicator, LinkModel
from lightning_sync.comm.accounting import INTRA

ReplicaSize = int | Literal["node"] | None


def check_replica_size(value: Any) -> int | str | None:
    """The ``replica_size`` argument: ``None`` (every rank a replica), ``"node"`` (the ranks of one node) or an
    integer >= 1 (that many consecutive global ranks; it must divide the world size, checked at setup)."""
    if value is None or (isinstance(value, str) and value == "node"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(
        "replica_size must be None (every rank a replica), 'node' (the ranks of one node form a replica) or an "
        f"integer >= 1 (that many consecutive ranks), got {value!r}"
    )


class ReplicaGroups:
    """Mixin of :class:`~lightning_sync.strategies.SyncStrategy` (see the module docstring). The strategy's
    ``__init__`` sets ``replica_size`` and ``intra_link``; ``setup_environment`` calls
    :meth:`_setup_replica_groups`, ``teardown`` :meth:`_teardown_replica_groups`; the averages call
    :meth:`_average_in_replica` and :meth:`_share_in_replica` (the averages between replicas are
    :class:`~lightning_sync.strategies.topology.GroupedTopology`'s)."""

    #: Why this method cannot run with replica groups (``None``: it can). A strategy that sets it refuses
    #: ``replica_size`` and ``intra_link`` at construction with this reason.
    replica_groups_refusal: ClassVar[str | None] = None
    #: With replica groups: bucket size in MiB of the intra-replica gradient all-reduce overlapped with backward
    #: (BSP: its ``bucket_cap_mb``); ``None``: one all-reduce after backward.
    intra_bucket_cap_mb: float | None = 25.0

    replica_size: int | str | None
    intra_link: LinkModel | None
    #: ranks per replica, resolved at setup (1: every rank a replica, the flat behaviour)
    ranks_per_replica: int = 1
    _intra: Communicator | None = None  # over this rank's replica (replica groups only)
    _inter: Communicator | None = None  # over the replicas' leaders, on the leaders only (replica groups only)

    # ------------------------------------------------------------------ topology
    @property
    def grouped(self) -> bool:
        """Whether replicas span several ranks (the intra-replica level exists)."""
        return self.ranks_per_replica > 1

    @property
    def num_replicas(self) -> int:
        """How many replicas train (the world size when every rank is one)."""
        return self.world_size // self.ranks_per_replica

    @property
    def replica_index(self) -> int:
        """This rank's replica (its global rank when every rank is one)."""
        return self.global_rank // self.ranks_per_replica

    @property
    def is_replica_leader(self) -> bool:
        """Whether this rank is its replica's first, the one that communicates between replicas."""
        return self.global_rank % self.ranks_per_replica == 0

    def replica_ranks(self, replica: int) -> list[int]:
        """The global ranks of replica ``replica``."""
        return list(range(replica * self.ranks_per_replica, (replica + 1) * self.ranks_per_replica))

    def leader_ranks(self) -> list[int]:
        """The global ranks of the replicas' leaders."""
        return [r * self.ranks_per_replica for r in range(self.num_replicas)]

    # ------------------------------------------------------------------ setup
    def _resolve_replica_size(self) -> int:
        """At setup, before any collective: ranks per replica from ``replica_size`` and the Trainer's topology."""
        name = type(self).__name__
        world = self.world_size
        if self.replica_size is None:
            size = 1
        elif self.replica_size == "node":
            size = self.num_processes  # Lightning's devices per node: the ranks of one node, consecutive
        else:
            size = int(self.replica_size)
            if world % size:
                raise ValueError(
                    f"{name}(replica_size={size}): replica_size must divide the world size {world} "
                    f"(num_nodes={self.num_nodes} x devices={self.num_processes}); use a divisor of {world}, 'node' "
                    "(the ranks of one node), or None (every rank a replica)"
                )
        if self.intra_link is not None and size == 1:
            why = "replica_size=None" if self.replica_size is None else f"replica_size={self.replica_size!r} is 1 rank"
            raise ValueError(
                f"{name}(intra_link={self.intra_link}): intra_link emulates the link inside a replica group, and "
                f"this run has none ({why}, every rank a replica). Set replica_size to 'node' or a group size > 1, "
                "or leave intra_link=None (the link argument emulates the link between replicas)."
            )
        if size > 1 and size == world and getattr(self, "fault_tolerance", None) is None:
            rank_zero_warn(
                f"{name}(replica_size={self.replica_size!r}): all {world} ranks form one replica, so there is no "
                "other replica to synchronise with: this trains as exact data parallelism (BSP) over every rank. Use "
                "num_nodes > 1 (replica_size='node'), or a smaller replica_size."
            )
        return size

    def _setup_replica_groups(self) -> None:
        """At ``setup_environment`` (every rank, same order): the intra-replica communicator of every replica and
        the leaders' communicator (group creation is collective over the world)."""
        self._teardown_replica_groups()
        if not self.grouped:
            return
        self._intra = None
        for replica in range(self.num_replicas):
            comm = self.comm.subgroup(self.replica_ranks(replica), level=INTRA, link=self.intra_link)
            if comm is not None:
                self._intra = comm
        self._inter = self._new_inter_comm()

    def _new_inter_comm(self) -> Communicator | None:
        """A communicator over the replicas' leaders (``None`` on the other ranks), on the strategy's link and this
        rank's clock. Every rank calls it at the same point (a second one: an independent group, e.g. for
        asynchronous syncs beside blocking ones)."""
        return self.comm.subgroup(self.leader_ranks())

    def _teardown_replica_groups(self) -> None:
        for comm in (self._intra, self._inter):
            if comm is not None:
                comm.destroy()
        self._intra = self._inter = None

    # ------------------------------------------------------------------ the two levels
    def _average_in_replica(self) -> None:
        """Every step after backward, with replica groups: the replica's ranks average their gradients and floating
        buffers (the buckets launched during backward, the rest now; or one all-reduce after backward), exactly."""
        intra = self._intra
        if intra is None:
            return
        flat = self.flat
        buckets = self._grad_buckets
        if buckets is not None and buckets.armed:
            tensors = buckets.finish(self.comm)  # find_unused_parameters: which parameters no rank used, over all
        else:
            flat.stage_buffers()
            tensors = flat.grad_tensors()
            intra.all_reduce_many(tensors, op="avg", tag="grads")
            flat.unstage_buffers()
        if self.verify_sync:
            self._verify(tensors, "gradients and buffers inside the replica", intra)
            self._verify_after_update = intra  # and the parameters after the update (a sync may widen it to all)

    def _share_in_replica(self, tensors: list[Tensor], tag: str) -> None:
        """The leader's values to every rank of its replica (one broadcast per tensor, ``"intra/<tag>"``)."""
        if self._intra is not None:
            for t in tensors:
                if t.numel():
                    self._intra.broadcast(t, src=0, tag=tag)
