"""Fault-tolerant replica groups on torchft: the only code in the pack that touches torchft.

torchft (PyTorch's fault-tolerance library, ``pip install "lightning-sync[ft]"``) provides the pieces; this package
adapts them to the pack's accounting:

* **the lighthouse** (``torchft.coordination.LighthouseServer``, also torchft's ``torchft_lighthouse`` command) forms a
  *quorum* of the replica groups that ask for one: every live group, without the ones whose heartbeats stopped.
  :func:`serve_lighthouse` runs one (``lightning-sync lighthouse``).
* **the Manager** (``torchft.Manager``, one per replica group) asks the lighthouse for a quorum, reconfigures the
  group's process group for the quorum's members, and heals a replica group that is behind (a restarted one) by
  sending it a healthy peer's state; ``should_commit`` then says whether the step's collectives succeeded
  everywhere in the group.
* **the reconfigurable process group** (``torchft.ProcessGroupGloo``): torch's gloo, rebuilt for each new quorum.

:class:`ReplicaGroupComm` wraps them. Every byte goes through one process group, :class:`CountedProcessGroupGloo`, a
``ProcessGroupGloo`` that records each operation in the replica's :class:`~lightning_sync.comm.CommStats` (bytes from
:mod:`~lightning_sync.comm.cost`: gloo's ring over the quorum's members) and delays it on the replica's emulated
:class:`~lightning_sync.comm.LinkClock` — the averages, the configuration check, and the state a healthy peer sends
to a restarted one (torchft's ``PGTransport`` over the same group, instead of its default HTTP transport, so those
bytes are counted too). Not counted: torchft's control plane (heartbeats every 100 ms, quorum and commit requests:
small protobuf messages over gRPC, outside ``torch.distributed``); a quorum is recorded as one operation of 0 bytes
under the tag ``"quorum"``, with the time it blocked, and costs one emulated latency.

One concern a module: :mod:`~lightning_sync.comm.ft.lighthouse` (the lighthouse's entry point),
:mod:`~lightning_sync.comm.ft.process_group` (the counted reconfigurable group),
:mod:`~lightning_sync.comm.ft.replica_group` (the replica group's torchft ``Manager`` and its collectives),
:mod:`~lightning_sync.comm.ft.mirror` (a replica group of several processes), :mod:`~lightning_sync.comm.ft.shard`
(a sharded replica group: a ``Manager`` per rank, one process group per shard index),
:mod:`~lightning_sync.comm.ft.errors`;
torchft itself is imported in ``_torchft`` only. Every name is importable from here.
"""

from __future__ import annotations

from lightning_sync.comm.ft.errors import FaultToleranceError
from lightning_sync.comm.ft.lighthouse import check_lighthouse, lighthouse_main, run_lighthouse, serve_lighthouse
from lightning_sync.comm.ft.mirror import MirroredPending, ReplicaMirror
from lightning_sync.comm.ft.process_group import CountedProcessGroupGloo
from lightning_sync.comm.ft.replica_group import PendingAllReduce, QuorumInfo, ReplicaGroupComm
from lightning_sync.comm.ft.shard import ShardMember, join_sharded

__all__ = [
    "CountedProcessGroupGloo",
    "FaultToleranceError",
    "PendingAllReduce",
    "MirroredPending",
    "QuorumInfo",
    "ReplicaGroupComm",
    "ReplicaMirror",
    "ShardMember",
    "check_lighthouse",
    "join_sharded",
    "lighthouse_main",
    "run_lighthouse",
    "serve_lighthouse",
]
