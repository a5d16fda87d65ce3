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
:meth:`FaultTolerantSync._ft_launch` stays in flight for ``delay`` steps and commits when applied), FedAvg (the round's
fraction drawn among the quorum's members) and ADPSGD (its statistic all-reduced inside the sync's commit). Refused,
with the reason, at construction:
every other strategy (:attr:`~lightning_sync.strategies.SyncStrategy.fault_tolerance_refusal`), compression, data
injection, and (at setup) ``accumulate_grad_batches > 1`` and a group of several processes that are not one replica
(``replica_size`` other than ``"node"`` or the group's size).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import Tensor
from torch.utils._pytree import tree_map

from lightning_sync.core.validation import check_int

if TYPE_CHECKING:
    from lightning_sync.comm.ft import PendingAllReduce, QuorumInfo, ReplicaGroupComm, ReplicaMirror

__all__ = ["FaultTolerance", "FaultTolerantSync"]

log = logging.getLogger(__name__)

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


def _own_copies(tree: Any) -> Any:
    """Every tensor in ``tree`` as a detached copy with its own storage (a parameter is a view of a flat buffer: sent as
    it is, torchft's transport would send the whole buffer for each), everything else as it is."""
    return tree_map(lambda x: x.detach().clone() if isinstance(x, Tensor) else x, tree)


class _QuorumAtStepEnd(Callback):
    """Asks for the quorum of the next step's sync where a checkpoint would be taken (the step's end): see
    :meth:`FaultTolerantSync._ft_step_end`."""

    def __init__(self, strategy: FaultTolerantSync) -> None:
        self._strategy = strategy

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        if trainer.strategy is self._strategy:
            self._strategy._ft_step_end()


class FaultTolerantSync:
    """Mixin of :class:`~lightning_sync.strategies.SyncStrategy`: the glue of ``fault_tolerance=FaultTolerance(...)``.

    The strategy calls :meth:`_ft_setup_environment` (``setup_environment``), :meth:`_ft_start` (end of ``setup``),
    :meth:`_ft_all_reduce` at its syncs, :meth:`_ft_teardown`. A supported method implements
    :meth:`_ft_next_step_syncs` and :meth:`_ft_method_config`.
    """

    fault_tolerance: FaultTolerance | None
    _ft: ReplicaGroupComm | ReplicaMirror | None = None
    #: a quorum was held at this step boundary for the next step's sync (and not used yet)
    _ft_open: bool = False
    _ft_received: Any = None  # a peer's state, received during the quorum, applied after the members' check
    _ft_scratch: dict[tuple[int, int, torch.dtype, torch.device], Tensor] | None = None
    _ft_last_step = 0  # torchft's step when the group left the run (for the metrics after fit)
    _ft_info: QuorumInfo | None = None  # the last quorum

    # ------------------------------------------------------------------ method hooks
    def _ft_next_step_syncs(self) -> bool:
        """Whether the next optimizer step ends with a sync (decided from state every group shares: the schedule).
        Every method that accepts ``fault_tolerance`` overrides it (local SGD, DiLoCo, FedAvg, ADPSGD); the others
        refuse the argument at construction (:attr:`fault_tolerance_refusal`), so this is never reached for them."""
        raise NotImplementedError(
            f"{type(self).__name__} accepts fault_tolerance but does not say which steps sync: override "
            "_ft_next_step_syncs"
        )

    def _ft_method_config(self: Any) -> dict[str, Any]:
        """What must be equal in every replica group (the method's arguments), checked when the quorum changes: the
        outer optimizer and ``average_at_end`` here; a method adds its own to ``super()``'s."""
        outer = getattr(self, "outer_config", None)
        config: dict[str, Any] = {"outer_optimizer": None if outer is None else outer.spec()}
        if hasattr(self, "average_at_end"):
            config["average_at_end"] = self.average_at_end
        return config

    # ------------------------------------------------------------------ setup
    def _ft_setup_environment(self: Any) -> None:
        cfg = self.fault_tolerance
        assert cfg is not None
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return  # validate/test/predict: each replica group evaluates on its own, with nobody else
        name = type(self).__name__
        if self.world_size > 1 and self.ranks_per_replica != self.world_size:
            raise ValueError(
                f"{name}(fault_tolerance=...) with {self.world_size} processes in this replica group: they must form "
                f"one replica (exact data parallelism inside the group, the method between groups), got "
                f"replica_size={self.replica_size!r} ({self.ranks_per_replica} rank(s) per replica). Start each "
                "replica group as one job of one node with replica_size='node' (or replica_size=devices), or run one "
                "process per replica group (devices=1, num_nodes=1)"
            )
        from lightning_sync.comm.ft import ReplicaMirror

        mirror = None
        if self.world_size > 1:  # the leader joins the quorum, the replica's other processes follow it
            mirror = ReplicaMirror(None, self._intra, self._ft_receive, leader=self.global_rank == 0)
        inner, failed = None, None
        if self.global_rank == 0:
            try:
                inner = self._ft_join(cfg, mirror)
            except Exception as err:  # the replica's other processes stop with the same error
                if mirror is None:
                    raise
                failed = err
        if mirror is not None:
            message = mirror.agree(None if failed is None else f"{type(failed).__name__}: {failed}")
            if failed is not None:
                raise failed
            if message is not None:
                raise self._ft_error(f"the replica group's leader (rank 0) could not join: {message}")
            mirror.inner = inner
            self._ft = mirror
        else:
            self._ft = inner
        self._ft_open = False
        self._ft_scratch = {}
        self.ft_quorums = 0
        self.ft_heals = 0
        self.ft_failed_syncs = 0
        self.ft_replicas = 0
        if not any(isinstance(cb, _QuorumAtStepEnd) for cb in trainer.callbacks):
            trainer.callbacks.append(_QuorumAtStepEnd(self))

    def _ft_join(self: Any, cfg: FaultTolerance, mirror: ReplicaMirror | None) -> ReplicaGroupComm:
        """The leader's membership in the quorum (torchft sees one process per replica group; with a ``mirror`` the
        state a peer sends is shared with the group's other processes before anyone loads it)."""
        from lightning_sync.comm.ft import ReplicaGroupComm

        return ReplicaGroupComm(
            stats=self.comm_stats,
            clock=self.comm.clock,  # one emulated link per replica: its Communicator's
            lighthouse=cfg.lighthouse,
            replica_id=cfg.replica_id,
            min_replicas=cfg.min_replicas,
            group_rank=0,
            group_world_size=1,
            store_addr=cfg.hostname or os.environ.get("MASTER_ADDR", "127.0.0.1"),
            store_port=int(os.environ["MASTER_PORT"]),
            state_dict=self._ft_state_to_send,
            load_state_dict=self._ft_receive if mirror is None else mirror.capture,
            timeout=cfg.timeout,
            quorum_timeout=cfg.quorum_timeout,
            connect_timeout=cfg.connect_timeout,
            hostname=cfg.hostname,
        )

    def _ft_check_trainer(self: Any, trainer: pl.Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"{type(self).__name__}(fault_tolerance=...) does not support accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}: a restarted replica group takes its peers' state at a step's end, "
                "which must be an optimizer step's end. Use a larger batch size."
            )

    def _ft_sampler_kwargs(self: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Training data sharded over the replica groups (by their fixed index), everything else over this group's
        processes only (every group validates on the whole validation split)."""
        cfg = self.fault_tolerance
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return kwargs
        return {
            "num_replicas": cfg.replica_groups * self.world_size,
            "rank": cfg.replica_group * self.world_size + self.global_rank,
        }

    def _ft_start(self: Any, trainer: pl.Trainer) -> None:
        """End of setup (fit): join the quorum before the first step. At a fresh start (or when every group resumed
        at the same torchft step) wait up to ``join_timeout`` for all ``replica_groups``; torchft makes every group
        take one's initial state. A group that is behind (restarted) receives a peer's state and training resumes
        from it. Then a group that was not behind commits once, so any group that starts later is behind and heals,
        never the other way round."""
        cfg = self.fault_tolerance
        start = time.monotonic()
        deadline = cfg.join_timeout.total_seconds()
        quorum_deadline = cfg.quorum_timeout.total_seconds()
        while True:
            info = self._ft_quorum(startup=True)
            now = self._ft.agree(time.monotonic() - start)  # the leader's clock: every process decides alike
            if info.error is not None:  # e.g. the peer sending the state was lost: the next quorum tries again
                if now >= quorum_deadline:
                    raise self._ft_error(
                        f"replica group {cfg.replica_group} could not join the run within quorum_timeout "
                        f"({cfg.quorum_timeout.total_seconds():g} s): {info.error} (at torchft step "
                        f"{info.step_before}, quorum of {info.replica_world_size})"
                    )
                log.warning("replica group %d: joining failed (%s); trying again", cfg.replica_group, info.error)
                time.sleep(0.5)
                continue
            behind = info.healed and info.step_before < info.step
            if info.replica_world_size < cfg.min_replicas and now < quorum_deadline:
                time.sleep(0.1)
                continue
            if behind or info.replica_world_size >= cfg.replica_groups or now >= deadline:
                break
            time.sleep(0.1)
        if info.replica_world_size < cfg.min_replicas:
            raise self._ft_error(
                f"only {info.replica_world_size} replica group(s) joined within quorum_timeout "
                f"({cfg.quorum_timeout.total_seconds():g} s), fewer than min_replicas={cfg.min_replicas}"
            )
        if info.replica_world_size < cfg.replica_groups and not behind:
            log.warning(
                "replica group %d starts with %d of %d replica groups after join_timeout (%g s); the others join "
                "later and take the state of the running ones",
                cfg.replica_group,
                info.replica_world_size,
                cfg.replica_groups,
                cfg.join_timeout.total_seconds(),
            )
        if info.step_before == info.step and not self._ft.commit():
            raise self._ft_error(f"replica group {cfg.replica_group} could not commit its start: {self._ft_why()}")
        self._ft_open = True  # the quorum serves the first step's sync, if it has one

    # ------------------------------------------------------------------ quorum
    def _ft_quorum(self: Any, startup: bool = False) -> QuorumInfo:
        """One quorum. At start-up it may wait ``quorum_timeout`` (a restarted group waits for its peers' next sync);
        during training the groups reach it within a step of each other (the lighthouse drops a silent one after its
        heartbeat timeout), so ``timeout`` bounds it: a lighthouse that is gone stops every group that long after its
        next sync begins."""
        assert self._ft is not None
        self._ft_received = None
        info = self._ft.quorum(timeout=None if startup else self.fault_tolerance.timeout)
        self._ft_info = info
        self.ft_quorums += 1
        self.ft_replicas = info.replica_world_size
        if info.changed:
            self._ft_check_members(info)
        received, self._ft_received = self._ft_received, None
        if info.healed and received is not None:
            self._ft_apply(received, startup)
            self.ft_heals += 1
        self._ft_open = True
        return info

    def _ft_check_members(self: Any, info: QuorumInfo) -> None:
        """The quorum's members changed: compare their configurations (one small all-gather, tag ``"setup"``). When all
        are at the same torchft step (a fresh start, or every group resumed at the same step) any difference stops
        every group; otherwise the running groups (those at the highest step) are the reference, and a group that
        joins with another configuration, or with the index of a running group, stops alone. The error names the
        difference."""
        cfg = self.fault_tolerance
        mine = {
            "strategy": type(self).__name__,
            "config": self._ft_method_config(),
            "model": [(str(g.state.dtype), int(g.state.numel()), int(g.param_numel)) for g in self.flat.groups],
            "replica_groups": cfg.replica_groups,
            "processes_per_group": self.world_size,
        }
        gathered = self._ft.all_gather_object((info.step_before, cfg.replica_group, mine), tag="setup")
        if gathered is None:
            return  # a member is gone already: this quorum's commit fails, the next one checks again
        steps = [step for step, _, _ in gathered]
        fresh = len(set(steps)) == 1
        running = [(group, c) for step, group, c in gathered if step == max(steps)]
        ref_group, ref = min(running, key=lambda x: x[0])
        checked = [(group, c) for _, group, c in gathered] if fresh else [(cfg.replica_group, mine)]
        for group, theirs in checked:
            for key in mine:
                if theirs[key] != ref[key]:
                    raise self._ft_error(
                        f"replica group {group}'s {key} is {theirs[key]!r}, replica group {ref_group}'s is "
                        f"{ref[key]!r}: every replica group must run the same strategy, arguments and model"
                        + (" (all groups stop: they started together)" if fresh else "")
                    )
        groups = [group for _, group, _ in gathered]
        duplicated = sorted({g for g in groups if groups.count(g) > 1})
        if duplicated and (fresh or cfg.replica_group in duplicated and info.step_before < max(steps)):
            raise self._ft_error(
                f"replica group {duplicated[0]} joined twice (two processes started with replica_group="
                f"{duplicated[0]}): give each replica group its own index in [0, {cfg.replica_groups})"
            )

    def _ft_error(self, message: str) -> Exception:
        from lightning_sync.comm.ft import FaultToleranceError

        return FaultToleranceError(f"fault tolerance: {message}")

    def _ft_why(self: Any) -> str:
        return self._ft.why()

    # ------------------------------------------------------------------ state transfer
    def _ft_state_to_send(self: Any) -> dict[str, Any]:
        """What a peer that is behind receives (called by torchft during the quorum, while this group's training thread
        waits in it): the checkpoint Lightning would write here, and the strategy's state without its own
        accounting and torchft step (a group counts its own bytes; torchft sends its step itself)."""
        trainer = self.lightning_module.trainer
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        state = self.strategy_state()
        state.pop("comm", None)
        state.pop("ft", None)
        group = self.fault_tolerance.replica_group
        return _own_copies({"checkpoint": checkpoint, "strategy": state, "replica_group": group})

    def _ft_receive(self, state: Any) -> None:
        self._ft_received = state  # applied after the members' check (a mismatched model must fail with a message)

    def _ft_apply(self: Any, received: dict[str, Any], startup: bool) -> None:
        """Take a peer's state. At start-up, as Lightning restores a checkpoint: the model, datamodule and callbacks
        now, and (Lightning's ``restore_training_state`` right after setup) loops, optimizers, schedulers. During
        training (this group failed a commit its peers made) the model, optimizers and schedulers: the loops are at
        the same step already."""
        trainer = self.lightning_module.trainer
        connector = trainer._checkpoint_connector
        checkpoint = received["checkpoint"]
        fresh = checkpoint.get("global_step", 0) == 0 and checkpoint.get("epoch", 0) == 0
        if startup and not fresh:
            connector._loaded_checkpoint = checkpoint
            connector.restore_model()
            connector.restore_datamodule()
            connector.restore_callbacks()
        else:
            if not fresh and checkpoint.get("global_step") != trainer.global_step:
                log.warning(
                    "replica group %d takes replica group %s's state at its global step %s, at its own global step %d",
                    self.fault_tolerance.replica_group,
                    received.get("replica_group"),
                    checkpoint.get("global_step"),
                    trainer.global_step,
                )
            previous, connector._loaded_checkpoint = connector._loaded_checkpoint, checkpoint
            try:
                connector.restore_model()
                if not fresh:
                    connector.restore_optimizers_and_schedulers()
            finally:
                connector._loaded_checkpoint = previous
        state = dict(received["strategy"])
        state["comm"] = self.comm_stats.state_dict()  # this group's own totals go on
        restored_comm = self._restored_comm
        self.load_strategy_state(state)
        self._restored_comm = restored_comm
        log.info(
            "replica group %d took replica group %s's state (global step %s)",
            self.fault_tolerance.replica_group,
            received.get("replica_group"),
            checkpoint.get("global_step"),
        )

    # ------------------------------------------------------------------ the step and the sync
    def _ft_step_end(self: Any) -> None:
        """A step's end (where a checkpoint would be taken): hold the quorum of the next step's sync now, if it has
        one, so a restarted group heals here, at a step boundary, and the sync itself only all-reduces."""
        self._ft_open = False
        if self._ft is not None and self._ft_next_step_syncs():
            self._ft_quorum()

    def _ft_current_quorum(self: Any) -> QuorumInfo:
        """The quorum this step's sync runs over: the one held at the step boundary before it, or one held now (e.g.
        the final average)."""
        if not self._ft_open:
            self._ft_quorum()
        return self._ft_info

    def _ft_all_reduce(
        self: Any,
        tensors: list[Tensor],
        tag: str,
        participants: list[int] | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> bool:
        """Average ``tensors`` over the current quorum (a quorum first if none was held for this step, e.g. the final
        average), then commit: on success the tensors hold the mean; otherwise (a peer failed mid-sync, fewer than
        ``min_replicas``) they keep this group's values: the all-reduce runs in place over a backup copy, put back when
        it did not commit, so a failure halfway leaves nothing half-averaged. Returns whether it committed.

        ``participants``: the quorum's replica ranks whose values are averaged (FedAvg's draw): the others contribute
        zeros to the same all-reduce and every group takes the participants' mean. ``before_commit`` runs while the
        tensors hold the mean, before the commit, when the all-reduce succeeded: collectives it issues through
        :attr:`_ft` are committed with the average or not at all (ADPSGD's statistic)."""
        info = self._ft_current_quorum()
        self._ft_open = False
        backups = [self._ft_copy(i, t) for i, t in enumerate(tensors)]
        if participants is None:
            ok = self._ft.all_reduce(tensors, op="avg", tag=tag)
        else:
            if not participants:
                raise ValueError("participants must name at least one replica group of the quorum")
            if info.replica_rank not in participants:
                with torch.no_grad():
                    for t in tensors:
                        t.zero_()
            ok = self._ft.all_reduce(tensors, op="sum", tag=tag)
            if ok:
                with torch.no_grad():
                    for t in tensors:
                        t.div_(len(participants))
        if ok and before_commit is not None:
            before_commit()
        return self._ft_commit(tensors, backups)

    def _ft_commit(self: Any, tensors: list[Tensor], backups: list[Tensor] | None) -> bool:
        """Commit this quorum's sync; when it does not commit, put ``backups`` back into ``tensors`` (``None``: the
        tensors are a copy that is only applied on a commit) and log it. Returns whether it committed."""
        committed = self._ft.commit()
        if not committed:
            if backups is not None:
                with torch.no_grad():
                    for t, b in zip(tensors, backups):
                        t.copy_(b)
            self.ft_failed_syncs += 1
            log.warning(
                "replica group %d: the sync after step %d was not committed (%s); it keeps its own replica until the "
                "next one",
                self.fault_tolerance.replica_group,
                self.step_counter.steps,
                self._ft_why(),
            )
        return committed

    def _ft_launch(self: Any, tensors: list[Tensor], tag: str) -> PendingAllReduce:
        """Launch the average of ``tensors`` over the current quorum and return at once (streaming DiLoCo's fragment
        in flight during the next ``delay`` steps); :meth:`_ft_finish` waits and commits. No quorum is held before
        then: the method's schedule puts the next sync after it."""
        self._ft_current_quorum()
        self._ft_open = False
        return self._ft.all_reduce_async(tensors, op="avg", tag=tag)

    def _ft_finish(self: Any, pending: PendingAllReduce) -> bool:
        """Wait for an average :meth:`_ft_launch` started, then commit it. Its tensors are a copy of the group's
        values: on ``False`` they are not to be applied (the group keeps its own)."""
        pending.wait()
        return self._ft_commit(pending.tensors, None)

    def _ft_copy(self, index: int, tensor: Tensor) -> Tensor:
        key = (index, tensor.numel(), tensor.dtype, tensor.device)
        scratch = self._ft_scratch
        if key not in scratch:
            scratch[key] = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        return scratch[key].copy_(tensor.reshape(-1)).view_as(tensor)

    def _ft_verify(self: Any, tensors: list[Tensor], what: str, committed: bool) -> None:
        """``verify_sync``: the groups that committed this sync hold the same values (a checksum gathered over the
        quorum, tag ``"verify"``); one that failed keeps its own legitimately."""
        local = self.flat.checksum(tensors).tolist() if committed else None
        gathered = self._ft.all_gather_object(local, tag="verify")
        if gathered is None:
            log.warning("verify_sync: the replica groups could not be compared after the sync (a member is gone)")
            return
        sums = [s for s in gathered if s is not None]
        if sums and any(s != sums[0] for s in sums):
            raise RuntimeError(
                f"verify_sync: {what} differ across the replica groups that committed the sync at step "
                f"{self.step_counter.steps} (checksums {gathered})"
            )

    # ------------------------------------------------------------------ metrics, state, teardown
    def _ft_metrics(self) -> dict[str, float]:
        return {
            "ft_quorums": float(self.ft_quorums),
            "ft_heals": float(self.ft_heals),
            "ft_failed_syncs": float(self.ft_failed_syncs),
            "ft_replicas": float(self.ft_replicas),
            "ft_step": float(self._ft.step if self._ft is not None else self._ft_last_step),
        }

    def _ft_teardown(self) -> None:
        ft, self._ft = self._ft, None
        self._ft_scratch = None
        if ft is not None:
            self._ft_last_step = ft.step
            ft.shutdown()

    def _ft_trainer_fitting(self: Any, trainer: pl.Trainer) -> bool:
        return trainer.state.fn == TrainerFn.FITTING
