"""The fault-tolerant topology: this process's replica group is one member of a torchft quorum.

:class:`FaultTolerantTopology` is the :class:`~lightning_sync.strategies.topology.Topology` a strategy runs with
``fault_tolerance=FaultTolerance(...)`` (what it does for the user: :mod:`~lightning_sync.strategies.fault_tolerance`).
It owns the replica group's torchft glue — its membership (:class:`~lightning_sync.comm.ft.ReplicaGroupComm`, or the
:class:`~lightning_sync.comm.ft.ReplicaMirror` of a group of several processes), the quorum held at the step boundary
before a sync, the commit of each average, the state a restarted group takes from a peer, its counters — so the
strategy calls the same interface as for a flat or grouped run and never asks which it is:

* the lifecycle every topology has: :meth:`setup_environment` (reach the lighthouse), :meth:`start` (end of
  ``setup``: the first quorum; a restarted group heals here), :meth:`check_trainer`, :meth:`sampler_kwargs`,
  :meth:`metrics`, :meth:`state_dict` / :meth:`load_state_dict`, :meth:`close`;
* the averages: :meth:`average` (over the current quorum, then commit: on failure the tensors keep this group's
  values), :meth:`launch` (streaming DiLoCo's fragment in flight), :meth:`all_reduce` (a statistic committed with the
  sync), :meth:`members`, :meth:`verify`; :meth:`mean` (validation) runs inside the group (``within``).

What the method says: which step syncs (``_ft_next_step_syncs``, from state every group shares) and what every group
must agree on (``_ft_method_config``), hooks of :class:`~lightning_sync.strategies.periodic.PeriodicAveraging` (the
periodic methods: a quorum before each sync) and of :class:`~lightning_sync.strategies.BSPStrategy` (every step: a
quorum at each step's end, the gradients averaged over it by :meth:`FaultTolerantTopology.average_grads`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import Tensor
from torch.utils._pytree import tree_map

from lightning_sync.strategies.ft_members import join_group
from lightning_sync.strategies.sharded_topology import ShardedTopology
from lightning_sync.strategies.topology import InFlight, ReplicaHost, Topology, layout_topology

if TYPE_CHECKING:
    from lightning_sync.comm.ft import PendingAllReduce, QuorumInfo, ReplicaGroupComm, ReplicaMirror, ShardMember
    from lightning_sync.strategies.fault_tolerance import FaultTolerance

__all__ = ["FaultTolerantTopology"]

log = logging.getLogger("lightning_sync.strategies.fault_tolerance")


def _own_copies(tree: Any) -> Any:
    """Every tensor in ``tree`` as a detached copy with its own storage (a parameter is a view of a flat buffer: sent as
    it is, torchft's transport would send the whole buffer for each), everything else as it is."""
    return tree_map(lambda x: x.detach().clone() if isinstance(x, Tensor) else x, tree)


def _error(message: str) -> Exception:
    from lightning_sync.comm.ft import FaultToleranceError

    return FaultToleranceError(f"fault tolerance: {message}")


class _QuorumAtStepEnd(Callback):
    """Asks for the quorum of the next step's sync where a checkpoint would be taken (the step's end): see
    :meth:`FaultTolerantTopology.step_end`."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        if trainer.strategy is self._strategy:
            self._strategy.topology.step_end()


class FaultTolerantTopology(Topology):
    """This replica group is one member of a torchft quorum (see the module docstring); ``within`` is how the group's
    own ranks average (validation's mean over the group's world)."""

    def __init__(self, strategy: ReplicaHost, within: Topology) -> None:
        super().__init__(strategy)
        self.within = within
        self.config: FaultTolerance = strategy.fault_tolerance
        #: the group's membership: the leader's torchft Manager, the mirror of a group of several processes, or this
        #: rank's membership of a sharded group
        self.ft: ReplicaGroupComm | ReplicaMirror | ShardMember | None = None
        self._open = False  # a quorum was held at this step boundary for the next step's sync (and not used yet)
        self._received: Any = None  # a peer's state, received during the quorum, applied after the members' check
        self._scratch: dict[tuple[int, int, torch.dtype, torch.device], Tensor] = {}
        self._info: QuorumInfo | None = None  # the last quorum
        self._last_step = 0  # torchft's step when the group left the run (for the metrics after fit)
        self._joined = False
        #: counters of this fit (the metrics ``ft_*``)
        self.quorums = 0
        #: times this group took a peer's state because it was behind (restarted, or it missed a commit): not the
        #: initial weights every group takes from one of them at a fresh start
        self.heals = 0
        self.failed_syncs = 0
        self.replicas = 0

    @property
    def step(self) -> int:
        """torchft's step: the syncs committed so far."""
        return self.ft.step if self.ft is not None else self._last_step

    # ------------------------------------------------------------------ lifecycle
    def setup_environment(self) -> None:
        """Reach the lighthouse and become the group's member (:func:`~lightning_sync.strategies.ft_members
        .join_group`: the one process, the leader whom the others mirror, or every rank of a sharded group for its
        shard index). Only when fitting: validate/test/predict evaluate each replica group on its own, with nobody
        else. The group's own layout first (sharded: the device mesh on the LightningModule)."""
        self.within.setup_environment()
        s = self.strategy
        trainer = s.lightning_module.trainer if s.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        name = type(s).__name__
        if s.world_size > 1 and s.ranks_per_replica != s.world_size:
            raise ValueError(
                f"{name}(fault_tolerance=...) with {s.world_size} processes in this replica group: they must form "
                f"one replica (exact data parallelism or FSDP2 inside the group, the method between groups), got "
                f"replica_size={s.replica_size!r} ({s.ranks_per_replica} rank(s) per replica). Start each "
                "replica group as one job of one node with replica_size='node' (or replica_size=devices), or run one "
                "process per replica group (devices=1, num_nodes=1)"
            )
        self.ft = join_group(s, self._receive, self._state_to_send)
        self._joined = True
        if not any(isinstance(cb, _QuorumAtStepEnd) for cb in trainer.callbacks):
            trainer.callbacks.append(_QuorumAtStepEnd(s))

    def check_trainer(self, trainer: pl.Trainer) -> None:
        self.within.check_trainer(trainer)  # sharded: configure_model shards every parameter over "shard"
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"{type(self.strategy).__name__}(fault_tolerance=...) does not support accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}: a restarted replica group takes its peers' state at a step's end, "
                "which must be an optimizer step's end. Use a larger batch size."
            )

    def sampler_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Training data sharded over the replica groups (by their fixed index), everything else over this group's
        processes only (every group validates on the whole validation split)."""
        s, cfg = self.strategy, self.config
        trainer = s.lightning_module.trainer if s.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return kwargs
        return {
            "num_replicas": cfg.replica_groups * s.world_size,
            "rank": cfg.replica_group * s.world_size + s.global_rank,
        }

    def start(self, trainer: pl.Trainer) -> None:
        """End of setup (fit): join the quorum before the first step. At a fresh start (or when every group resumed
        at the same torchft step) wait up to ``join_timeout`` for all ``replica_groups``; torchft makes every group
        take one's initial state. A group that is behind (restarted) receives a peer's state and training resumes
        from it. Then a group that was not behind commits once, so any group that starts later is behind and heals,
        never the other way round."""
        if self.ft is None or trainer.state.fn != TrainerFn.FITTING:
            self.within.start(trainer)  # evaluating: as the group's own layout does it
            return
        cfg = self.config
        start = time.monotonic()
        deadline = cfg.join_timeout.total_seconds()
        quorum_deadline = cfg.quorum_timeout.total_seconds()
        while True:
            info = self._quorum(startup=True)
            now = self.ft.agree(time.monotonic() - start)  # the leader's clock: every process decides alike
            if info.error is not None:  # e.g. the peer sending the state was lost: the next quorum tries again
                if now >= quorum_deadline:
                    raise _error(
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
            raise _error(
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
        if info.step_before == info.step and not self.ft.commit():
            raise _error(f"replica group {cfg.replica_group} could not commit its start: {self.ft.why()}")
        self._open = True  # the quorum serves the first step's sync, if it has one

    def close(self) -> None:
        super().close()
        ft, self.ft = self.ft, None
        self._scratch = {}
        if ft is not None:
            self._last_step = ft.step
            ft.shutdown()

    def metrics(self) -> dict[str, float]:
        if not self._joined:
            return {}
        return {
            "ft_quorums": float(self.quorums),
            "ft_heals": float(self.heals),
            "ft_failed_syncs": float(self.failed_syncs),
            "ft_replicas": float(self.replicas),
            "ft_step": float(self.step),
        }

    def state_dict(self) -> dict[str, Any]:
        # torchft's step: a resumed replica group must not look behind
        return {} if self.ft is None else {"ft": self.ft.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.ft is not None and state.get("ft") is not None:
            self.ft.load_state_dict(state["ft"])

    # ------------------------------------------------------------------ quorum
    def _quorum(self, startup: bool = False) -> QuorumInfo:
        """One quorum. At start-up it may wait ``quorum_timeout`` (a restarted group waits for its peers' next sync);
        during training the groups reach it within a step of each other (the lighthouse drops a silent one after its
        heartbeat timeout), so ``timeout`` bounds it: a lighthouse that is gone stops every group that long after its
        next sync begins."""
        assert self.ft is not None
        self._received = None
        info = self.ft.quorum(timeout=None if startup else self.config.timeout)
        self._info = info
        self.quorums += 1
        if not startup and info.replica_world_size != self.replicas:  # a group was lost or came back: say so
            log.warning(
                "replica group %d: this sync's quorum has %d of %d replica groups (the last one had %d)",
                self.config.replica_group,
                info.replica_world_size,
                self.config.replica_groups,
                self.replicas,
            )
        self.replicas = info.replica_world_size
        if info.changed:
            self._check_members(info)
        received, self._received = self._received, None
        if info.healed and received is not None:
            self._apply(received, startup)
            self.heals += int(info.step_before < info.step)
        self._open = True
        return info

    def _check_members(self, info: QuorumInfo) -> None:
        """The quorum's members changed: compare their configurations (one small all-gather, tag ``"setup"``). When all
        are at the same torchft step (a fresh start, or every group resumed at the same step) any difference stops
        every group; otherwise the running groups (those at the highest step) are the reference, and a group that
        joins with another configuration, or with the index of a running group, stops alone. The error names the
        difference."""
        s, cfg = self.strategy, self.config
        mine = {  # sharded: rank 0's (shard 0's) layout, compared among the groups' ranks 0
            "strategy": type(s).__name__,
            "sharded": s.replicas.sharded,
            "processes_per_group": s.world_size,
            "config": s._ft_method_config(),
            "model": [(str(g.state.dtype), int(g.state.numel()), int(g.param_numel)) for g in s.flat.groups],
            "replica_groups": cfg.replica_groups,
        }
        gathered = self.ft.gather_groups((info.step_before, cfg.replica_group, mine), tag="setup")
        if gathered is None:
            return  # a member is gone already: this quorum's commit fails, the next one checks again
        steps = [step for step, _, _ in gathered]
        fresh = len(set(steps)) == 1
        running = [(group, c) for step, group, c in gathered if step == max(steps)]
        ref_group, ref = min(running, key=lambda x: x[0])
        checked = [(group, c) for _, group, c in gathered] if fresh else [(cfg.replica_group, mine)]
        for group, theirs in checked:
            for key in mine:
                if theirs[key] != ref[key] and key == "processes_per_group" and mine["sharded"]:
                    raise _error(
                        f"replica group {group} shards its model over {theirs[key]} process(es), replica group "
                        f"{ref_group} over {ref[key]}: sharded replica groups must have the same shard count (the same "
                        "devices and replica_size), since each shard index averages with the same shard of the other "
                        "groups. Start every group with the same number of processes"
                        + (" (all groups stop: they started together)" if fresh else "")
                    )
                if theirs[key] != ref[key]:
                    raise _error(
                        f"replica group {group}'s {key} is {theirs[key]!r}, replica group {ref_group}'s is "
                        f"{ref[key]!r}: every replica group must run the same strategy, arguments and model"
                        + (" (all groups stop: they started together)" if fresh else "")
                    )
        groups = [group for _, group, _ in gathered]
        duplicated = sorted({g for g in groups if groups.count(g) > 1})
        if duplicated and (fresh or cfg.replica_group in duplicated and info.step_before < max(steps)):
            raise _error(
                f"replica group {duplicated[0]} joined twice (two processes started with replica_group="
                f"{duplicated[0]}): give each replica group its own index in [0, {cfg.replica_groups})"
            )

    # ------------------------------------------------------------------ state transfer
    def _state_to_send(self) -> dict[str, Any]:
        """What a peer that is behind receives (called by torchft during the quorum, while this group's training thread
        waits in it): the checkpoint Lightning would write here, and the strategy's state without its own
        accounting and torchft step (a group counts its own bytes; torchft sends its step itself)."""
        s = self.strategy
        trainer = s.lightning_module.trainer
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in ("state_dict", "optimizer_states"):  # as this rank holds it (sharded: its local shards)
            checkpoint[key] = self.within.checkpoint_part(checkpoint.get(key))
        state = s.strategy_state()
        state.pop("comm", None)
        state.pop("ft", None)
        return _own_copies({"checkpoint": checkpoint, "strategy": state, "replica_group": self.config.replica_group})

    def _receive(self, state: Any) -> None:
        self._received = state  # applied after the members' check (a mismatched model must fail with a message)

    def _apply(self, received: dict[str, Any], startup: bool) -> None:
        """Take a peer's state. At start-up, as Lightning restores a checkpoint: the model, datamodule and callbacks
        now, and (Lightning's ``restore_training_state`` right after setup) loops, optimizers, schedulers. During
        training (this group failed a commit its peers made) the model, optimizers and schedulers: the loops are at
        the same step already."""
        s = self.strategy
        trainer = s.lightning_module.trainer
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
                    self.config.replica_group,
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
        state["comm"] = s.comm_stats.state_dict()  # this group's own totals go on
        restored_comm = s._restored_comm
        s.load_strategy_state(state)
        s._restored_comm = restored_comm
        log.log(
            logging.INFO if fresh else logging.WARNING,  # the initial weights at a fresh start; else a heal
            "replica group %d took replica group %s's state (global step %s)",
            self.config.replica_group,
            received.get("replica_group"),
            checkpoint.get("global_step"),
        )

    # ------------------------------------------------------------------ the step and the sync
    def step_end(self) -> None:
        """A step's end (where a checkpoint would be taken): hold the quorum of the next step's sync now, if it has
        one, so a restarted group heals here, at a step boundary, and the sync itself only all-reduces."""
        self._open = False
        if self.ft is not None and self.strategy._ft_next_step_syncs():
            self._quorum()

    def _current_quorum(self) -> QuorumInfo:
        """The quorum this step's sync runs over: the one held at the step boundary before it, or one held now (e.g.
        the final average)."""
        if not self._open:
            self._quorum()
        assert self._info is not None
        return self._info

    def average(
        self,
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
        :meth:`all_reduce` are committed with the average or not at all (ADPSGD's statistic)."""
        info = self._current_quorum()
        self._open = False
        assert self.ft is not None
        backups = [self._copy(i, t) for i, t in enumerate(tensors)]
        if participants is None:
            ok = self.ft.all_reduce(tensors, op="avg", tag=tag)
        else:
            if not participants:
                raise ValueError("participants must name at least one replica group of the quorum")
            if info.replica_rank not in participants:
                with torch.no_grad():
                    for t in tensors:
                        t.zero_()
            ok = self.ft.all_reduce(tensors, op="sum", tag=tag)
            if ok:
                with torch.no_grad():
                    for t in tensors:
                        t.div_(len(participants))
        if ok and before_commit is not None:
            before_commit()
        return self._commit(tensors, backups)

    def _commit(self, tensors: list[Tensor], backups: list[Tensor] | None, dropped: str = "") -> bool:
        """Commit this quorum's sync; when it does not commit, put ``backups`` back into ``tensors`` (``None``: the
        tensors are a copy that is only applied on a commit, or ``dropped`` says what is not applied) and log it.
        Returns whether it committed."""
        assert self.ft is not None
        committed = self.ft.commit()
        if not committed:
            if backups is not None:
                with torch.no_grad():
                    for t, b in zip(tensors, backups):
                        t.copy_(b)
            self.failed_syncs += 1
            log.warning(
                "replica group %d: the sync after step %d was not committed (%s); %s",
                self.config.replica_group,
                self.strategy.step_counter.steps,
                self.ft.why(),
                f"{dropped} is not applied" if dropped else "it keeps its own replica until the next one",
            )
        return committed

    def launch(self, tensors: list[Tensor], tag: str) -> InFlight:
        """Launch the average of ``tensors`` over the current quorum and return at once (streaming DiLoCo's fragment
        in flight during the next ``delay`` steps); its finish waits and commits (its tensors are a copy of the
        group's values: on ``False`` they are not to be applied). No quorum is held before then: the method's
        schedule puts the next sync after it."""
        self._current_quorum()
        self._open = False
        assert self.ft is not None
        pending: PendingAllReduce = self.ft.all_reduce_async(tensors, op="avg", tag=tag)

        def finish() -> bool:
            pending.wait()
            return self._commit(pending.tensors, None)

        return InFlight([pending], finish)

    def completed(self, tensors: list[Tensor], tag: str) -> InFlight:
        return self.within.completed(tensors, tag)  # committed before the checkpoint: this group applies it

    def _copy(self, index: int, tensor: Tensor) -> Tensor:
        key = (index, tensor.numel(), tensor.dtype, tensor.device)
        scratch = self._scratch
        if key not in scratch:
            scratch[key] = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        return scratch[key].copy_(tensor.reshape(-1)).view_as(tensor)

    def average_grads(self, tag: str, comm: Any = None) -> list[Tensor]:
        """BSP's step between replica groups: the gradients (and the floating buffers staged beside them), averaged
        inside this group first (``within``: its processes, its buckets), then over the current quorum — held at the
        previous step's end, so a restarted group healed there — and committed. A step that does not commit (a group
        was lost mid-all-reduce, fewer than ``min_replicas``) is not applied: the gradients are dropped, so the
        optimizer leaves the parameters and its state as they were, and the buffers keep this group's values; a
        group that missed a commit its peers made is behind at the next quorum and takes a peer's state there.

        A sharded group: ``within`` left FSDP2's averaged local gradient shards packed in the flat gradient buffer;
        each rank all-reduces its own over its shard index's quorum, and a commit writes them back into FSDP2's
        gradients (a step that does not commit drops them, as above)."""
        s = self.strategy
        tensors = self.within.average_grads_within(tag, comm)  # left in the flat buffer, written back on commit
        self._current_quorum()
        self._open = False
        assert self.ft is not None
        s.flat.stage_buffers()
        grads = s.flat.grad_tensors()
        self.ft.all_reduce(grads, op="avg", tag=tag)
        committed = self._commit(grads, None, dropped="the step's update")
        if committed:
            s.flat.unstage_buffers()
            s.flat.unpack_grads()  # sharded: into FSDP2's gradients (nothing otherwise: they are views of the buffer)
        else:
            s.flat.drop_grads()
        if s.verify_sync:  # across the groups (the strategy's own check covers this group's processes)
            self.verify(grads, "gradients and buffers", committed)
        return tensors

    def mean(self, tensors: list[Tensor], tag: str) -> None:
        self.within.mean(tensors, tag)

    def sum_over_model(self, tensor: Tensor, tag: str) -> None:
        self.within.sum_over_model(tensor, tag)  # inside the group (its shards, were it sharded), then all_reduce

    def grad_sq_norm(self) -> Tensor:
        return self.within.grad_sq_norm()

    def all_reduce(self, tensor: Tensor, op: str, tag: str) -> None:
        assert self.ft is not None
        self.ft.all_reduce([tensor], op=op, tag=tag)  # over the quorum, committed with the sync

    def members(self) -> int:
        return self._current_quorum().replica_world_size

    @property
    def has_peers(self) -> bool:
        return True  # the other replica groups are in other processes

    def alone(self) -> str | None:
        return None

    @property
    def replicas_in_run(self) -> int:
        return self.within.replicas_in_run * self.config.replica_groups

    def verify(self, tensors: list[Tensor], what: str, committed: bool = True) -> None:
        """``verify_sync``: the groups that committed this sync hold the same values (a checksum gathered over the
        quorum, tag ``"verify"``); one that failed keeps its own legitimately."""
        assert self.ft is not None
        s = self.strategy
        local = s.flat.checksum(tensors).tolist() if committed else None
        gathered = self.ft.all_gather_object(local, tag="verify")
        if gathered is None:
            log.warning("verify_sync: the replica groups could not be compared after the sync (a member is gone)")
            return
        sums = [x for x in gathered if x is not None]
        if sums and any(x != sums[0] for x in sums):
            raise RuntimeError(
                f"verify_sync: {what} differ across the replica groups that committed the sync at step "
                f"{s.step_counter.steps} (checksums {gathered})"
            )

    def open_side_channel(self) -> None:
        """Nothing to open: an average in flight runs on torchft's own group over the quorum."""

    # ------------------------------------------------------------------ the group's own layout (sharded: FSDP2's)
    def start_identical(self, tensors: list[Tensor]) -> None:
        self.within.start_identical(tensors)  # inside the group; the groups start alike through torchft's init_sync

    def identical_over(self) -> Any:
        return self.within.identical_over()

    def parts_hold_model(self, replicas_diverge: bool) -> bool:
        return self.within.parts_hold_model(replicas_diverge)

    def checkpoint_part(self, tree: Any) -> Any:
        return self.within.checkpoint_part(tree)

    def checkpoint_main(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        return self.within.checkpoint_main(checkpoint)

    def restore_model(self, state_dict: Any, module: Any) -> Any:
        return self.within.restore_model(state_dict, module)

    def restore_optimizer(self, state: Any, optimizer: Any) -> Any:
        return self.within.restore_optimizer(state, optimizer)


def topology_for(strategy: ReplicaHost) -> Topology:
    """The topology ``strategy`` runs, chosen once at ``setup_environment`` (after its groups): fault-tolerant over
    ``within`` (the group's own layout: sharded, grouped or flat), or that layout alone."""
    within = ShardedTopology(strategy) if strategy.replicas.sharded else layout_topology(strategy)
    if strategy.fault_tolerance is not None:
        return FaultTolerantTopology(strategy, within)
    return within
