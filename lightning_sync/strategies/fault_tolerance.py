r"""Fault-tolerant replica groups on torchft: training that survives a lost replica.

``LocalSGDStrategy(period=8, fault_tolerance=FaultTolerance(lighthouse="http://host:29510", replica_group=0,
replica_groups=3))``: every *replica group* is its own job, started on its own, with its own Lightning world: one
process (``devices=1``), or a node of processes that are one replica (``devices=N, replica_size="node"``: exact data
parallelism inside, :mod:`~lightning_sync.strategies.replicas`). The groups meet only at their syncs, through torchft
(:mod:`lightning_sync.comm.ft`):

* **Quorums at syncs only.** At the end of the step before a sync step (a callback's ``on_train_batch_end``, where a
  checkpoint would be taken) each group asks torchft's lighthouse for a quorum: the groups alive now. The sync at
  the end of the next step averages over that quorum (the process group is rebuilt when the members changed) and
  commits through torchft (``should_commit``). Local steps talk to nobody: no per-step quorum.
* **A lost group is dropped** from the next quorum (the lighthouse stops hearing its heartbeats); a sync it breaks
  (it died during the all-reduce) is not committed anywhere it failed: every group that could not complete it keeps
  its own replica, and nobody stops.
* **A restarted group heals before its first step.** At start-up it asks for a quorum right away, which forms at its
  peers' next sync boundary; a healthy peer then sends it, over the same accounted process group, everything a
  checkpoint taken there would hold — model, optimizers, schedulers, loops (so the step counter, the epoch and the
  position in it, and the data loader's position), callbacks — and the strategy's state (schedule position, step
  counters, DiLoCo's outer optimizer and global parameters, ``evaluate="last_sync"``'s copy). Lightning restores it as
  it restores a checkpoint (``fit(ckpt_path=...)``), and the group then takes part in that very sync.
* **A group of several processes** has one member of the quorum, its first process (the leader, as between
  replica groups without fault tolerance); the others follow it through :class:`~lightning_sync.comm.ft.ReplicaMirror`
  over the replica's own communicator: they receive the quorum's answer, a peer's state, each average and each
  commit's verdict, so every process of the group decides alike and holds the same replica. A lost process takes its
  whole group down (its collectives inside the group fail); the group restarts as a whole, like a lost node.
* **A sharded group** (``sharded=True``: the model sharded with FSDP2 over the group's processes; local SGD and
  DiLoCo): every rank is a member of its shard index's quorum, torchft's HSDP layout
  (:class:`~lightning_sync.comm.ft.ShardMember`: a ``Manager`` per rank, one process group per shard index rebuilt
  per quorum), so each rank averages its own shard with the same shard of the live groups and a restarted group
  receives each shard from the same shard of a live one; the group's ranks share one quorum and one commit verdict
  (torchft's manager server on the group's rank 0 gathers them). A lost process loses its group (FSDP2's collectives
  fail). Every group must have the same shard count (checked at the first quorum).
* **Data.** The training data is sharded over ``replica_groups`` by the group's fixed index (a group that is gone
  leaves its shard untrained until it is back); validation data only over the group's own processes, so every group
  validates on the whole validation split (groups in sync report the same metrics).
* **Accounting.** Every byte (averages, the configuration check, state transfers) goes through one accounted process
  group, link-emulated on the replica's link (:class:`~lightning_sync.comm.ft.CountedProcessGroupGloo`); each quorum
  counts as one operation of 0 bytes (tag ``"quorum"``) with the time it blocked.
* **Bad setups end with an error naming the cause**: the lighthouse unreachable at start (within
  ``connect_timeout``), gone later (at the next sync), a group whose configuration differs from its peers' or whose
  index is already taken (checked over the quorum whenever its members change), a strategy or argument that cannot
  run fault-tolerant (at construction).

Supported: local SGD, DiLoCo (plain and streaming: a fragment's all-reduce launched over the quorum with
:meth:`~lightning_sync.strategies.ft_topology.FaultTolerantTopology.launch` stays in flight for ``delay`` steps and
commits when applied), FedAvg (the round's
fraction drawn among the quorum's members), ADPSGD (its statistic all-reduced inside the sync's commit) and BSP
(DDP's semantics between groups: a quorum at every step's end, the step's gradients averaged over it and committed; a
step that does not commit is not applied — :meth:`~lightning_sync.strategies.ft_topology.FaultTolerantTopology
.average_grads`). Refused, with the reason, at construction:
every other strategy (:attr:`~lightning_sync.strategies.SyncStrategy.fault_tolerance_refusal`), compression, data
injection, sharded groups of FedAvg and ADPSGD (not built yet: ``sharded_fault_tolerance_refusal``), and (at
setup) sharded groups with different shard counts, ``accumulate_grad_batches > 1`` and a group of several processes
that are not one replica (``replica_size`` other than ``"node"`` or the group's size).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from lightning_sync.core.validation import check_int

__all__ = ["FaultTolerance", "check_fault_tolerance"]

#: environment variables read when the argument is not given (torchft's own names)
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
REPLICA_GROUPS_ENV = "NUM_REPLICA_GROUPS"
FT_EXTRA = 'pip install "lightning-sync[ft]"'


def _seconds(name: str, value: Any) -> timedelta:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise ValueError(f"FaultTolerance.{name} must be a datetime.timedelta (or seconds) > 0, got {value!r}")
    return value


def _env_int(name: str, value: Any, env: str, minimum: int) -> int:
    if value is None:
        text = os.environ.get(env)
        if text is None:
            raise ValueError(f"FaultTolerance.{name} is not given and {env} is not set: give {name}=... or set {env}")
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"FaultTolerance.{name}: {env}={text!r} is not an integer") from None
    return check_int(f"FaultTolerance.{name}", value, minimum)


@dataclass(frozen=True)
class FaultTolerance:
    """How a replica group joins the fault-tolerant run (validated at construction; see the module docstring).

    Args:
        lighthouse: the torchft lighthouse's URL, ``http://host:29510`` (default: ``$TORCHFT_LIGHTHOUSE``).
        replica_group: this group's index in ``[0, replica_groups)``, fixed across restarts: it names the group and
            picks its shard of the training data (default: ``$REPLICA_GROUP_ID``).
        replica_groups: how many groups the run has (the data is sharded over them; at a fresh start each waits up to
            ``join_timeout`` for all of them) (default: ``$NUM_REPLICA_GROUPS``).
        min_replicas: the fewest groups a sync may commit with (torchft's ``min_replica_size``; start the lighthouse
            with the same ``--min-replicas``).
        timeout: bound of every collective, state transfer and commit (a peer that hangs fails the sync after it), and
            of a quorum during training (a lighthouse that is gone stops every group this long into its next sync).
        quorum_timeout: how long a quorum may wait: a restarted group waits for its peers' next sync, so at least a
            period of steps, with margin.
        connect_timeout: how long to try to reach the lighthouse at start before failing with a clear error.
        join_timeout: at a fresh start (every group at torchft step 0, or all resumed at the same step), how long to
            wait for all ``replica_groups`` before training with those that came (the others join later and heal).
        hostname: the address other groups reach this group's rendezvous store and manager at (default:
            ``$MASTER_ADDR``, the loopback address for a local run: set it on a cluster).
    """

    lighthouse: str | None = None
    replica_group: int | None = None
    replica_groups: int | None = None
    min_replicas: int = 1
    timeout: timedelta = field(default=timedelta(seconds=60))
    quorum_timeout: timedelta = field(default=timedelta(seconds=600))
    connect_timeout: timedelta = field(default=timedelta(seconds=10))
    join_timeout: timedelta = field(default=timedelta(seconds=60))
    hostname: str | None = None

    def __post_init__(self) -> None:
        lighthouse = self.lighthouse if self.lighthouse is not None else os.environ.get(LIGHTHOUSE_ENV)
        if not isinstance(lighthouse, str) or not lighthouse.startswith(("http://", "https://")):
            got = "nothing" if lighthouse is None else repr(lighthouse)
            raise ValueError(
                f"FaultTolerance.lighthouse must be the lighthouse's URL such as 'http://host:29510' (or set "
                f"{LIGHTHOUSE_ENV}), got {got}"
            )
        groups = _env_int("replica_groups", self.replica_groups, REPLICA_GROUPS_ENV, 1)
        group = _env_int("replica_group", self.replica_group, REPLICA_GROUP_ENV, 0)
        if group >= groups:
            raise ValueError(f"FaultTolerance.replica_group must be in [0, replica_groups={groups}), got {group}")
        check_int("FaultTolerance.min_replicas", self.min_replicas, 1, groups)
        if self.hostname is not None and (not isinstance(self.hostname, str) or not self.hostname):
            raise ValueError(f"FaultTolerance.hostname must be a host name or address, got {self.hostname!r}")
        object.__setattr__(self, "lighthouse", lighthouse)
        object.__setattr__(self, "replica_group", group)
        object.__setattr__(self, "replica_groups", groups)
        for name in ("timeout", "quorum_timeout", "connect_timeout", "join_timeout"):
            object.__setattr__(self, name, _seconds(name, getattr(self, name)))

    @property
    def replica_id(self) -> str:
        """The group's name with torchft (a restarted group keeps it; torchft appends a fresh suffix per process)."""
        return f"replica_{self.replica_group}"


def check_fault_tolerance(strategy: Any, fault_tolerance: Any, kwargs: dict[str, Any]) -> FaultTolerance | None:
    """The ``fault_tolerance`` argument of a strategy: ``None`` or a :class:`FaultTolerance` this strategy, these
    arguments and this installation can run; otherwise a ``ValueError`` (``ImportError`` without torchft) saying why."""
    if fault_tolerance is None:
        return None
    if not isinstance(fault_tolerance, FaultTolerance):
        raise ValueError(
            f"fault_tolerance must be a lightning_sync.FaultTolerance(...) or None, got {fault_tolerance!r}"
        )
    name = type(strategy).__name__
    refusal = type(strategy).fault_tolerance_refusal
    if refusal is not None:
        raise ValueError(f"fault_tolerance must be None for {name}, which cannot run fault-tolerant: {refusal}")
    for arg, why in (
        ("compression", "a compressed average is an all-to-all then an all-gather, over a fixed world"),
        ("injection", "data injection is an all-gather among all ranks at every step, not only at syncs"),
    ):
        if kwargs.get(arg) is not None:
            raise ValueError(f"{name}(fault_tolerance=...) does not support {arg}={kwargs[arg]!r}: {why}")
    if importlib.util.find_spec("torchft") is None:
        raise ImportError(f"fault_tolerance needs torchft, which is not installed: {FT_EXTRA}")
    return fault_tolerance
