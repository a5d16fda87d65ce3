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

The layout is :class:`ReplicaGroups`, a component every :class:`~lightning_sync.strategies.SyncStrategy` owns
(``strategy.replicas``; the strategy's ``num_replicas``, ``replica_index``, ``is_replica_leader`` and
``ranks_per_replica`` read it). Each level has its own communicator: :attr:`ReplicaGroups.intra` over the replica's
ranks (operations recorded as ``"intra/<tag>"``, emulated on ``intra_link``, default none) and
:attr:`ReplicaGroups.inter` over the leaders (the strategy's ``link``, sharing the rank's clock with the
communicator over all ranks). Control traffic over all ranks — the SIGTERM check, SelSync's vote (every rank of a
replica casts the same vote from the same averaged gradient: one all-reduce per step, as flat, instead of a leaders'
all-reduce plus a broadcast in the replica), Lightning's own collectives, ``verify_sync``'s checksums, checkpoints —
stays on the communicator over all ranks and counts as traffic between replicas.

**Sharded replicas** (``sharded=True`` with ``replica_size``): a replica's ranks hold one model sharded with FSDP2
over them (the LightningModule's ``configure_model`` applies ``fully_shard`` over ``device_mesh["shard"]``), which
averages the gradients inside the replica itself (its reduce-scatter): no in-replica communicator of the pack, no
leaders. :meth:`ReplicaGroups.setup` builds the ``("replicate", "shard")`` device mesh
(:func:`~lightning_sync.comm.fsdp.replica_mesh`) and, for every shard index, a communicator over the ranks holding
that shard in each replica (:attr:`ReplicaGroups.across`, the strategy's ``link``): the method's averages run there,
every rank on its own shard (:class:`~lightning_sync.strategies.sharded_topology.ShardedTopology`). A second
communicator per replica, over its ranks (:attr:`ReplicaGroups.shards`, the ranks of ``mesh["shard"]``, level
``intra``), carries the small sums of a whole-model statistic over the replica's shards (SelSync's gradient norm,
ADPSGD's spread): FSDP2's own collectives keep their process groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Literal, Protocol, TypeVar, overload

from torch import Tensor

from lightning_sync.comm import Communicator, FlatState, LinkModel
from lightning_sync.comm.accounting import INTRA
from lightning_sync.comm.buckets import GradBuckets
from lightning_sync.comm.fsdp import replica_mesh

ReplicaSize = int | Literal["node"] | None
T = TypeVar("T")
#: what a step's gradient buckets all-reduce during backward: ``(communicator, tag)``
OverlapPlan = tuple[Communicator, str]


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


def check_refusal(strategy: Any, **arguments: Any) -> None:
    """At construction: a method that cannot run with replica groups (its ``replica_groups_refusal``, the reason)
    refuses ``replica_size`` and ``intra_link``."""
    refusal = strategy.replica_groups_refusal
    if refusal is None:
        return
    for name, value in arguments.items():
        if value is not None:
            raise ValueError(
                f"{name} must be None for {type(strategy).__name__}: {refusal} Use {name}=None (every rank a "
                "replica), or a method that runs with replica groups (bsp, localsgd, fedavg, adpsgd, diloco, selsync)."
            )


class FromLayout(Generic[T]):
    """A read-only attribute of the strategy that is its replica layout's (``strategy.replicas``), by the same name
    or ``name``: what methods, callbacks and data code read on the strategy (``num_replicas``...)."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name
        source = getattr(ReplicaGroups, self.name, None)
        self.__doc__ = source.__doc__ if isinstance(source, property) else None  # the layout's own

    @overload
    def __get__(self, strategy: None, owner: type | None = None) -> FromLayout[T]: ...
    @overload
    def __get__(self, strategy: object, owner: type | None = None) -> T: ...
    def __get__(self, strategy: object, owner: type | None = None) -> Any:
        return self if strategy is None else getattr(strategy.replicas, self.name)  # type: ignore[attr-defined,arg-type]

    def __set__(self, strategy: object, value: Any) -> None:
        raise AttributeError(f"{self.name} is the replica layout's (strategy.replicas), read-only on the strategy")


class LayoutHost(Protocol):
    """What :class:`ReplicaGroups` uses of the strategy that owns it: its arguments (``replica_size``,
    ``intra_link``, ``intra_bucket_cap_mb``), Lightning's process layout, its communicator over all ranks, its flat
    state and ``verify_sync``."""

    replica_size: int | str | None
    sharded: bool
    intra_link: LinkModel | None
    intra_bucket_cap_mb: float | None
    root_device: Any
    world_size: int
    global_rank: int
    num_processes: int
    num_nodes: int
    comm: Communicator
    flat: FlatState
    verify_sync: bool
    _verify_after_update: Communicator | None

    def _verify(self, tensors: list[Tensor], what: str, comm: Communicator | None = None) -> None: ...


class ReplicaGroups:
    """The replica layout of the strategy that owns it (see the module docstring). The strategy's
    ``setup_environment`` calls :meth:`resolve` (before any collective), then :meth:`setup`; ``teardown``
    :meth:`teardown`; every step, after backward, :meth:`average_in_replica`. The averages between replicas are
    :class:`~lightning_sync.strategies.topology.GroupedTopology`'s, which shares each leader's result with
    :meth:`share`."""

    def __init__(self, strategy: LayoutHost) -> None:
        self.strategy = strategy
        self._ranks = 1  # ranks per replica, resolved at setup
        self.intra: Communicator | None = None  # over this rank's replica (replica groups only)
        self.inter: Communicator | None = None  # over the replicas' leaders, on the leaders only (replica groups only)
        #: sharded replicas: over the ranks that hold this rank's shard index in every replica
        self.across: Communicator | None = None
        #: sharded replicas: the ``("replicate", "shard")`` device mesh the LightningModule shards over
        self.mesh: Any = None
        #: sharded replicas: over this rank's replica (its shards; level ``intra``), for sums over the whole model
        self.shards: Communicator | None = None

    # ------------------------------------------------------------------ the layout
    @property
    def ranks_per_replica(self) -> int:
        """Ranks per replica, resolved at setup (1: every rank a replica, the flat behaviour)."""
        return self._ranks

    @property
    def grouped(self) -> bool:
        """Whether replicas span several ranks that each hold the whole model (the intra-replica level exists)."""
        return self.ranks_per_replica > 1 and not self.sharded

    @property
    def sharded(self) -> bool:
        """Whether each replica's model is sharded with FSDP2 over its ranks (``sharded=True``)."""
        return bool(self.strategy.sharded)

    @property
    def num_replicas(self) -> int:
        """How many replicas train (the world size when every rank is one)."""
        return self.strategy.world_size // self.ranks_per_replica

    @property
    def replica_index(self) -> int:
        """This rank's replica (its global rank when every rank is one)."""
        return self.strategy.global_rank // self.ranks_per_replica

    @property
    def is_replica_leader(self) -> bool:
        """Whether this rank is its replica's first, the one that communicates between replicas."""
        return self.strategy.global_rank % self.ranks_per_replica == 0

    def replica_ranks(self, replica: int) -> list[int]:
        """The global ranks of replica ``replica``."""
        return list(range(replica * self.ranks_per_replica, (replica + 1) * self.ranks_per_replica))

    def leader_ranks(self) -> list[int]:
        """The global ranks of the replicas' leaders."""
        return [r * self.ranks_per_replica for r in range(self.num_replicas)]

    # ------------------------------------------------------------------ setup
    def resolve(self) -> None:
        """At setup, before any collective: ranks per replica from ``replica_size`` and the Trainer's topology."""
        s = self.strategy
        name = type(s).__name__
        world = s.world_size
        if s.replica_size is None:
            size = 1
        elif s.replica_size == "node":
            size = s.num_processes  # Lightning's devices per node: the ranks of one node, consecutive
        else:
            size = int(s.replica_size)
            if world % size:
                raise ValueError(
                    f"{name}(replica_size={size}): replica_size must divide the world size {world} "
                    f"(num_nodes={s.num_nodes} x devices={s.num_processes}); use a divisor of {world}, 'node' "
                    "(the ranks of one node), or None (every rank a replica)"
                )
        if s.intra_link is not None and size == 1:
            why = "replica_size=None" if s.replica_size is None else f"replica_size={s.replica_size!r} is 1 rank"
            raise ValueError(
                f"{name}(intra_link={s.intra_link}): intra_link emulates the link inside a replica group, and "
                f"this run has none ({why}, every rank a replica). Set replica_size to 'node' or a group size > 1, "
                "or leave intra_link=None (the link argument emulates the link between replicas)."
            )
        self._ranks = size

    def setup(self) -> None:
        """At ``setup_environment`` (every rank, same order): the intra-replica communicator of every replica and
        the leaders' communicator (group creation is collective over the world)."""
        self.teardown()
        if self.sharded:
            self._setup_sharded()
            return
        if not self.grouped:
            return
        self.intra = None
        for replica in range(self.num_replicas):
            comm = self.strategy.comm.subgroup(self.replica_ranks(replica), level=INTRA, link=self.strategy.intra_link)
            if comm is not None:
                self.intra = comm
        self.inter = self.new_inter_comm()

    def _setup_sharded(self) -> None:
        """The device mesh, per shard index the communicator across the replicas, and per replica the one over its
        shards (collective, same order)."""
        s = self.strategy
        self.mesh = replica_mesh(s.root_device.type, self.num_replicas, self.ranks_per_replica)
        self.across = self.new_across_comm()
        for replica in range(self.num_replicas):
            comm = s.comm.subgroup(self.replica_ranks(replica), level=INTRA, link=s.intra_link)
            if comm is not None:
                self.shards = comm

    def new_across_comm(self) -> Communicator:
        """Sharded replicas: a communicator over the ranks that hold this rank's shard index in every replica, on the
        strategy's link and this rank's clock. Every rank calls it at the same point (a second one: an independent
        group, e.g. for asynchronous averages beside blocking ones)."""
        s, mine = self.strategy, None
        for shard in range(self.ranks_per_replica):
            ranks = [replica * self.ranks_per_replica + shard for replica in range(self.num_replicas)]
            comm = s.comm.subgroup(ranks)
            if comm is not None:
                mine = comm
        assert mine is not None
        return mine

    def new_inter_comm(self) -> Communicator | None:
        """A communicator over the replicas' leaders (``None`` on the other ranks), on the strategy's link and this
        rank's clock. Every rank calls it at the same point (a second one: an independent group, e.g. for
        asynchronous syncs beside blocking ones)."""
        return self.strategy.comm.subgroup(self.leader_ranks())

    def teardown(self) -> None:
        for comm in (self.intra, self.inter, self.across, self.shards):
            if comm is not None:
                comm.destroy()
        self.intra = self.inter = self.across = self.shards = None

    # ------------------------------------------------------------------ the gradient buckets' plan
    def bucket_cap(self, method_cap: float | None) -> float | None:
        """The bucket size of the gradient all-reduce overlapped with backward: with replica groups the exact
        in-replica average's (``intra_bucket_cap_mb``); sharded replicas none (FSDP2 reduce-scatters the gradients
        inside backward, a gradient average between replicas is one all-reduce of the local shards after it); else
        the method's ``bucket_cap_mb``."""
        if self.sharded:
            return None
        return self.strategy.intra_bucket_cap_mb if self.grouped else method_cap

    def overlap_plan(self, method: Callable[[], OverlapPlan | None]) -> OverlapPlan | None:
        """What this step's buckets all-reduce during backward: with replica groups the exact in-replica average of
        every step (over :attr:`intra`, never compressed), else what the method announces (``method()``)."""
        return (self.intra, "grads") if self.intra is not None else method()

    # ------------------------------------------------------------------ the two levels
    def average_in_replica(self, buckets: GradBuckets | None) -> None:
        """Every step after backward, with replica groups: the replica's ranks average their gradients and floating
        buffers (the ``buckets`` launched during backward, the rest now; or one all-reduce after backward), exactly."""
        intra = self.intra
        if intra is None:
            return
        s = self.strategy
        flat = s.flat
        if buckets is not None and buckets.armed:
            tensors = buckets.finish(s.comm)  # find_unused_parameters: which parameters no rank used, over all
        else:
            flat.stage_buffers()
            tensors = flat.grad_tensors()
            intra.all_reduce_many(tensors, op="avg", tag="grads")
            flat.unstage_buffers()
        if s.verify_sync:
            s._verify(tensors, "gradients and buffers inside the replica", intra)
            s._verify_after_update = intra  # and the parameters after the update (a sync may widen it to all)

    def share(self, tensors: list[Tensor], tag: str) -> None:
        """The leader's values to every rank of its replica (one broadcast per tensor, ``"intra/<tag>"``)."""
        if self.intra is not None:
            for t in tensors:
                if t.numel():
                    self.intra.broadcast(t, src=0, tag=tag)
