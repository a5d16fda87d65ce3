"""The Lightning glue shared by the parameter-server strategies (ASP, SSP, ALADDIN).

Each rank trains its own replica with its own optimizer (LR schedule, momentum, weight decay), pushes what the
optimizer changed to a sharded parameter server co-located on the ranks (:mod:`lightning_sync.comm.ps`), and takes
back global parameters as its method says. Ranks never meet during an epoch: there is no collective per step.
"""

from __future__ import annotations

import sys
from abc import abstractmethod
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_sync.comm.ps import ParameterServer
from lightning_sync.comm.work import WorkCounter
from lightning_sync.core.ps import ShardPlan, ShardServer
from lightning_sync.core.validation import check_int
from lightning_sync.data.dynamic import dynamic_loader
from lightning_sync.strategies.base import SyncStrategy
from lightning_sync.strategies.lr_pace import GlobalPaceScheduler, paced_steps


class ParameterServerStrategy(SyncStrategy):
    """Base of :class:`ASPStrategy`, :class:`SSPStrategy` and :class:`ALADDINStrategy`.

    * **Server**: the flat vector of parameters and floating buffers is cut into shards of at most ``shard_size``
      elements spread over the ranks (memory-wise sharding, ALADDIN §3.3); every rank runs server threads for its
      shards, over gloo point-to-point on CPU tensors, one process group per direction.
    * **Worker**: after its own optimizer step a rank pushes its delta ``x_after − x_before`` (what its optimizer
      did, so any optimizer works) to every server and takes global parameters back per its method
      (:meth:`_exchange`).
    * **Dynamic work assignment**: within an epoch every rank draws the next batch of one global, per-epoch shuffled
      order from a counter shared through a ``TCPStore`` (:class:`~lightning_sync.data.DynamicBatchSampler`), so a
      faster rank processes more batches and the epoch ends on every rank when the data is consumed. The training
      loader therefore has no length (Lightning validates at the end of each epoch).
    * **Meeting points**: ranks meet once per epoch when their data runs out (SIGTERM is checked there: a signal
      on any rank ends the epoch on all of them, then stops all together), and at validation, checkpoints and
      the end of fit. Each meeting flushes every rank's pushes, so **validation, checkpoints and the model fit hands
      back see the global model** (the servers' parameters); each rank's own replica and optimizer state are kept
      beside the checkpoint and restored on resume with the server state and clocks.

    Lightning features that would make ranks at different step counts meet are rejected at setup with the reason:
    ``val_check_interval`` other than 1.0 or ``check_val_every_n_epoch=None``, ``ModelCheckpoint`` every N training
    steps or every time interval, ``max_time`` / a step-interval ``Timer``, fractional ``limit_train_batches``;
    and at run time, a collective Lightning would issue inside a training batch raises, saying why — except the
    reduction of ``self.log(..., sync_dist=True)`` for the step's value, one of the most common lines in Lightning
    code: it logs this rank's own value (what a rank can honestly log without meeting the others) with a one-time
    warning per metric naming ``on_epoch=True`` for a global value (reduced at the epoch end, where ranks meet).
    ``EarlyStopping`` and
    epoch-based ``ModelCheckpoint`` work. ``injection`` and :class:`~lightning_sync.callbacks.SelDP` are not
    available (batches come from the shared order). Nor are replica groups (``replica_size``): the ranks of a
    replica would push and pull at their own pace, never in lockstep.

    With ``compression`` the pushes carry the delta in the wire format (int8, int4, int2: with error feedback per
    server) and the pulls the global parameters rounded to it; the servers' own parameters stay exact
    (:mod:`lightning_sync.comm.ps`).

    Args:
        shard_size: largest shard, in elements (>= 1). Default 2**22 (16 MiB of float32).
        lr_pace: how a step-interval LR scheduler advances: ``"global"`` (default) to the step DDP's schedule is at
            after the batches all ranks consumed (a fast rank, which takes more than its share, does not run its
            schedule ahead of the training; :mod:`lightning_sync.strategies.lr_pace`), or ``"local"``, one step per
            optimizer step of this rank (Lightning's own).
    """

    mode: ClassVar[str] = "asp"
    replicas_diverge = True
    carries_sigterm = True
    fault_tolerance_refusal = (
        "the parameter server shards the model over fixed ranks that serve one another point to point at any "
        "time, not at syncs a quorum could precede; use local SGD or DiLoCo"
    )
    supports_accumulation = True
    averages_for_eval = False  # validation and checkpoints swap in the servers' global model instead
    replica_groups_refusal = (
        "every rank is an asynchronous worker of the sharded parameter server, pushing its own update and taking "
        "back the global parameters at its own pace (batches claimed from a shared counter), so the ranks of a "
        "replica would neither step in lockstep nor stay identical, which exact data parallelism inside a replica "
        "needs."
    )
    sharded_refusal = (
        "every rank is an asynchronous worker of the parameter server, pushing its own update and taking back the "
        "global parameters at its own pace, while the ranks of a sharded replica must run FSDP2's all-gathers and "
        "reduce-scatters in lockstep at every forward and backward; and the server's shards are ranges of the whole "
        "model, which no rank of a sharded replica holds. For sharded replicas use a synchronous method "
        "(BSPStrategy, or local SGD / DiLoCo for infrequent syncs)."
    )

    def __init__(self, shard_size: int = 1 << 22, lr_pace: str = "global", **kwargs: Any) -> None:
        self.shard_size = check_int("shard_size", shard_size, 1)
        if lr_pace not in ("global", "local"):
            raise ValueError(
                f"lr_pace must be 'global' (a step-interval LR schedule follows the batches all ranks consumed) or "
                f"'local' (each rank's own step count), got {lr_pace!r}"
            )
        self.lr_pace = lr_pace
        if kwargs.get("injection") is not None:
            raise ValueError(
                f"injection must be None for {type(self).__name__}: with dynamic work assignment every rank draws "
                "batches from one shared order, so there is no per-rank partition to inject into. Use injection with "
                "BSP, SelSync, local SGD, FedAvg, ADPSGD or OSP."
            )
        super().__init__(**kwargs)
        self._ps: ParameterServer | None = None
        self._work: WorkCounter | None = None
        self._prev: Tensor | None = None
        self._delta: Tensor | None = None
        self._host: Tensor | None = None
        self._replica: Tensor | None = None
        self._pending_ps_state: dict[str, Any] | None = None
        self._sigterm_seen = False
        self._warned_local_logs: set[str] = set()
        self.exhausted_epochs = 0
        self._first_claimed: int | None = None  # the last epoch whose first batch (position = rank) was handed out
        self._resume_epoch: int | None = None  # after a resume: the epoch the first training iteration trains
        #: the training loader's sampler (its ``positions``: the current iteration's batch positions, in the order
        #: they are yielded), the batches all ranks train in an epoch, and the step a global-pace LR schedule is at
        #: after the batch in training (lightning_sync.strategies.lr_pace)
        self._sampler: Any = None
        self._epoch_batches = 0
        self._pace_target: int | None = None
        #: after fit: this rank's final server and worker counters (pushes, parameters received, SSP clock log, ...)
        self.server_summary: dict[str, Any] = {}

    # ------------------------------------------------------------------ setup checks
    def _check_supported(self, trainer: pl.Trainer) -> None:
        super()._check_supported(trainer)
        name = type(self).__name__
        why = f"{name} lets ranks run different numbers of steps, so they only meet at the end of an epoch"
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.val_check_interval != 1.0 or trainer.check_val_every_n_epoch is None:
            raise ValueError(
                f"{name} does not support val_check_interval={trainer.val_check_interval!r} with "
                f"check_val_every_n_epoch={trainer.check_val_every_n_epoch!r}: {why}. Validate at the end of "
                "epochs (val_check_interval=1.0, check_val_every_n_epoch=N)."
            )
        limit = trainer.limit_train_batches
        if isinstance(limit, float) and limit != 1.0:
            raise ValueError(
                f"{name} does not support a fractional limit_train_batches={limit}: the training loader is drawn "
                "dynamically and has no length. Use an integer (batches per rank) or a smaller dataset."
            )
        for cb in trainer.callbacks:
            if isinstance(cb, ModelCheckpoint) and (cb._every_n_train_steps or cb._train_time_interval is not None):
                raise ValueError(
                    f"{name} does not support ModelCheckpoint(every_n_train_steps=..., train_time_interval=...): "
                    f"{why}, and a checkpoint is a collective. Use ModelCheckpoint(every_n_epochs=N) (the default)."
                )
            if isinstance(cb, Timer) and cb._interval == "step":
                raise ValueError(
                    f"{name} does not support max_time or Timer(interval='step'): the timer's stop decision is a "
                    f"collective every step, and {why}. Use Timer(interval='epoch') or max_epochs/max_steps."
                )

    def add_dataloader_transform(self, transform: Any) -> None:
        raise ValueError(
            f"{type(self).__name__} assigns batches dynamically from one shared order; a sampler transform such as "
            "SelDP cannot apply. Use SelDP with BSP or SelSync."
        )

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING and self._work is not None:
            dataloader = dynamic_loader(dataloader, claim=self._claim, on_exhausted=self._on_exhausted)
            # Lightning creates the iterator (and prefetches, claiming a position) before its first set_epoch; a
            # run resumed from an epoch-end checkpoint must start in the epoch it resumes (its shuffle, its counter)
            epoch = trainer.fit_loop.epoch_progress.current.processed
            if self._resume_epoch is not None:
                # Lightning builds and prefetches this iterator when estimated_stepping_batches is first read (e.g. in
                # configure_optimizers), before a resumed run restores its loops: the epoch count is then still 0,
                # and the resumed epoch would draw epoch 0's shuffle and counter and end with finish_epoch(0) while
                # its pushes carry the trainer's epoch (SSP then holds a rank back for a worker it thinks still
                # trains: a hang). This rank's restored count of finished epochs is the epoch it resumes.
                epoch, self._resume_epoch = max(epoch, self._resume_epoch), None
            dataloader.batch_sampler.set_epoch(epoch)
            self._sampler = dataloader.batch_sampler
            self._epoch_batches = self._batches_per_epoch(trainer, dataloader.batch_sampler.num_batches)
            if dataloader.batch_sampler.num_batches < self.world_size:
                raise ValueError(
                    f"{type(self).__name__} gives every rank at least one batch of each epoch, and this training "
                    f"loader has {dataloader.batch_sampler.num_batches} batches for {self.world_size} ranks: a rank "
                    "without "
                    "a batch would skip the epoch's validation while the others run it. Use a smaller batch size or "
                    "more data (at least one batch per rank), or fewer ranks."
                )
        return dataloader

    def _batches_per_epoch(self, trainer: pl.Trainer, num_batches: int) -> int:
        """Batches all ranks train in an epoch: the loader's, or ``world_size * limit_train_batches`` if fewer."""
        limit = trainer.limit_train_batches
        return min(num_batches, self.world_size * limit) if isinstance(limit, int) else num_batches

    # ------------------------------------------------------------------ the learning-rate schedule's pace
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self.lr_pace != "global":
            return
        for config in self.lr_scheduler_configs:
            if config.interval == "step" and not isinstance(config.scheduler, GlobalPaceScheduler):
                config.scheduler = GlobalPaceScheduler(config.scheduler, lambda: self._pace_target)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        # the batch_idx-th batch of this epoch's iteration is the one its sampler yielded batch_idx-th (an iterator
        # Lightning built and dropped, e.g. to estimate the stepping batches, took claims of its own: a new
        # iteration starts a new list)
        positions = self._sampler.positions if self._sampler is not None else []
        if batch_idx >= len(positions):
            self._pace_target = None  # not a batch of the dynamic loader: one step, as Lightning's own
            return
        trainer = self.lightning_module.trainer
        self._pace_target = paced_steps(
            trainer.current_epoch * self._epoch_batches,
            positions[batch_idx],
            self.world_size,
            trainer.accumulate_grad_batches,
        )

    def _claim(self, epoch: int) -> int:
        """The global batch position this rank trains next (subclasses may assign positions differently).

        A rank's first batch of an epoch is its own, position ``rank``; the positions after the first
        ``world_size`` are claimed from the shared counter. Claimed from the start, a rank that began its epoch late
        (a slow DataLoader worker start, a loaded machine) could find every position taken and train no batch at
        all: Lightning then never reaches that rank's last batch, so it skips the epoch-end validation the others
        run, and the ranks meet in different collectives (a hang found by benchmarks/fork_stress.py, issue 61)."""
        assert self._work is not None
        if self._first_claimed != epoch:
            self._first_claimed = epoch
            self._work.own(epoch)
            return self.global_rank
        return self.world_size + self._work.claim(epoch)

    def _on_exhausted(self, epoch: int) -> None:
        """This rank found the epoch's data consumed: stop holding SSP back, then meet the other ranks (they all
        reach this point once the shared counter is past the end) and stop together on SIGTERM."""
        self.exhausted_epochs += 1
        assert self._ps is not None
        self._ps.finish_epoch(epoch)
        self.sigterm.check()  # the base's counted all-reduce of every rank's flag; raises on all ranks together

    # ------------------------------------------------------------------ server lifecycle
    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.cluster_environment is not None
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn == TrainerFn.FITTING:
            # only for a fit, closed at its end: its store (and the store's thread on rank 0) lives no longer
            self._work = WorkCounter(
                self.comm, self.cluster_environment.main_address, self.comm_stats, timeout=self._wait_timeout
            )

    def _on_flat_ready(self) -> None:
        tensors = self.flat.state_tensors()
        if len(tensors) != 1:
            raise ValueError(
                f"{type(self).__name__} serves one flat vector of one dtype on one device; this model's parameters "
                f"and floating buffers form {len(tensors)} groups ({[(t.dtype, t.device.type) for t in tensors]}). "
                "Cast the module to a single dtype (precision plugins such as bf16-mixed keep float32 weights)."
            )
        state = tensors[0]
        self._host = state if state.device.type == "cpu" else torch.empty(state.numel(), dtype=state.dtype)
        if self._host is not state:
            self._host.copy_(state)
        plan = ShardPlan(state.numel(), self.world_size, self.shard_size)
        server = ShardServer(plan.gather(self._host, self.global_rank), self.world_size, **self._server_kwargs())
        self._ps = ParameterServer(
            plan,
            server,
            self.comm_stats,
            self.link,
            timeout=self._wait_timeout,
            dtype=state.dtype,
            compressor=self.compressor,
        )
        if self._pending_ps_state is not None:
            self._ps.load_state_dict(self._pending_ps_state)
            self._pending_ps_state = None
        self._prev = state.detach().clone()
        self._delta = torch.empty_like(state)

    def _server_kwargs(self) -> dict[str, Any]:
        return {"mode": self.mode}

    def _averages_state(self) -> bool:
        return False  # replicas meet through the servers (pushes and pulls), never through a parameter average

    @property
    def ps(self) -> ParameterServer:
        if self._ps is None:
            raise RuntimeError(f"{type(self).__name__} has no parameter server before setup() while fitting")
        return self._ps

    @property
    def _wait_timeout(self) -> timedelta:
        return self._timeout if self._timeout is not None else default_pg_timeout

    # ------------------------------------------------------------------ the step
    def _after_update(self, optimizer: Optimizer) -> None:
        state = self.flat.state_tensors()[0]
        assert self._prev is not None and self._delta is not None and self._host is not None
        torch.sub(state, self._prev, out=self._delta)
        scale = self._push_scale()
        if scale != 1.0:
            self._delta.mul_(scale)
        delta = self._delta if self._delta.device.type == "cpu" else self._delta.cpu()
        epoch = self.lightning_module.trainer.current_epoch
        synced = self._exchange(delta, epoch)
        self._prev.copy_(state)
        self.step_counter.record(synced)
        if self.sigterm.flag() and not self._sigterm_seen and self._work is not None:
            self._sigterm_seen = True
            self._work.exhaust(epoch)  # every rank's epoch ends at its next claim; they stop at the meeting

    def _push_scale(self) -> float:
        """The factor this step's update is multiplied by before it is pushed (ASP and SSP scale by 1/m; ALADDIN's
        servers weight updates 1/n themselves)."""
        return 1.0

    @abstractmethod
    def _exchange(self, delta: Tensor, epoch: int) -> bool:
        """Push ``delta`` and take global parameters per the method; return whether any arrived this step."""

    def _take(self, alpha: float | None = None) -> bool:
        """Apply the replies that arrived (replace, or mix with α) to this rank's replica."""
        state = self.flat.state_tensors()[0]
        assert self._host is not None
        if not self.ps.has_params():
            return False
        if self._host is not state:
            self._host.copy_(state)
        applied = self.ps.take_params(self._host, alpha=alpha)
        if applied and self._host is not state:
            state.copy_(self._host)
        return bool(applied)

    # ------------------------------------------------------------------ the global model at meeting points
    def _gather_global(self, tag: str) -> Tensor:
        """Flush every rank's pushes, meet, and all-gather the servers' parameters (a collective)."""
        state = self.flat.state_tensors()[0]
        out = torch.empty(state.numel(), dtype=state.dtype)
        self.ps.flush()
        self.comm.barrier(tag=tag)
        return self.ps.global_params(self.comm, out, tag=tag)

    def _swap_in_global(self, tag: str) -> None:
        state = self.flat.state_tensors()[0]
        global_ = self._gather_global(tag)
        self._replica = state.detach().clone()
        state.copy_(global_)

    def _swap_back(self) -> None:
        if self._replica is not None:
            self.flat.state_tensors()[0].copy_(self._replica)
            self._replica = None

    def _fitting(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return self._ps is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING

    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self._fitting():
            self._swap_in_global("global")

    def on_validation_end(self) -> None:
        if self._fitting():
            self._swap_back()
        super().on_validation_end()

    def on_train_end(self) -> None:
        if self._ps is not None:
            state = self.flat.state_tensors()[0]
            state.copy_(self._gather_global("final"))  # fit hands back the global model
            self._prev = None
            self._ps.close(self.comm)
            self.server_summary = {
                "pushes": self._ps.pushes,
                "params_received": dict(self._ps.params_received),
                "clocks": list(self._ps.server.clocks),
                "replies": list(self._ps.server.replies),
                "global_updates": self._ps.server.global_updates,
                "pull_log": list(self._ps.server.pull_log),
                "batches_claimed": dict(self._work.claims) if self._work is not None else {},
            }
        self._close_work()
        super().on_train_end()

    def _close_work(self) -> None:
        """The work counter's store (and its thread on rank 0) ends with the fit; the claims stay readable."""
        if self._work is not None:
            self._work.close()

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # the failure report first: the peers read it when this rank's goodbye arrives
        if self._ps is not None:
            self._ps.abandon()

    # ------------------------------------------------------------------ checkpoints
    def _main_file_checkpoint(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The main checkpoint file holds the global model; each rank's replica goes to its part."""
        if self._ps is None or self._ps._closed:
            return checkpoint
        self._swap_in_global("checkpoint")
        try:
            global_sd = {k: v.detach().clone() for k, v in self.lightning_module_state_dict().items()}
        finally:
            self._swap_back()
        return {**checkpoint, "state_dict": global_sd}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._ps is not None and not self._ps._closed:
            self._ps.flush()  # the server state in every part includes every push made before the checkpoint
            self.comm.barrier(tag="checkpoint")
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def strategy_state(self) -> dict[str, Any]:
        # real work on restore: the server state goes into the servers, or waits for them to start; the exhausted
        # epochs set the epoch the data resumes at
        state = super().strategy_state()
        state["ps"] = self.ps.state_dict()
        state["exhausted_epochs"] = self.exhausted_epochs
        return state

    def load_strategy_state(self, state: dict[str, Any]) -> None:
        super().load_strategy_state(state)
        self.exhausted_epochs = int(state.get("exhausted_epochs", 0))
        self._resume_epoch = self.exhausted_epochs
        if self._ps is not None:
            self._ps.load_state_dict(state["ps"])
        else:
            self._pending_ps_state = state["ps"]

    def batches_claimed(self, epoch: int) -> int:
        """Batches this rank claimed in ``epoch`` (including the one claim that found the data consumed)."""
        return self._work.claims.get(epoch, 0) if self._work is not None else 0

    # ------------------------------------------------------------------ metrics
    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        if self._ps is not None:
            metrics["ps_pushes"] = float(self._ps.pushes)
            metrics["ps_params_received"] = float(sum(self._ps.params_received.values()))
        if self._work is not None and self.lightning_module is not None:
            metrics["batches_claimed"] = float(self._work.claims.get(self.lightning_module.trainer.current_epoch, 0))
        return metrics

    # ------------------------------------------------------------------ Lightning's collectives
    def _mid_batch(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._ps is None or trainer is None or not trainer.training:
            return False
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        return progress.ready > progress.completed

    def _refuse_mid_batch(self, what: str) -> None:
        if self._mid_batch():
            raise RuntimeError(
                f"{what} inside a training batch with {type(self).__name__}: ranks run different numbers of batches, "
                "so a collective per batch would pair different steps or hang. Log with on_step=False/on_epoch=True or "
                "without sync_dist, and move per-step collectives to epoch ends."
            )

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if self._mid_batch():
            metric = _logged_metric_name()
            if metric is None:
                self._refuse_mid_batch("A collective reduce")
            self._warn_local_log(metric)
            return tensor  # the rank's own value: no collective inside a batch
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def _warn_local_log(self, metric: str) -> None:
        if metric in self._warned_local_logs:
            return
        self._warned_local_logs.add(metric)
        rank_zero_warn(
            f"self.log({metric!r}, ..., sync_dist=True) inside a training batch with {type(self).__name__}: ranks run "
            "different numbers of batches, so the step's value cannot be reduced across them; each rank logs its own "
            f"(the logger shows rank 0's). For a global value log it with on_epoch=True: the epoch's value is reduced "
            "across ranks at the epoch end, where they meet.",
            category=UserWarning,
        )

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_mid_batch("A barrier")
        super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._refuse_mid_batch("A broadcast (e.g. a callback deciding something every step)")
        return super().broadcast(obj, src)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        self._refuse_mid_batch("An all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        if self._ps is not None:
            self._ps.abandon()  # closed cleanly at train end; this is the exception path
            self._ps = None
        if self._work is not None:
            self._work.close()
            self._work = None
        self._prev = self._delta = self._host = self._replica = None
        super().teardown()


def _logged_metric_name() -> str | None:
    """The name of the metric whose per-step value Lightning is reducing, when the reduce comes from
    ``self.log(..., sync_dist=True)`` (Lightning's ``_ResultMetric.update`` calls the strategy's ``reduce`` for the
    step's value); ``None`` for a reduce from anywhere else."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, _ResultMetric) and frame.f_code.co_name == "update":
            return str(owner.meta.name)
        frame = frame.f_back
    return None
