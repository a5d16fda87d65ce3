"""Sync-Switch (Li et al.): train with BSP, switch to ASP inside the running processes.

The strategy owns the mechanics — two protocols, the switch between them, the configuration policy, excluding
stragglers from the BSP group — and :class:`~lightning_sync.callbacks.SyncSwitch` decides *when* (a schedule of
workload fractions, or the online greedy / elastic policies with the S − σ straggler detector).

**Batch positions.** Every rank walks one global, per-epoch shuffled order of batches (the dynamic loader of the
parameter-server strategies). Under BSP the ``m`` participants take positions in rounds without communicating:
participant ``j`` trains position ``F + k·m + j`` in round ``k`` (``F``: where the segment started); a last round
with fewer than ``m`` positions left is dropped, as ``DistributedSampler(drop_last=True)`` does, so every
participant runs the same number of steps. Under ASP ranks claim positions from a shared counter that starts where
BSP stopped. Every batch is trained once, the switch included.

**BSP → ASP** (any step): the ranks agree on the next free position (a 4-byte all-reduce, which is also the
meeting), each loads its parameter-server shards from its replica (identical under BSP), and from the next step on
pushes its own updates (:class:`~lightning_sync.strategies.ASPStrategy`'s exchange). No process restarts: the
switch costs one tiny collective and a copy (the paper restarts from a checkpoint: 36-90 s).

**ASP → BSP** (greedy's return, or a schedule segment): ranks running ASP meet only at the end of an epoch, so the
switch takes effect at the next epoch start: every rank flushes its pushes and takes the servers' global model.

**Elastic exclusion**: the stragglers leave the BSP group (a process group over the others is created on all
ranks); an excluded rank parks inside the step until the BSP quota is done (it then joins the switch to ASP with
the group's replica) or the group finishes the epoch, whichever comes first; at the epoch end the cluster is
restored (the detector excludes a rank again if it is still slow). The one batch the parked rank holds when it
leaves is trained after its return.

**Configuration policy** (§IV-C): the per-worker batch ``B`` is unchanged, BSP's global batch is ``m·B``, and
BSP's learning rate is ``m`` times ASP's (linear scaling). The anchor is the rate in the user's optimizer, which is
DDP's (the rate for the average gradient of the global batch): BSP uses it as is (``bsp_lr_scale=1.0``), and under
ASP every pushed update is scaled by ``1/m`` (``update_scale="auto"``, as :class:`ASPStrategy`), so each push moves
the global model by ``η/m`` times the worker's gradient — the paper's ratio, and a run that trains at DDP's rate out
of the box. The paper's literal configuration (BSP at ``m·η``, ASP pushes at ``η``) is
``bsp_lr_scale=None, update_scale=1.0``. A learning-rate factor multiplies the rate of every parameter group for the
optimizer step only and is removed afterwards, so it composes with any LR scheduler exactly: at every step the
effective rate is ``factor × (what the scheduler set)``; schedulers, logs of ``param_groups`` and checkpoints see
the unscaled value. Momentum and everything else are unchanged (the paper found that best).
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer

from lightning_sync.comm import Communicator
from lightning_sync.comm.buckets import DEFAULT_BUCKET_CAP_MB, check_bucket_cap_mb
from lightning_sync.comm.work import WorkCounter
from lightning_sync.core.switch import PROTOCOLS
from lightning_sync.core.validation import check_real
from lightning_sync.strategies.asp import ASPStrategy
from lightning_sync.strategies.param_groups import for_the_step
from lightning_sync.strategies.ps import ParameterServerStrategy
from lightning_sync.strategies.sync_switch_control import SyncSwitch


class SyncSwitchStrategy(ASPStrategy):
    """BSP and ASP in one run; :class:`~lightning_sync.callbacks.SyncSwitch` says when to use which.

    ``Trainer(strategy="sync_switch")`` without a ``SyncSwitch`` callback adds ``SyncSwitch()`` (BSP for the first
    25% of the workload, then ASP). Everything the parameter-server strategies reject at setup is rejected here too
    (ranks run different numbers of steps under ASP); ``max_epochs`` must be set (the schedule is a fraction of it);
    ``accumulate_grad_batches`` must be 1 (the workload is counted in batch positions per optimizer step).

    Args:
        bsp_lr_scale: learning-rate factor under BSP: a number > 0 (default 1: the user's rate, DDP's), or ``None``
            for the number of BSP participants ``m`` (the paper's linear scaling of a rate tuned for one worker).
        asp_lr_scale: learning-rate factor of each worker's own optimizer step under ASP (> 0, default 1).
        update_scale: factor of every pushed update under ASP: ``"auto"`` (default, ``1/m``, ``m`` = ranks pushing)
            or a number > 0 (``1.0``: the paper's literal ASP). See :class:`ASPStrategy`.
        warmup_steps: pushes over which the ASP phase's update scale ramps linearly from 0 (0 = off).
        worker_momentum: the workers' momentum in the ASP phase: ``None`` (default: the user's, unchanged — the
            paper keeps momentum across the switch), ``"auto"`` or a number in ``[0, 1)``, as
            :class:`ASPStrategy`'s.
        shard_size: largest parameter-server shard, in elements.
        bucket_cap_mb: bucket size in MiB of the BSP phase's gradient all-reduce, overlapped with backward as
            :class:`~lightning_sync.strategies.BSPStrategy`'s (a number > 0; ``None``: after backward, no overlap).
        **kwargs: :class:`~lightning_sync.strategies.base.SyncStrategy` arguments.
    """

    strategy_name = "sync_switch"
    strategy_description = "Sync-Switch: BSP then ASP in the same processes, with online straggler policies"
    #: The schedule and the BSP quota count batch positions per optimizer step and the policies time steps; with
    #: accumulation a step spans several positions (the quota would be undercounted) and the callback could
    #: switch between the micro-batches of one step.
    supports_accumulation = False
    state_fields = {"sync_switch": ("protocol", "_next_protocol", "bsp_batches", "switches")}
    replica_groups_refusal = (
        "its ASP phase makes every rank an asynchronous parameter-server worker (the ranks of a replica would not "
        "step in lockstep), and its BSP phase excludes single stragglers from the gradient all-reduce, rank by rank."
    )
    sharded_refusal = (
        "its ASP phase makes every rank an asynchronous parameter-server worker, while the ranks of a sharded replica "
        "must run FSDP2's all-gathers and reduce-scatters in lockstep, and its BSP phase excludes single straggling "
        "ranks from the gradient all-reduce, which a rank of a sharded replica cannot leave (its replica's "
        "reduce-scatter needs it). For sharded replicas use BSPStrategy(sharded=True), or local SGD / DiLoCo for "
        "infrequent syncs."
    )

    def __init__(
        self,
        bsp_lr_scale: float | None = 1.0,
        asp_lr_scale: float = 1.0,
        update_scale: float | Literal["auto"] = "auto",
        warmup_steps: int = 0,
        worker_momentum: float | Literal["auto"] | None = None,
        shard_size: int = 1 << 22,
        bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
        **kwargs: Any,
    ) -> None:
        self.bucket_cap_mb = check_bucket_cap_mb(bucket_cap_mb)
        if bsp_lr_scale is not None:
            bsp_lr_scale = check_real("bsp_lr_scale", bsp_lr_scale, 0.0, low_open=True)
        self.bsp_lr_scale = bsp_lr_scale
        self.asp_lr_scale = check_real("asp_lr_scale", asp_lr_scale, 0.0, low_open=True)
        super().__init__(
            update_scale=update_scale,
            warmup_steps=warmup_steps,
            worker_momentum=worker_momentum,
            shard_size=shard_size,
            **kwargs,
        )
        self.protocol = "bsp"
        self._next_protocol: str | None = None  # decided at an epoch end for the next epoch
        self._bsp_comm: Communicator | None = None  # a subgroup while ranks are excluded; None: self.comm
        self.participants: tuple[int, ...] = ()
        self.excluded: frozenset[int] = frozenset()
        self._exclusions = 0
        # batch positions (see the module docstring)
        self._epoch = -1
        self._num_batches = 0
        self._frontier = 0
        self._rounds = 0
        self._segment = 0
        self._offset = 0
        self._exhaust_epoch: int | None = None
        self._resync: str | None = None  # "global" (servers' model) or "leader" (BSP group's replica)
        self._resync_src = 0
        self._restore_after_epoch = False
        self._epoch_exhausted = False
        self._local_step = False
        #: global batches trained with BSP (all participants; the quota the online policies count)
        self.bsp_batches = 0
        self.epoch_done = 0  # batches of the current epoch done under BSP (positions)
        #: one entry per switch: {"step", "epoch", "from", "to", "position", "seconds"}
        self.switches: list[dict[str, Any]] = []
        #: compute seconds of the last step (wall time between step ends minus time blocked communicating)
        self.last_step_compute_s: float | None = None
        self._t_prev: float | None = None
        self._blocked_prev = 0.0

    # ------------------------------------------------------------------ setup
    def _check_supported(self, trainer: pl.Trainer) -> None:
        super()._check_supported(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.max_epochs is None or trainer.max_epochs < 1:
            raise ValueError(
                f"SyncSwitchStrategy needs max_epochs (got {trainer.max_epochs!r}): the switch points are fractions "
                "of the training workload, max_epochs passes over the data. Set Trainer(max_epochs=N)."
            )
        # the callback that decides when to switch, added with its defaults when the user passes none
        controller = SyncSwitch
        if not any(isinstance(cb, controller) for cb in trainer.callbacks):
            trainer.callbacks.append(controller())
            rank_zero_info(
                f"SyncSwitchStrategy: no {controller.__name__} callback given, added {controller.__name__}() (BSP for "
                f"the first 25% of the workload, then ASP). Pass callbacks=[{controller.__name__}(schedule=...)] to "
                "choose."
            )

    def _on_flat_ready(self) -> None:
        super()._on_flat_ready()
        if not self.participants:
            self.participants = tuple(range(self.world_size))

    def lr_scale(self, protocol: str | None = None) -> float:
        """The learning-rate factor of ``protocol`` (default: the current one) per the configuration policy."""
        if (protocol or self.protocol) == "asp":
            return self.asp_lr_scale
        return float(len(self.participants) or self.world_size) if self.bsp_lr_scale is None else self.bsp_lr_scale

    @property
    def bsp_comm(self) -> Communicator:
        return self._bsp_comm if self._bsp_comm is not None else self.comm

    @property
    def parked(self) -> bool:
        return self.global_rank in self.excluded

    # ------------------------------------------------------------------ batch positions
    def _claim(self, epoch: int) -> int:
        if epoch != self._epoch:
            self._start_epoch(epoch)
        if self._exhaust_epoch == epoch:
            return WorkCounter.EXHAUSTED
        if self.protocol == "asp":
            assert self._work is not None
            return self._offset + self._work.claim(epoch, self._segment)
        m = len(self.participants)
        start = self._frontier + self._rounds * m
        self._rounds += 1
        if start + m > self._num_batches:
            return WorkCounter.EXHAUSTED
        return start + self.participants.index(self.global_rank)

    def _start_epoch(self, epoch: int) -> None:
        self._restore_if_due()
        self._epoch_exhausted = False
        self._epoch = epoch
        self._frontier = self._rounds = self._segment = self._offset = 0
        self.epoch_done = 0
        self._t_prev = None
        if self._next_protocol is not None:
            if self._next_protocol == "bsp" and self.protocol == "asp":
                self._resync = "global"
            self._record_switch(self.protocol, self._next_protocol, 0.0)
            self.protocol = self._next_protocol
            self._next_protocol = None

    def _next_free(self) -> int:
        """The first position no BSP round has drawn yet (identical on the BSP participants)."""
        return self._frontier + self._rounds * len(self.participants)

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        sampler = getattr(dataloader, "batch_sampler", None)
        if hasattr(sampler, "num_batches"):
            self._num_batches = int(sampler.num_batches)
        return dataloader

    @property
    def num_batches(self) -> int:
        """Batch positions per epoch (of the whole training set)."""
        return self._num_batches

    # ------------------------------------------------------------------ the step
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        scale = self.lr_scale()
        try:
            with for_the_step(optimizer, "lr", lambda lr: lr * scale):
                return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            self._measure()

    def _pushes_this_step(self) -> bool:
        return self.protocol == "asp" and not self._local_step

    def _overlap_grads(self) -> tuple[Communicator, str] | None:
        # the protocol and the BSP group change between steps only (the callback acts at batch ends)
        if self.protocol == "bsp" and not self._local_step:
            return self.bsp_comm, "grads"
        return None

    def _after_backward(self, optimizer: Optimizer) -> None:
        if self.protocol == "bsp" and not self._local_step:
            self.average_grads(comm=self.bsp_comm, verify_update=True)

    def _gradient_is_local(self) -> bool:
        """The BSP phase's gradient is the participants' mean (clipped as given, as DDP); the ASP phase's, a worker's
        own (``local_clipping``)."""
        return not (self.protocol == "bsp" and not self._local_step)

    def _after_update(self, optimizer: Optimizer) -> None:
        if self._local_step:  # a parked rank's held batch after the epoch ended without it
            self._local_step = False
            self.step_counter.record(False)
            return
        if self.protocol == "asp":
            super()._after_update(optimizer)
            return
        m = len(self.participants)
        self.bsp_batches += m
        self.epoch_done += m
        self.step_counter.record(True)
        if not self.excluded:
            self.sigterm.check()  # 4 bytes, as BSP: every rank stops together

    def _measure(self) -> None:
        now = time.perf_counter()
        blocked = self.comm_stats.total_blocked_seconds(include_bookkeeping=True)
        if self._t_prev is not None:
            self.last_step_compute_s = max(0.0, (now - self._t_prev) - (blocked - self._blocked_prev))
        else:
            self.last_step_compute_s = None
        self._t_prev = now
        self._blocked_prev = blocked

    def progress(self) -> float:
        """Fraction of the training workload (``max_epochs`` passes) done: completed epochs plus the positions
        trained under BSP in this one (identical on every BSP participant)."""
        trainer = self.lightning_module.trainer
        total = max(1, int(trainer.max_epochs or 1) * max(1, self._num_batches))
        epoch = max(self._epoch, 0)
        return min(1.0, (epoch * self._num_batches + self.epoch_done) / total)

    # ------------------------------------------------------------------ switches
    def _record_switch(self, old: str, new: str, seconds: float, **extra: Any) -> None:
        trainer = self.lightning_module.trainer
        self.switches.append(
            {
                "step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "from": old,
                "to": new,
                "position": self._next_free() if old == "bsp" else None,
                "seconds": seconds,
                **extra,
            }
        )

    def switch_to_asp(self) -> None:
        """BSP → ASP now (call on every rank at the same step). Releases parked ranks first."""
        if self.protocol != "bsp":
            raise RuntimeError(f"switch_to_asp: the protocol is already {self.protocol!r}")
        start = time.perf_counter()
        leader = self.participants[0]
        if self.excluded:
            assert self._work is not None
            self._work.post(f"release{self._exclusions}", "asp")
        self._enter_asp(leader if self.excluded else None)
        self._record_switch("bsp", "asp", time.perf_counter() - start)

    def _enter_asp(self, resync_from: int | None) -> None:
        state = self.flat.state_tensors()[0]
        if resync_from is not None:  # a parked rank comes back: everyone takes the BSP group's replica
            self._take_from(resync_from)
        self._leave_subgroup()
        assert self._host is not None and self._prev is not None
        if self._host is not state:
            self._host.copy_(state)
        self.ps.reset_params(self._host)
        self._prev.copy_(state)
        frontier = torch.tensor([float(self._next_free() if not self.parked else 0)])
        self.comm.all_reduce(frontier, op="max", tag="switch")  # the meeting: every server is loaded after it
        self.excluded = frozenset()
        self.participants = tuple(range(self.world_size))
        self._segment += 1
        self._offset = int(frontier.item())
        self.protocol = "asp"

    def set_next_epoch_protocol(self, protocol: str) -> None:
        """Use ``protocol`` from the next epoch on (call on every rank at the end of an epoch)."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        self._next_protocol = protocol if protocol != self.protocol else None

    def exclude(self, ranks: set[int] | frozenset[int]) -> None:
        """Elastic policy: continue BSP without ``ranks`` (call on every rank at the same BSP step). The
        excluded ranks park here until the group switches to ASP or finishes the epoch."""
        if self.protocol != "bsp":
            raise RuntimeError("exclude: ranks can only leave the BSP group")
        new = frozenset(ranks) | self.excluded
        survivors = [r for r in range(self.world_size) if r not in new]
        if len(survivors) < 1 or new == self.excluded:
            return
        if self._epoch_exhausted:
            # the group has no round left in this epoch (its data ran out at the last step): nobody parks, the
            # cluster is restored at the epoch end as after any exclusion
            self.excluded = new
            self._record_switch("bsp", "bsp", 0.0, excluded=sorted(new))
            self._restore_after_epoch = True
            return
        frontier = self._next_free()
        self._leave_subgroup()
        self._bsp_comm = self.comm.subgroup(survivors)
        self._exclusions += 1
        self.excluded = new
        self.participants = tuple(survivors)
        self._frontier, self._rounds = frontier, 0
        self._record_switch("bsp", "bsp", 0.0, excluded=sorted(new))
        if self.parked:
            self._park()

    def _park(self) -> None:
        assert self._work is not None
        name = f"release{self._exclusions}"
        deadline = time.monotonic() + self._wait_timeout.total_seconds()
        start = time.perf_counter()
        while (message := self._work.poll(name)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.global_rank} was excluded and not released within {self._wait_timeout}")
            time.sleep(0.02)
        self.comm_stats.record_blocked("switch", time.perf_counter() - start)
        leader = self.participants[0]
        if message == "asp":
            self._enter_asp(leader)
            self._record_switch("parked", "asp", time.perf_counter() - start)
        else:  # the group finished the epoch: meet it there, train the batch in hand locally, resync after
            self._exhaust_epoch = self._epoch
            self._local_step = True
            self._restore_after_epoch = True
            self._record_switch("parked", "bsp", time.perf_counter() - start)

    def _release_state(self) -> None:
        self._leave_subgroup()
        self.excluded = frozenset()
        self.participants = tuple(range(self.world_size))
        self._resync = "leader"

    def _leave_subgroup(self) -> None:
        if self._bsp_comm is not None:
            self._bsp_comm.destroy()
            self._bsp_comm = None

    def _on_exhausted(self, epoch: int) -> None:
        self._epoch_exhausted = True
        if self.protocol == "bsp" and self.excluded and not self.parked:
            # the group has consumed the epoch: release the parked ranks so every rank meets at the epoch end;
            # the group trains its last round, then the cluster is restored (at the next epoch or validation)
            assert self._work is not None
            self._work.post(f"release{self._exclusions}", "epoch")
            self._restore_after_epoch = True
        super()._on_exhausted(epoch)

    def _release_state(self) -> None:
        """Back to the full cluster; the replicas are made identical from the group's leader before the next step."""
        self._resync_src = self.participants[0]
        self._leave_subgroup()
        self.excluded = frozenset()
        self.participants = tuple(range(self.world_size))
        self._resync = "leader"
        self._restore_after_epoch = False

    def restore_now(self) -> None:
        """If parked ranks are due back (an exclusion ended with the epoch): restore the cluster now, on every rank
        together, instead of at the next epoch start."""
        self._restore_if_due()
        self._resync_now()

    def _restore_if_due(self) -> None:
        if self._restore_after_epoch:
            self._release_state()

    def _resync_now(self) -> None:
        """Make replicas identical after an ASP epoch (the servers' model) or an exclusion (the group's replica).
        Every rank reaches this at the same point (a batch start, validation, the end of fit)."""
        kind, self._resync = self._resync, None
        if kind is None:
            return
        state = self.flat.state_tensors()[0]
        if kind == "global":
            state.copy_(self._gather_global("switch"))
            self._take_optimizer_state(self.participants[0])
        else:
            self._take_from(self._resync_src)
            self._take_optimizer_state(self._resync_src)
        self._t_prev = None

    def _take_optimizer_state(self, src: int) -> None:
        """Every rank takes ``src``'s optimizer state (momentum buffers...): after ASP steps or a parked rank's
        local step they differ, and BSP with identical gradients on identical parameters would still drift apart
        through them. One object broadcast per resync (epoch boundaries only)."""
        for optimizer in self.lightning_module.trainer.optimizers:
            state = self.comm.broadcast_object(optimizer.state_dict(), src=src, tag="switch")
            if self.global_rank != src:
                optimizer.load_state_dict(state)

    def _take_from(self, src: int) -> None:
        """Every rank takes ``src``'s replica and BSP counters (a rank coming back from being parked missed them)."""
        self.comm.broadcast(self.flat.state_tensors()[0], src=src, tag="switch")
        counters = torch.tensor([float(self.bsp_batches), float(self.epoch_done)], dtype=torch.float64)
        self.comm.broadcast(counters, src=src, tag="switch")
        self.bsp_batches, self.epoch_done = int(counters[0]), int(counters[1])

    @property
    def rejoin_leader(self) -> int | None:
        """While parked ranks are to rejoin at the coming epoch start: the BSP group's first rank (whose decision
        state the others take), identical on every rank; ``None`` otherwise."""
        return self.participants[0] if self._restore_after_epoch else None

    def gather_throughputs(self, value: float | None) -> list[float | None]:
        """All-gather one number per rank of the BSP group (every member calls it at the same step); the result
        is indexed by global rank, ``None`` for ranks outside the group or without a value."""
        sent = torch.tensor([math.nan if value is None else float(value)], dtype=torch.float64)
        gathered = self.bsp_comm.all_gather(sent, tag="switch")
        out: list[float | None] = [None] * self.world_size
        for i, rank in enumerate(self.participants):
            v = float(gathered[i, 0])
            out[rank] = None if math.isnan(v) else v
        return out

    # ------------------------------------------------------------------ hooks
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._resync_now()

    def on_validation_start(self) -> None:
        if self._fitting():
            self._restore_if_due()
            self._resync_now()
        if self.protocol == "asp":
            super().on_validation_start()
        else:
            super(ParameterServerStrategy, self).on_validation_start()

    def on_validation_end(self) -> None:
        if self.protocol == "asp":
            super().on_validation_end()
        else:
            super(ParameterServerStrategy, self).on_validation_end()
        self._t_prev = None

    def on_train_end(self) -> None:
        if self._ps is not None:
            self._restore_if_due()
            self._resync_now()
        if self.protocol == "asp" or self._ps is None:
            super().on_train_end()
            return
        # BSP at the end: the replicas are the model; close the servers without taking their (stale) parameters
        self._ps.close(self.comm)
        self.server_summary = {"pushes": self._ps.pushes, "switches": list(self.switches)}
        self._close_work()
        super(ParameterServerStrategy, self).on_train_end()

    def _main_file_checkpoint(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        if self.protocol == "bsp":
            return checkpoint  # replicas are identical under BSP: rank 0's is the model
        return super()._main_file_checkpoint(checkpoint)

    # ------------------------------------------------------------------ state and metrics
    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        metrics["asp"] = 1.0 if self.protocol == "asp" else 0.0
        metrics["lr_scale"] = self.lr_scale()
        metrics["bsp_participants"] = float(len(self.participants))
        return metrics

    def teardown(self) -> None:
        self._leave_subgroup()
        super().teardown()
