"""Replica topologies: who averages with whom, chosen once at setup; the one object the averages call.

A strategy states its method and asks its topology (:attr:`~lightning_sync.strategies.SyncStrategy.topology`) to
average; it never branches on which topology it is. Three exist:

* :class:`FlatTopology` — every rank a replica (the default): one all-reduce over all ranks;
* :class:`GroupedTopology` — replica groups of several ranks (``replica_size``,
  :mod:`~lightning_sync.strategies.replicas`): the replicas' leaders average over a group of their own, then each
  leader's result is broadcast inside its replica;
* :class:`FaultTolerantTopology` — this process's replica group is one member of a torchft quorum
  (``fault_tolerance``, :mod:`~lightning_sync.strategies.fault_tolerance`): averages run over the current quorum and
  commit, or leave this group's values as they were.

The interface, as PyTorch's model averagers are one idea a class:

* :meth:`Topology.average` — the method's parameter average (``participants``: FedAvg's draw; ``before_commit``:
  what runs while the tensors hold the mean, e.g. ADPSGD's statistic); returns whether it committed (always, but
  under fault tolerance). Its values travel as the strategy's codec
  (:mod:`~lightning_sync.strategies.codec`) sends them: exact or compressed.
* :meth:`Topology.launch` / :class:`InFlight` — the same average in flight while training goes on (streaming DiLoCo).
* :meth:`Topology.average_grads` — the gradient average of BSP and SelSync's gradient aggregation.
* :meth:`Topology.mean` (an exact mean that is an observation, not a sync: validation) and :meth:`Topology.all_reduce`
  (one value per replica: a method's statistic).
* :meth:`Topology.members` (how many replicas take part in this step's sync), :meth:`Topology.verify`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import Tensor

from lightning_sync.comm import CommHandle, Communicator, FlatState
from lightning_sync.strategies.codec import ExactCodec


class ReplicaHost(Protocol):
    """What a topology uses of the strategy that owns it (:class:`~lightning_sync.strategies.SyncStrategy`): its
    communicators and replica layout, its flat state and codec, and — fault-tolerant — its torchft glue."""

    comm: Communicator
    flat: FlatState
    codec: ExactCodec
    compressor: Any
    fault_tolerance: Any
    world_size: int
    global_rank: int
    num_replicas: int
    replica_index: int
    grouped: bool
    _inter: Communicator | None
    _ft: Any

    def _share_in_replica(self, tensors: list[Tensor], tag: str) -> None: ...
    def _new_inter_comm(self) -> Communicator | None: ...
    def _finish_grad_buckets(self, comm: Communicator, tag: str) -> list[Tensor] | None: ...
    def _verify(self, tensors: list[Tensor], what: str, comm: Communicator | None = None) -> None: ...
    def _ft_all_reduce(
        self, tensors: list[Tensor], tag: str, participants: Any = None, before_commit: Any = None
    ) -> bool: ...
    def _ft_launch(self, tensors: list[Tensor], tag: str) -> Any: ...
    def _ft_finish(self, pending: Any) -> bool: ...
    def _ft_verify(self, tensors: list[Tensor], what: str, committed: bool) -> None: ...
    def _ft_current_quorum(self) -> Any: ...

#: the exact codec (a flat run of one rank averages exactly whatever its compression)
EXACT = ExactCodec()

__all__ = ["FaultTolerantTopology", "FlatTopology", "GroupedTopology", "InFlight", "Topology", "topology_for"]


class InFlight:
    """An average in flight (:meth:`Topology.launch`); :meth:`finish` waits for it and says whether it committed
    (the tensors then hold the mean; otherwise they are not to be applied)."""

    def __init__(self, handles: Sequence[Any], finish: Callable[[], bool]) -> None:
        self.handles = list(handles)
        self._finish = finish

    def finish(self) -> bool:
        return self._finish()


class Topology(ABC):
    """How the replicas of ``strategy`` average (see the module docstring)."""

    def __init__(self, strategy: ReplicaHost) -> None:
        self.strategy = strategy
        self._side: Communicator | None = None  # a second group for averages in flight (open_side_channel)

    # ------------------------------------------------------------------ the averages
    @abstractmethod
    def average(
        self,
        tensors: list[Tensor],
        tag: str,
        participants: list[int] | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> bool:
        """Every replica takes the mean of the participants' ``tensors`` (in place); returns whether it committed."""

    @abstractmethod
    def launch(self, tensors: list[Tensor], tag: str) -> InFlight:
        """Start the average of ``tensors`` (exact) and return while it is in flight (needs :meth:`open_side_channel`
        at setup)."""

    def completed(self, tensors: list[Tensor], tag: str) -> InFlight:
        """An average launched before a checkpoint, complete when it was saved, restored on resume: what its finish
        still does (with replica groups: the leader's result to its replica's ranks)."""
        return InFlight([], lambda: True)

    @abstractmethod
    def average_grads(self, tag: str, comm: Communicator | None = None) -> list[Tensor]:
        """Average the flat gradients (and floating buffers) over the replicas; returns what it made identical."""

    @abstractmethod
    def mean(self, tensors: list[Tensor], tag: str) -> None:
        """The exact mean of ``tensors`` over the replicas, in place: an observation (validation), not a sync."""

    @abstractmethod
    def all_reduce(self, tensor: Tensor, op: str, tag: str) -> None:
        """All-reduce ``tensor``, one value per replica, over the replicas (every rank takes the result)."""

    @abstractmethod
    def members(self) -> int:
        """How many replicas take part in this step's sync."""

    @property
    @abstractmethod
    def has_peers(self) -> bool:
        """Whether other replicas exist to average with (a run of one replica has nothing to sync)."""

    def verify(self, tensors: list[Tensor], what: str, committed: bool = True) -> None:
        """``verify_sync``: raise if the replicas that took part in the sync differ."""
        self.strategy._verify(tensors, what)

    # ------------------------------------------------------------------ set-up
    @abstractmethod
    def open_side_channel(self) -> None:
        """At ``setup_environment`` (every rank, same point): a second group for :meth:`launch`."""

    def close(self) -> None:
        if self._side is not None:
            self._side.destroy()
            self._side = None


class FlatTopology(Topology):
    """Every rank a replica."""

    def average(self, tensors, tag, participants=None, before_commit=None):  # type: ignore[no-untyped-def]
        s = self.strategy
        codec = s.codec if s.world_size > 1 else EXACT  # one rank: nothing to compress (no reference was taken)
        codec.average_state(s.comm, tensors, tag, participants, s.global_rank, "rank")
        if before_commit is not None:
            before_commit()
        return True

    def launch(self, tensors, tag):  # type: ignore[no-untyped-def]
        handles: list[CommHandle] = []
        if self._side is not None:
            handles = [self._side.all_reduce(t, op="avg", tag=tag, async_op=True) for t in tensors]
        return InFlight(handles, lambda: _wait(handles))

    def average_grads(self, tag, comm=None):  # type: ignore[no-untyped-def]
        s = self.strategy
        comm = comm if comm is not None else s.comm
        flat = s.flat
        # launched bucket by bucket during backward if _overlap_grads announced this call: launch the rest, wait
        tensors = s._finish_grad_buckets(comm, tag)
        return tensors if tensors is not None else s.codec.average_grads(comm, flat, tag)

    def mean(self, tensors, tag):  # type: ignore[no-untyped-def]
        self.strategy.comm.all_reduce_many(tensors, op="avg", tag=tag)

    def all_reduce(self, tensor, op, tag):  # type: ignore[no-untyped-def]
        self.strategy.comm.all_reduce(tensor, op=op, tag=tag)

    def members(self) -> int:
        return self.strategy.world_size

    @property
    def has_peers(self) -> bool:
        return self.strategy.world_size > 1

    def open_side_channel(self) -> None:
        self._side = self.strategy.comm.split()


class GroupedTopology(Topology):
    """Replica groups of several ranks: the leaders average, then broadcast inside their replica."""

    def average(self, tensors, tag, participants=None, before_commit=None):  # type: ignore[no-untyped-def]
        s = self.strategy
        if participants is not None and not participants:
            raise ValueError("participants must name at least one replica")
        if s.num_replicas > 1:
            inter = s._inter
            if inter is not None:
                s.codec.average_state(inter, tensors, tag, participants, s.replica_index, "replica")
            s._share_in_replica(tensors, tag)
            s.codec.take_reference(tensors)  # compressed: the next changes are taken from what every rank now holds
        if before_commit is not None:
            before_commit()
        return True

    def launch(self, tensors, tag):  # type: ignore[no-untyped-def]
        handles: list[CommHandle] = []
        if self._side is not None:  # on the leaders; the other ranks take their leader's result when it finishes
            handles = [self._side.all_reduce(t, op="avg", tag=tag, async_op=True) for t in tensors]

        def finish() -> bool:
            _wait(handles)
            self.strategy._share_in_replica(tensors, tag)
            return True

        return InFlight(handles, finish)

    def completed(self, tensors: list[Tensor], tag: str) -> InFlight:
        def finish() -> bool:
            self.strategy._share_in_replica(tensors, tag)
            return True

        return InFlight([], finish)

    def average_grads(self, tag, comm=None):  # type: ignore[no-untyped-def]
        s = self.strategy
        if comm is not None and comm is not s.comm:
            raise RuntimeError(f"{type(s).__name__}: average_grads over a subgroup has no replica-group form")
        flat = s.flat
        if s.num_replicas == 1:
            return flat.grad_tensors()
        if s.compressor is not None:
            if s._inter is not None:
                tensors = s.codec.average_grads(s._inter, flat, tag)  # buffers exact, beside the gradients
            else:
                tensors = flat.grad_tensors(with_buffers=False) + [g.buffers for g in flat.groups if g.buffer_numel]
            s._share_in_replica(tensors, tag)
            return tensors
        flat.stage_buffers()
        tensors = flat.grad_tensors()
        if s._inter is not None:
            s._inter.all_reduce_many(tensors, op="avg", tag=tag)
        s._share_in_replica(tensors, tag)
        flat.unstage_buffers()
        return tensors

    def mean(self, tensors, tag):  # type: ignore[no-untyped-def]
        s = self.strategy
        if s.num_replicas == 1:
            return
        if s._inter is not None:
            s._inter.all_reduce_many(tensors, op="avg", tag=tag)
        s._share_in_replica(tensors, tag)

    def all_reduce(self, tensor, op, tag):  # type: ignore[no-untyped-def]
        s = self.strategy
        if s.num_replicas == 1:
            return
        if s._inter is not None:
            s._inter.all_reduce(tensor, op=op, tag=tag)
        s._share_in_replica([tensor], tag)

    def members(self) -> int:
        return self.strategy.num_replicas

    @property
    def has_peers(self) -> bool:
        return self.strategy.num_replicas > 1

    def open_side_channel(self) -> None:
        self._side = self.strategy._new_inter_comm()  # None on the ranks that are not leaders


class FaultTolerantTopology(Topology):
    """This replica group is one member of a torchft quorum; ``within`` is how the group's own ranks average
    (validation's mean over the group's world)."""

    def __init__(self, strategy: ReplicaHost, within: Topology) -> None:
        super().__init__(strategy)
        self.within = within

    def average(self, tensors, tag, participants=None, before_commit=None):  # type: ignore[no-untyped-def]
        return self.strategy._ft_all_reduce(tensors, tag, participants, before_commit=before_commit)

    def launch(self, tensors, tag):  # type: ignore[no-untyped-def]
        s = self.strategy
        pending = s._ft_launch(tensors, tag)
        return InFlight([pending], lambda: s._ft_finish(pending))

    def completed(self, tensors: list[Tensor], tag: str) -> InFlight:
        return self.within.completed(tensors, tag)  # committed before the checkpoint: this group applies it

    def average_grads(self, tag, comm=None):  # type: ignore[no-untyped-def]
        raise RuntimeError(
            f"{type(self.strategy).__name__}: no gradient average between fault-tolerant replica groups (a method "
            "that averages gradients refuses fault_tolerance at construction)"
        )

    def mean(self, tensors, tag):  # type: ignore[no-untyped-def]
        self.within.mean(tensors, tag)

    def all_reduce(self, tensor, op, tag):  # type: ignore[no-untyped-def]
        assert self.strategy._ft is not None
        self.strategy._ft.all_reduce([tensor], op=op, tag=tag)  # over the quorum, committed with the sync

    def members(self) -> int:
        return self.strategy._ft_current_quorum().replica_world_size

    @property
    def has_peers(self) -> bool:
        return True  # the other replica groups are in other processes

    def verify(self, tensors: list[Tensor], what: str, committed: bool = True) -> None:
        self.strategy._ft_verify(tensors, what, committed)

    def open_side_channel(self) -> None:
        """Nothing to open: an average in flight runs on torchft's own group over the quorum."""


def topology_for(strategy: ReplicaHost) -> Topology:
    """The topology ``strategy`` runs: fault-tolerant, grouped or flat (at ``setup_environment``, after its groups)."""
    within: Topology = GroupedTopology(strategy) if strategy.grouped else FlatTopology(strategy)
    if strategy.fault_tolerance is not None:
        return FaultTolerantTopology(strategy, within)
    return within


def _wait(handles: Sequence[CommHandle]) -> bool:
    for handle in handles:
        handle.wait()
    return True
