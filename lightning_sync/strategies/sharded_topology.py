"""Sharded replicas: each replica's model sharded with FSDP2 over its ranks, the method between replicas per shard.

``sharded=True`` with ``replica_size`` (``"node"`` or a number of ranks) makes each replica a group of ranks whose
model is sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``) over that group. Inside a replica FSDP2 does
what DDP does inside a grouped replica: the gradients are reduce-scattered (averaged) every step, each rank updates
its own shard with the user's optimizer (whose state is then sharded too). Between replicas the method runs on each
rank's own shard: the rank holding shard *i* averages with shard *i* of every other replica — one all-reduce over
the ranks of that shard index (:attr:`~lightning_sync.strategies.replicas.ReplicaGroups.across`) — so the bytes a
rank sends between replicas are its shard's, and DiLoCo's outer optimizer state (:math:`\\theta_{global}` and its
momentum) lives on the local shard as well. The flat state packs the local shards
(:class:`~lightning_sync.comm.FlatState`), so the averaging, compression and accounting paths are the flat ones.

**The methods** call the topology's interface, as for the other topologies; what each is on sharded replicas:

* parameter averages (local SGD, FedAvg's participant replicas, ADPSGD, DiLoCo, SelSync's parameter syncs):
  :meth:`ShardedTopology.average`, each rank's shard over its shard index's ranks;
* gradient averages (BSP, SelSync's gradient syncs): :meth:`ShardedTopology.average_grads` — FSDP2 averaged the
  gradients inside the replica, then every rank's local gradient shard (copied into the flat gradient buffer) is
  averaged over its shard index's ranks and written back: FSDP over all ranks (HSDP); the floating buffers are
  averaged over the replica's shards too;
* a whole-model statistic (ADPSGD's spread, SelSync's gradient norm): :meth:`ShardedTopology.sum_over_model` sums
  each rank's share over the replica's shards (8 bytes inside the replica,
  :attr:`~lightning_sync.strategies.replicas.ReplicaGroups.shards`, counted as ``"intra/<tag>"``), then the method's
  own collective runs between replicas as for the others (:meth:`ShardedTopology.grad_sq_norm` is the replica's
  gradient's squared norm);
* averages in flight (streaming DiLoCo): :meth:`ShardedTopology.launch`, on a second group over each shard index's
  ranks (:meth:`ShardedTopology.open_side_channel`); a fragment is a range of each rank's local shard.

The parameter-server family (ASP, SSP, ALADDIN), OSP and Sync-Switch refuse ``sharded=True`` at construction, each
saying why (``sharded_refusal``) and naming the methods that run sharded. **Fault-tolerant** sharded groups
(``fault_tolerance=...``): BSP, local SGD and DiLoCo, this topology as the group's own layout inside
:class:`~lightning_sync.strategies.ft_topology.FaultTolerantTopology` (every rank a member of its shard index's
torchft quorum); the other methods refuse it (``sharded_fault_tolerance_refusal``).

**What the LightningModule writes**, as for Lightning's ``ModelParallelStrategy``: its ``configure_model`` shards over
``self.device_mesh["shard"]`` (the strategy sets ``device_mesh``, a ``("replicate", "shard")`` mesh of replicas x
shards, PyTorch's HSDP names for the layout), e.g.::

    def configure_model(self):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.net, FSDPModule):  # sharded at an earlier setup (an evaluation after fit)
            return
        mesh = self.device_mesh["shard"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

Every parameter must be sharded over ``"shard"`` (checked at setup, saying what to write); ``fully_shard`` over the
2-D mesh (HSDP) would average the gradients over the replicas every step and is refused. The model is never wrapped
in DDP. Every rank reads its own data (the sampler is data parallel over all ranks, as Lightning's DDP and
``ModelParallelStrategy``).

**Checkpoints**: each rank's part (``<file>.rank<r>``) holds its local shards — model, optimizer state (momentum
buffers), and as always the strategy's state (DiLoCo's outer state is the shard's) — as plain tensors; a resume with
the same world size and ``replica_size`` wraps them back into ``DTensor`` objects and continues bit-identically. The
main file holds the whole model, all-gathered inside each replica from the replicas' average (a consolidated state
dict: ``torch.load(path)["state_dict"]`` loads into the unsharded module, for inference), and rank 0's local
optimizer shards.

**Evaluation**: validation during fit sees the replicas' average, as always; ``trainer.validate``/``test``/``predict``
evaluate replica 0's model on every replica (as DDP evaluates rank 0's: after a fit with ``average_at_end`` the
replicas are identical), and from a checkpoint the main file's whole model, each rank taking its shard.
``configure_model`` runs again for each of them (Lightning calls it at every setup), so it must leave a module it
sharded already as it is.

**FSDP2's own collectives inside a replica** (its all-gathers and reduce-scatters, on its process groups) are routed
through the pack's communicators (:func:`~lightning_sync.comm.fsdp_comm.count_fsdp_collectives`, installed at
setup once ``configure_model`` has sharded the model): counted in the rank's :class:`~lightning_sync.comm.CommStats`
as ``"intra/fsdp_all_gather"`` and ``"intra/fsdp_reduce_scatter"`` (in ``bytes_intra``), and with ``intra_link``
delayed on the replica's emulated link (the clock of the communicator over its shards).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

from lightning_sync.comm import CommHandle, Communicator
from lightning_sync.comm.accounting import INTRA
from lightning_sync.comm.fsdp import (
    full_tree,
    local_shards,
    local_tree,
    model_from_local,
    optimizer_from_local,
    sharding_problem,
    skip_in_module_sync,
)
from lightning_sync.comm.fsdp_comm import count_fsdp_collectives
from lightning_sync.core.validation import check_bool
from lightning_sync.strategies.topology import InFlight, Topology

__all__ = ["SHARDED_FT_METHODS", "SHARDED_METHODS", "ShardedTopology", "check_sharded"]

#: the pack's methods that run on sharded replicas (named in the refusals of the others)
SHARDED_METHODS = (
    "BSPStrategy",
    "SelSyncStrategy",
    "LocalSGDStrategy",
    "FedAvgStrategy",
    "ADPSGDStrategy",
    "DiLoCoStrategy",
)

#: the methods whose sharded replica groups run fault-tolerant (``sharded_fault_tolerance_refusal = None``)
SHARDED_FT_METHODS = ("BSPStrategy", "LocalSGDStrategy", "DiLoCoStrategy")
#: why a method that does not declare ``sharded_fault_tolerance_refusal = None`` refuses sharded fault tolerance
SHARDED_FT_NOT_BUILT = (
    "fault-tolerant sharded replica groups (a torchft Manager per rank, one quorum per shard index) are built for "
    "BSP's gradient average and the parameter averages of local SGD and DiLoCo only; this method's other syncs (a "
    "participants' draw, a statistic between groups) are not built or tested on them yet."
)

#: what a LightningModule's configure_model writes to shard over the replica (the error messages quote it)
CONFIGURE_MODEL = (
    "def configure_model(self):\n"
    "    from torch.distributed.fsdp import FSDPModule, fully_shard\n"
    "    if isinstance(self.net, FSDPModule):  # sharded at an earlier setup\n"
    "        return\n"
    '    mesh = self.device_mesh["shard"]\n'
    "    for layer in self.net:  # each block, then the whole model\n"
    "        fully_shard(layer, mesh=mesh)\n"
    "    fully_shard(self.net, mesh=mesh)"
)


def check_sharded(strategy: Any, sharded: Any, replica_size: Any, fault_tolerance: Any) -> bool:
    """At construction: ``sharded`` is a bool; ``True`` needs ``replica_size`` and a method that runs sharded (its
    ``sharded_refusal`` is ``None``, and it runs with replica groups) and refuses ``fault_tolerance`` unless the
    method runs fault-tolerant sharded groups (its ``sharded_fault_tolerance_refusal`` is ``None``: BSP, local
    SGD, DiLoCo), saying why and what to use instead."""
    check_bool("sharded", sharded)
    if not sharded:
        return False
    name = type(strategy).__name__
    refusal = strategy.sharded_refusal or strategy.replica_groups_refusal  # no replica groups: none sharded either
    if refusal is not None:
        instead = (
            f", or {name} without replica_size and sharded (every rank a replica holding the whole model)"
            if strategy.replica_groups_refusal
            else f", or {name} with sharded=False (DDP inside each replica)"
        )
        raise ValueError(
            f"sharded=True is not supported by {name}: {refusal} Use a method that runs on sharded replicas "
            f"({', '.join(SHARDED_METHODS)}) with sharded=True{instead}."
        )
    if replica_size is None:
        raise ValueError(
            f"{name}(sharded=True) needs replica_size: the ranks one sharded replica spans, 'node' (the ranks of one "
            "node) or an integer (that many consecutive ranks); the model is sharded with FSDP2 over them"
        )
    # a method that cannot run fault-tolerant at all says so itself (check_fault_tolerance)
    refusal = getattr(strategy, "sharded_fault_tolerance_refusal", SHARDED_FT_NOT_BUILT)
    if fault_tolerance is not None and strategy.fault_tolerance_refusal is None and refusal is not None:
        raise ValueError(
            f"{name}(sharded=True, fault_tolerance=...) is not supported: {refusal} Use "
            f"{' or '.join(SHARDED_FT_METHODS)} with sharded=True and fault_tolerance, or {name} with fault_tolerance "
            "and sharded=False (DDP inside each replica group), or with sharded=True without fault_tolerance."
        )
    return True


class ShardedTopology(Topology):
    """Replicas sharded with FSDP2: every rank averages its local shard over the ranks of its shard index."""

    # ------------------------------------------------------------------ the averages
    def average(self, tensors, tag, participants=None, before_commit=None):  # type: ignore[no-untyped-def]
        s, r = self.strategy, self.strategy.replicas
        if participants is not None and not participants:
            raise ValueError("participants must name at least one replica")
        if r.num_replicas > 1 and r.across is not None:
            s.codec.average_state(r.across, tensors, tag, participants, r.replica_index, "replica")
        if before_commit is not None:
            before_commit()
        return True

    def launch(self, tensors, tag):  # type: ignore[no-untyped-def]
        """The average of ``tensors`` (local shard ranges) in flight on the second group over this shard index's
        ranks (:meth:`open_side_channel`)."""
        handles: list[CommHandle] = []
        if self._side is not None:
            handles = [self._side.all_reduce(t, op="avg", tag=tag, async_op=True) for t in tensors]
        return InFlight(handles, lambda: _wait(handles))

    def start_identical(self, tensors: list[Any]) -> None:
        """Every shard index's shard as replica 0's (tag ``"setup"``): the replicas start identical."""
        across = self.strategy.replicas.across
        if across is not None and self.strategy.replicas.num_replicas > 1:
            for tensor in tensors:
                across.broadcast(tensor, src=0, tag="setup")

    def average_grads(self, tag, comm=None):  # type: ignore[no-untyped-def]
        """Between replicas, after FSDP2's reduce-scatter averaged the gradients inside each replica: every rank's
        local gradient shards (packed into the flat gradient buffer, the floating buffers staged beside them) averaged
        over the ranks of its shard index — one all-reduce per flat buffer, through the codec (compressed with
        ``compression``) — and written back into FSDP2's gradients, which the optimizer then applies. The mean of the
        replicas' means of equally many ranks is the mean over all ranks: FSDP over every rank (HSDP). The floating
        buffers, which FSDP2 leaves each rank its own, are then averaged over the replica's shards too (one exact
        all-reduce inside the replica, ``"intra/<tag>"``): every rank holds the mean of all ranks' buffers, as with
        flat BSP."""
        tensors = self.average_grads_within(tag, comm)
        self.strategy.flat.unpack_grads()
        return tensors

    def average_grads_within(self, tag: str, comm: Communicator | None = None) -> list[Tensor]:
        """As :meth:`average_grads`, the local gradient shards left packed in the flat gradient buffer and not written
        back: the fault-tolerant average between groups that follows writes them back once, when it commits."""
        s, r = self.strategy, self.strategy.replicas
        if comm is not None and comm is not s.comm:
            raise RuntimeError(f"{type(s).__name__}: average_grads over a subgroup has no sharded-replica form")
        flat = s.flat
        flat.pack_grads()
        if r.num_replicas > 1 and r.across is not None:
            tensors = s.codec.average_grads(r.across, flat, tag)
        else:  # one replica: FSDP2 averaged over every rank already
            tensors = flat.grad_tensors(with_buffers=False)
        buffers = [g.buffers for g in flat.groups if g.buffer_numel]
        if buffers and r.shards is not None and r.shards.world_size > 1:
            r.shards.all_reduce_many(buffers, op="avg", tag=tag)
        return tensors

    def identical_over(self) -> Communicator:
        across = self.strategy.replicas.across
        return across if across is not None else self.strategy.comm

    def sum_over_model(self, tensor: Tensor, tag: str) -> None:
        """The sum over this replica's shards (one small all-reduce over its ranks, ``mesh["shard"]``'s, counted as
        ``"intra/<tag>"``): each rank's share of the sum over the model's elements becomes the replica's whole."""
        shards = self.strategy.replicas.shards
        if shards is not None and shards.world_size > 1:
            shards.all_reduce(tensor, op="sum", tag=tag)

    def grad_sq_norm(self) -> Tensor:
        """The squared norm of the replica's whole gradient: each rank's local gradient shard's (FSDP2's averaged one,
        packed into the flat gradient buffer), summed over the replica's shards (tag ``"intra/vote"``)."""
        flat = self.strategy.flat
        flat.pack_grads()
        sq = flat.grad_sq_norm()
        self.sum_over_model(sq, tag="vote")
        return sq

    def mean(self, tensors, tag):  # type: ignore[no-untyped-def]
        r = self.strategy.replicas
        if r.num_replicas > 1 and r.across is not None:
            r.across.all_reduce_many(tensors, op="avg", tag=tag)

    def all_reduce(self, tensor, op, tag):  # type: ignore[no-untyped-def]
        r = self.strategy.replicas
        if r.num_replicas > 1 and r.across is not None:
            r.across.all_reduce(tensor, op=op, tag=tag)

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
            f"(replica_size={s.replica_size!r}, sharded=True): all {s.world_size} ranks form one sharded replica, so "
            "there is no other replica to synchronise with: this trains as FSDP over every rank. Use num_nodes > 1 "
            "(replica_size='node'), or a smaller replica_size."
        )

    def verify(self, tensors: list[Any], what: str, committed: bool = True) -> None:
        """``verify_sync``: every shard identical across the replicas (over the ranks of each shard index)."""
        self.strategy._verify(tensors, f"{what} (this shard across the replicas)", self.identical_over())

    # ------------------------------------------------------------------ lifecycle
    def setup_environment(self) -> None:
        """The device mesh on the LightningModule (``self.device_mesh`` in ``configure_model``), as Lightning's
        ``ModelParallelStrategy`` sets it."""
        module = self.strategy.lightning_module
        if module is not None:
            module._device_mesh = self.strategy.replicas.mesh

    def check_trainer(self, trainer: Any) -> None:
        name = type(self.strategy).__name__
        module = self.strategy.lightning_module
        if not is_overridden("configure_model", module):
            raise ValueError(
                f"{name}(sharded=True) shards each replica's model with FSDP2, and {type(module).__name__} does not "
                "override configure_model. Shard the model there over the replica's ranks, e.g.\n"
                f"{CONFIGURE_MODEL}\nor use sharded=False (every rank holds the whole model)."
            )
        problem = sharding_problem(module, self.strategy.replicas.mesh)
        if problem is not None:
            raise ValueError(
                f"{name}(sharded=True): {type(module).__name__}.configure_model must shard every parameter with "
                f'fully_shard over self.device_mesh["shard"] (the replica\'s ranks), and {problem}. For example\n'
                f"{CONFIGURE_MODEL}"
            )
        # evaluating (validate/test/predict): Lightning broadcasts rank 0's module to every rank first; the shards
        # are each rank's own, so it skips them and start() makes the replicas identical shard by shard instead
        skip_in_module_sync(module)
        # FSDP2's all-gathers and reduce-scatters inside the replica: counted "intra/fsdp_*", on intra_link's clock
        shards = self.strategy.replicas.shards
        stats = shards.stats if shards is not None else self.strategy.comm_stats.level(INTRA)
        clock = shards.clock if shards is not None else None
        count_fsdp_collectives(module, stats, link=self.strategy.intra_link, clock=clock)

    def start(self, trainer: Any) -> None:
        """Evaluating outside fit: every replica takes replica 0's shards (as DDP evaluates rank 0's model; after a
        fit with ``average_at_end``, or from a checkpoint's whole model, they are identical already)."""
        across = self.strategy.replicas.across
        if trainer.state.fn == "fit" or across is None or not self.has_peers:
            return
        for tensor in local_shards(self.strategy.lightning_module):
            if tensor.numel():
                across.broadcast(tensor, src=0, tag="setup")

    # ------------------------------------------------------------------ checkpoints
    def parts_hold_model(self, replicas_diverge: bool) -> bool:
        """Always: every rank holds its own shards, identical replicas (BSP) or not."""
        return True

    def checkpoint_part(self, tree: Any) -> Any:
        """A rank's part holds its local shards (model and optimizer state), as plain tensors."""
        return local_tree(tree)

    def checkpoint_main(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The main file holds the whole model (all-gathered inside each replica, kept on rank 0, which writes it: a
        consolidated state dict, what ``torch.load`` and inference read) and rank 0's local optimizer shards (a resume
        reads every rank's part)."""
        return {
            **checkpoint,
            "state_dict": full_tree(checkpoint.get("state_dict"), keep=self.strategy.global_rank == 0),
            "optimizer_states": local_tree(checkpoint.get("optimizer_states")),
        }

    def restore_model(self, state_dict: Any, module: Any) -> Any:
        return model_from_local(state_dict, module)

    def restore_optimizer(self, state: Any, optimizer: Any) -> Any:
        return optimizer_from_local(state, optimizer)

    def open_side_channel(self) -> None:
        """A second group over each shard index's ranks (collective: every rank, same point), for :meth:`launch`."""
        replicas = self.strategy.replicas
        self._side = replicas.new_across_comm() if replicas.num_replicas > 1 else None


def _wait(handles: Sequence[CommHandle]) -> bool:
    for handle in handles:
        handle.wait()
    return True
