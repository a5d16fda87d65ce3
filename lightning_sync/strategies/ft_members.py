"""How a fault-tolerant replica group's processes become members of torchft's quorum
(:class:`~lightning_sync.strategies.ft_topology.FaultTolerantTopology`'s ``setup_environment``).

Three shapes, one interface (``quorum``, ``commit``, ``all_reduce``, ``agree``, ``gather_groups``...):

* one process per group: its :class:`~lightning_sync.comm.ft.ReplicaGroupComm` (a torchft ``Manager``);
* a group of several processes holding the whole model (exact data parallelism inside): the leader's
  ``ReplicaGroupComm``, mirrored to the others (:class:`~lightning_sync.comm.ft.ReplicaMirror`);
* a sharded group (``sharded=True``, FSDP2 over the group's processes): a ``Manager`` per rank, each a member of its
  shard index's quorum (:class:`~lightning_sync.comm.ft.ShardMember`, torchft's HSDP layout).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_sync.comm.ft import ReplicaGroupComm, ReplicaMirror, ShardMember

__all__ = ["join_group"]


def join_group(
    strategy: Any, receive: Callable[[Any], None], send: Callable[[], Any]
) -> ReplicaGroupComm | ReplicaMirror | ShardMember:
    """This process's membership (see the module docstring): ``send`` is what a peer that is behind receives from
    this process, ``receive`` how this process takes what a peer sent.

    Raises:
        FaultToleranceError: the lighthouse cannot be reached (on every process of the group: the others quote the
            leader's error).
    """
    from lightning_sync.comm.ft import FaultToleranceError, ReplicaMirror, join_sharded

    s = strategy

    def build(group_rank: int, group_world_size: int, store_port: int | None, load: Callable[[Any], None]) -> Any:
        return _manager(s, send, load, group_rank, group_world_size, store_port)

    if s.replicas.sharded:  # every rank joins its shard index's quorum
        return join_sharded(s.replicas.shards, lambda rank, size, port: build(rank, size, port, receive))
    if s.world_size == 1:
        return build(0, 1, None, receive)
    # the leader joins the quorum, the replica's other processes follow it
    mirror = ReplicaMirror(None, s.replicas.intra, receive, leader=s.global_rank == 0)
    inner, failed = None, None
    if s.global_rank == 0:
        try:
            inner = build(0, 1, None, mirror.capture)  # what a peer sends is shared in the group before anyone loads it
        except Exception as err:  # the replica's other processes stop with the same error
            failed = err
    message = mirror.agree(None if failed is None else f"{type(failed).__name__}: {failed}")
    if failed is not None:
        raise failed
    if message is not None:
        raise FaultToleranceError(f"fault tolerance: the replica group's leader (rank 0) could not join: {message}")
    mirror.inner = inner
    return mirror


def _manager(
    s: Any,
    send: Callable[[], Any],
    load: Callable[[Any], None],
    group_rank: int,
    group_world_size: int,
    store_port: int | None,
) -> ReplicaGroupComm:
    from lightning_sync.comm.ft import ReplicaGroupComm

    cfg = s.fault_tolerance
    return ReplicaGroupComm(
        stats=s.comm_stats,
        clock=s.comm.clock,  # one emulated link per rank: its Communicator's
        lighthouse=cfg.lighthouse,
        replica_id=cfg.replica_id,
        min_replicas=cfg.min_replicas,
        group_rank=group_rank,
        group_world_size=group_world_size,
        store_addr=cfg.hostname or os.environ.get("MASTER_ADDR", "127.0.0.1"),
        store_port=store_port,
        state_dict=send,
        load_state_dict=load,
        timeout=cfg.timeout,
        quorum_timeout=cfg.quorum_timeout,
        connect_timeout=cfg.connect_timeout,
        hostname=cfg.hostname,
    )
