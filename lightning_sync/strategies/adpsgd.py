"""ADPSGD: adaptive periodic parameter averaging (Jiang & Agrawal, Alg. 2, §III-B, warm-up of §IV-B)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch.optim import Optimizer

from lightning_sync.core.periodic import ADPSGDController, mean_squared_deviation
from lightning_sync.core.validation import check_int, check_real
from lightning_sync.strategies.periodic import PeriodicAveraging


class ADPSGDStrategy(PeriodicAveraging):
    r"""Local SGD whose averaging period adapts so that the replicas' variance before each averaging stays near
    :math:`\gamma_k C_2` (Eq. 16).

    * Warm-up: period 1 for the first ``warmup_epochs`` epochs (§IV-B), no statistic.
    * Then Alg. 2 with :math:`p = p_{init}`: when ``cnt`` reaches :math:`p`, average parameters and buffers (one
      all-reduce), then :math:`S_k = \frac1n \sum_i \|w_i - \bar w\|^2` over the parameters (each rank's squared
      distance to the average, one counted scalar all-reduce, tag ``"stat"``; with replica groups :math:`n` is the
      number of replicas and each replica's distance counts once).
    * Sampling phase (``sample_fraction`` of the training steps after the warm-up, and at least ``min_samples``
      averagings): :math:`C_2` = running average of :math:`S_k/\gamma_k`, with :math:`\gamma_k` the optimizer's
      current learning rate (first parameter group), so LR schedules matter as in the paper. The paper's
      :math:`K_s = 0.25K` counts all :math:`K` steps, its warm-up being one epoch of 160; on a run of a few epochs
      that :math:`K_s` falls inside the warm-up and :math:`C_2` would be one sample of :math:`S_k` taken right
      after it, where :math:`S_k` is largest (docs/strategies/adpsgd.md, "Short runs").
    * Afterwards :math:`p \mathrel{+}= 1` if :math:`S_k < \text{low}\,\gamma_k C_2`, :math:`p \mathrel{-}= 1` if
      :math:`S_k > \text{high}\,\gamma_k C_2`, within ``[1, max_period]``.

    Every rank decides from all-reduced values and the shared learning rate only, so all ranks hold the same period.
    Period, :math:`S_k` and :math:`C_2` are logged at every averaging by :class:`~lightning_sync.callbacks.SyncStats`.
    Computing :math:`S_k` keeps one persistent copy of the parameters (allocated once, reused at every averaging).
    SIGTERM is checked at averaging steps only (:class:`~lightning_sync.strategies.periodic.PeriodicAveraging`).

    With an outer optimizer, :math:`S_k` is still the replicas' spread around their mean (measured before the outer
    step), so the period adapts to the same statistic.

    Sharded replicas (``sharded=True``): each rank averages its shard over the ranks of its shard index, and its
    squared distance to the mean covers its shard only, so the replica's is the sum over its shards (one 8-byte
    all-reduce inside the replica, tag ``"intra/stat"``, then the sum over the replicas): every rank of every replica
    observes the same :math:`S_k` and keeps the same period (tested equal to grouped ADPSGD's periods and parameters).

    Args:
        p_init: initial period after warm-up (>= 1, <= max_period).
        warmup_epochs: epochs with period 1 (>= 0).
        sample_fraction: fraction of the training steps after the warm-up used to sample :math:`C_2`, in [0, 1).
        low, high: thresholds of Alg. 2 lines 16 and 18, ``0 < low < high``.
        max_period: upper bound of the period (>= 1).
        min_samples: the sampling phase lasts at least this many averagings (>= 1).
        average_at_end, evaluate, outer_optimizer: the periodic family's, see
            :class:`~lightning_sync.strategies.periodic.PeriodicAveraging`.
    """

    strategy_name = "adpsgd"
    supports_accumulation = False
    strategy_description = "ADPSGD: periodic averaging with an adaptive period (Alg. 2)"
    sharded_refusal = None  # S_k: each shard's deviations summed over the replica's shards (sum_over_model)
    ft_config_fields = ("p_init", "warmup_epochs", "sample_fraction", "low", "high", "max_period", "min_samples")
    state_fields = ("controller",)

    def __init__(
        self,
        p_init: int = 4,
        warmup_epochs: int = 1,
        sample_fraction: float = 0.25,
        low: float = 0.7,
        high: float = 1.3,
        max_period: int = 64,
        min_samples: int = 4,
        average_at_end: bool = True,
        evaluate: Literal["average", "last_sync"] = "average",
        outer_optimizer: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        check_int("warmup_epochs", warmup_epochs, 0)
        check_real("sample_fraction", sample_fraction, 0.0, 1.0, high_open=True)
        # validates p_init, low, high, max_period with the controller's own messages
        ADPSGDController(p_init=p_init, low=low, high=high, max_period=max_period, min_samples=min_samples)
        super().__init__(average_at_end=average_at_end, evaluate=evaluate, outer_optimizer=outer_optimizer, **kwargs)
        self.p_init = p_init
        self.warmup_epochs = warmup_epochs
        self.sample_fraction = float(sample_fraction)
        self.low = float(low)
        self.high = float(high)
        self.max_period = max_period
        self.min_samples = min_samples
        self.controller: ADPSGDController | None = None
        self._scratch: list[torch.Tensor] | None = None

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        steps_per_epoch = trainer.num_training_batches
        total = trainer.estimated_stepping_batches
        if not (math.isfinite(steps_per_epoch) and math.isfinite(total)):
            raise ValueError(
                "ADPSGDStrategy needs the number of training steps (warm-up in epochs, sampling as a fraction of "
                "the total): use a sized training loader and max_epochs or max_steps."
            )
        if self.controller is None:  # else restored from a checkpoint
            warmup = min(self.warmup_epochs * int(steps_per_epoch), int(total))
            self.controller = ADPSGDController(
                p_init=self.p_init,
                warmup_steps=warmup,
                # K_s: the sampling phase is sample_fraction of the steps after the warm-up, not of all steps
                sample_steps=warmup + int(round(self.sample_fraction * (int(total) - warmup))),
                low=self.low,
                high=self.high,
                max_period=self.max_period,
                min_samples=self.min_samples,
            )

    def _sync_if_due(self, optimizer: Optimizer) -> bool:
        assert self.controller is not None
        synced = self.controller.step()
        if synced:
            if self.controller.needs_statistic():
                s_k = self._average_and_measure()
                if s_k is not None:  # None: a fault-tolerant sync that did not commit (no statistic either)
                    self.controller.observe(s_k, float(optimizer.param_groups[0]["lr"]))
            else:
                self.average_state(tag="params")
        return synced

    def _average_and_measure(self) -> float | None:
        """Average, then :math:`S_k` (Alg. 2 lines 10-11) from one scalar all-reduce of squared deviations from the
        mean (measured before an outer optimizer's step, if any).

        Fault-tolerant: :math:`n` is the quorum's replica groups, and the scalar all-reduce runs inside the sync's
        commit, so every group that commits observes the same :math:`S_k` and keeps the same period; a sync that does
        not commit observes nothing (``None``). A group that missed a commit its peers made is behind in torchft's
        step and takes their state, the controller's included, at the next quorum."""
        groups = [g for g in self.flat.groups if g.param_numel]
        if self._scratch is None:
            self._scratch = [torch.empty_like(g.state[: g.param_numel]) for g in groups]
        for buf, g in zip(self._scratch, groups):
            buf.copy_(g.state[: g.param_numel])
        local = torch.zeros(1, dtype=torch.float64, device=self._comm_device())

        def deviation_from_the_mean() -> None:
            for buf, g in zip(self._scratch, groups):
                buf.sub_(g.state[: g.param_numel])
                local.add_(torch.dot(buf, buf).double().to(local.device))
            self.topology.sum_over_model(local, tag="stat")  # sharded: this replica's shards' deviations summed
            # one value per replica, over the replicas (fault-tolerant: over the quorum, committed with the average)
            self.topology.all_reduce(local, op="sum", tag="stat")

        members = self.topology.members()
        if not self.average_state(tag="params", on_mean=deviation_from_the_mean):
            return None
        return mean_squared_deviation(float(local.item()), members)

    def _ft_next_step_syncs(self) -> bool:
        return self.controller is not None and self.controller.averages_next()

    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        if self.controller is not None:
            metrics["period"] = float(self.controller.period)
        return metrics

    def sync_event_metrics(self) -> dict[str, float]:
        c = self.controller
        if c is None:
            return {}
        out = {"period": float(c.period), "c2": float(c.c2)}
        if c.last_s is not None:
            out["s_k"] = float(c.last_s)
        return out

    def _new_controller(self) -> ADPSGDController:
        """The controller a checkpoint's is restored into (its warm-up and sampling steps come from the checkpoint)."""
        return ADPSGDController(
            p_init=self.p_init, low=self.low, high=self.high, max_period=self.max_period, min_samples=self.min_samples
        )
