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
  (one value per replica: a method's statistic); :meth:`Topology.sum_over_model` (a rank's share of a sum over the
  model's elements made the replica's whole: sharded replicas sum it over their shards) and
  :meth:`Topology.grad_sq_norm` (the replica's gradient's squared norm: SelSync's vote).
* :meth:`Topology.members` (how many replicas take part in this step's sync), :meth:`Topology.verify`,
  :meth:`Topology.start_identical` (the replicas made identical at setup).

A fourth, :class:`~lightning_sync.strategies.sharded_topology.ShardedTopology` (``sharded=True``), averages each
rank's FSDP2 shard over the ranks of its shard index; :func:`~lightning_sync.strategies.ft_topology.topology_for`
chooses among all of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import Tensor

from lightning_sync.comm import CommHandle, Communicator, FlatState
from lightning_sync.strategies.codec import ExactCodec
from lightning_sync.strategies.overlap import OverlappedGrads
from lightning_sync.strategies.replicas import ReplicaGroups


class ReplicaHost(Protocol):
    """What a topology uses of the strategy that owns it (:class:`~lightning_sync.strategies.SyncStrategy`): its
    communicator, replica layout and gradient buckets, its flat state and codec, and the hooks a fault-tolerant run
    asks of it."""

    comm: Communicator
    flat: FlatState
    codec: ExactCodec
    compressor: Any
    fault_tolerance: Any
    world_size: int
    global_rank: int
    replicas: ReplicaGroups
    overlap: OverlappedGrads
    verify_sync: bool

    def _verify(self, tensors: list[Tensor], what: str, comm: Communicator | None = None) -> None: ...

    # what the fault-tolerant topology (:mod:`~lightning_sync.strategies.ft_topology`) uses besides
    lightning_module: Any
    comm_stats: Any
    step_counter: Any
    ranks_per_replica: int
    replica_size: Any
    _restored_comm: dict[str, Any] | None

    def strategy_state(self) -> dict[str, Any]: ...
    def load_strategy_state(self, state: dict[str, Any]) -> None: ...
    def _ft_next_step_syncs(self) -> bool: ...
    def _ft_method_config(self) -> dict[str, Any]: ...


#: the exact codec (a flat run of one rank averages exactly whatever its compression)
EXACT = ExactCodec()

__all__ = ["FlatTopology", "GroupedTopology", "InFlight", "Topology", "layout_topology"]


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

    def start_identical(self, tensors: list[Tensor]) -> None:
        """At setup (fitting, not resuming per-rank replicas): rank 0's values to every rank (tag ``"setup"``), so
        every replica starts identical."""
        for tensor in tensors:
            self.strategy.comm.broadcast(tensor, src=0, tag="setup")

    @abstractmethod
    def average_grads(self, tag: str, comm: Communicator | None = None) -> list[Tensor]:
        """Average the flat gradients (and floating buffers) over the replicas; returns what it made identical."""

    def average_grads_within(self, tag: str, comm: Communicator | None = None) -> list[Tensor]:
        """The gradient average of this layout when a further average follows it (between fault-tolerant replica
        groups: ``FaultTolerantTopology``), left in the flat gradient buffer, which that caller writes back into
        what the optimizer applies. Here the gradients are views of the buffer: :meth:`average_grads`."""
        return self.average_grads(tag, comm)

    def identical_over(self) -> Communicator:
        """The ranks a gradient sync makes hold the same values as this rank (``verify_sync`` checks over them): every
        rank (sharded replicas: the ranks of this rank's shard index)."""
        return self.strategy.comm

    def sum_over_model(self, tensor: Tensor, tag: str) -> None:  # noqa: B027 (optional hook)
        """``tensor`` holds this rank's share of a sum over the model's elements (a squared norm or distance): make it
        the sum over the replica's whole model, in place, the same on the replica's ranks. Every rank holds the whole
        model here: nothing to do (sharded replicas sum it over their shards)."""

    def grad_sq_norm(self) -> Tensor:
        """The squared L2 norm of this replica's gradient (after backward; with replica groups the replica's averaged
        gradient, the same on its ranks): a float64 scalar on the gradients' device."""
        return self.strategy.flat.grad_sq_norm()

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

    @abstractmethod
    def alone(self) -> str | None:
        """Why a fit of this topology has no other replica to synchronise with (a warning's text after the strategy's
        name), or ``None`` when it has peers."""

    @property
    def replicas_in_run(self) -> int:
        r"""How many replicas train in the whole run (those of this Lightning world, and of every other replica group
        when fault-tolerant): the N of local clipping's :math:`\sqrt N`."""
        return self.strategy.replicas.num_replicas

    def verify(self, tensors: list[Tensor], what: str, committed: bool = True) -> None:
        """``verify_sync``: raise if the replicas that took part in the sync differ."""
        self.strategy._verify(tensors, what)

    # ------------------------------------------------------------------ lifecycle (the strategy calls every one)
    def setup_environment(self) -> None:  # noqa: B027 (optional hook)
        """End of the strategy's ``setup_environment`` (its communicators exist): join what this topology needs."""

    def check_trainer(self, trainer: Any) -> None:  # noqa: B027 (optional hook)
        """At ``setup``: raise if this topology cannot run the Trainer's settings, saying why."""

    def start(self, trainer: Any) -> None:  # noqa: B027 (optional hook)
        """End of ``setup`` (the flat state exists), before the first step."""

    def sampler_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The ``DistributedSampler`` arguments (``num_replicas``, ``rank``) of the Trainer's data: Lightning's."""
        return kwargs

    def metrics(self) -> dict[str, float]:
        """What :meth:`~lightning_sync.strategies.SyncStrategy.sync_metrics` adds (still after ``close``)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Entries of the strategy's per-rank state this topology keeps (merged into ``strategy_state``)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Take back what :meth:`state_dict` put in ``state`` (the whole strategy state)."""

    # ------------------------------------------------------------------ checkpoints (the model's form in the files)
    def parts_hold_model(self, replicas_diverge: bool) -> bool:
        """Whether every rank's checkpoint part holds its model and optimizer state: when the method's replicas
        diverge (otherwise the main file's, rank 0's, is every rank's)."""
        return replicas_diverge

    def checkpoint_part(self, tree: Any) -> Any:
        """A rank's part of a checkpoint: the model or optimizer state ``tree`` as this rank holds it."""
        return tree

    def checkpoint_main(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The main checkpoint file rank 0 writes (every rank calls it, at the same point)."""
        return checkpoint

    def restore_model(self, state_dict: Any, module: Any) -> Any:
        """A model state dict read back from a part (as :meth:`checkpoint_part` wrote it), as ``module`` loads it."""
        return state_dict

    def restore_optimizer(self, state: Any, optimizer: Any) -> Any:
        """An optimizer state dict read back from a part, as ``optimizer`` loads it."""
        return state

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
        tensors = s.overlap.finish(comm, tag)
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

    def alone(self) -> str | None:
        if self.has_peers:
            return None
        return (
            " runs with world size 1: there is no other replica to synchronise with, so it trains locally. Use "
            "devices>1 or num_nodes>1 to train data-parallel."
        )

    def open_side_channel(self) -> None:
        self._side = self.strategy.comm.split()


class GroupedTopology(Topology):
    """Replica groups of several ranks: the leaders average, then broadcast inside their replica."""

    def average(self, tensors, tag, participants=None, before_commit=None):  # type: ignore[no-untyped-def]
        s, r = self.strategy, self.strategy.replicas
        if participants is not None and not participants:
            raise ValueError("participants must name at least one replica")
        if r.num_replicas > 1:
            inter = r.inter
            if inter is not None:
                s.codec.average_state(inter, tensors, tag, participants, r.replica_index, "replica")
            r.share(tensors, tag)
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
            self.strategy.replicas.share(tensors, tag)
            return True

        return InFlight(handles, finish)

    def completed(self, tensors: list[Tensor], tag: str) -> InFlight:
        def finish() -> bool:
            self.strategy.replicas.share(tensors, tag)
            return True

        return InFlight([], finish)

    def average_grads(self, tag, comm=None):  # type: ignore[no-untyped-def]
        s, r = self.strategy, self.strategy.replicas
        if comm is not None and comm is not s.comm:
            raise RuntimeError(f"{type(s).__name__}: average_grads over a subgroup has no replica-group form")
        flat = s.flat
        if r.num_replicas == 1:
            return flat.grad_tensors()
        if s.compressor is not None:
            if r.inter is not None:
                tensors = s.codec.average_grads(r.inter, flat, tag)  # buffers exact, beside the gradients
            else:
                tensors = flat.grad_tensors(with_buffers=False) + [g.buffers for g in flat.groups if g.buffer_numel]
            r.share(tensors, tag)
            return tensors
        flat.stage_buffers()
        tensors = flat.grad_tensors()
        if r.inter is not None:
            r.inter.all_reduce_many(tensors, op="avg", tag=tag)
        r.share(tensors, tag)
        flat.unstage_buffers()
        return tensors

    def mean(self, tensors, tag):  # type: ignore[no-untyped-def]
        r = self.strategy.replicas
        if r.num_replicas == 1:
            return
        if r.inter is not None:
            r.inter.all_reduce_many(tensors, op="avg", tag=tag)
        r.share(tensors, tag)

    def all_reduce(self, tensor, op, tag):  # type: ignore[no-untyped-def]
        r = self.strategy.replicas
        if r.num_replicas == 1:
            return
        if r.inter is not None:
            r.inter.all_reduce(tensor, op=op, tag=tag)
        r.share([tensor], tag)

    def members(self) -> int:
        return self.strategy.replicas.num_replicas

    @property
    def has_peers(self) -> bool:
        return self.strategy.replicas.num_replicas > 1

    def alone(self) -> str | None:
        if self.has_peers:
            return None
        s = self.strategy
        return (
            f"(replica_size={s.replica_size!r}): all {s.world_size} ranks form one replica, so there is no other "
            "replica to synchronise with: this trains as exact data parallelism (BSP) over every rank. Use num_nodes "
            "> 1 (replica_size='node'), or a smaller replica_size."
        )

    def open_side_channel(self) -> None:
        self._side = self.strategy.replicas.new_inter_comm()  # None on the ranks that are not leaders


def layout_topology(strategy: ReplicaHost) -> Topology:
    """How the ranks of this Lightning world average: grouped (replicas of several ranks) or flat."""
    return GroupedTopology(strategy) if strategy.replicas.grouped else FlatTopology(strategy)


def _wait(handles: Sequence[CommHandle]) -> bool:
    for handle in handles:
        handle.wait()
    return True
