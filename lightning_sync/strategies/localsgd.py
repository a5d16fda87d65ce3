"""Local SGD with constant-period parameter averaging: CPSGD (Jiang & Agrawal, ADPSGD paper, Alg. 1)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from torch.optim import Optimizer

from lightning_sync.core.periodic import ConstantPeriod
from lightning_sync.core.validation import check_int
from lightning_sync.strategies.base import SyncStrategy


class LocalSGDStrategy(SyncStrategy):
    r"""Every rank steps on its own gradients; parameters and buffers are averaged every ``period`` steps.

    Alg. 1 line 5-6: after the local update of step :math:`k` (0-based), average when
    :math:`(k - \text{warmup}) \bmod p = \text{offset}`; during the first ``warmup_steps`` steps average every step
    (the post-local-SGD warm-up). Over :math:`K` steps that is :math:`\min(K, w) + \lceil (K - w - o)/p \rceil`
    averagings (:math:`\lceil K/p \rceil` with neither; the first one right after step 0). ``offset=period - 1``
    averages after every ``period`` local steps instead (steps :math:`p-1, 2p-1, \dots`, as torchft's ``LocalSGD``
    and :class:`~lightning_sync.strategies.diloco.DiLoCoStrategy`): when ``period`` divides the epoch's steps, each
    epoch ends on an averaging, so the validation after it needs no all-reduce (the replicas are identical there)
    and no per-step warm-up is spent lining the schedule up with the epochs.

    ``period=1`` is BSP for SGD with momentum and weight decay, exactly: all replicas start equal, and the SGD update
    :math:`m \leftarrow \mu m + g + \lambda w,\ w \leftarrow w - \eta m` is linear in :math:`(w, m, g)`, so the
    average of the ranks' updated parameters equals the update with the averaged gradient and the averaged momentum
    — and the average of the ranks' momentum buffers obeys BSP's momentum recursion. Parameters are re-averaged
    every step, so they stay equal; momentum buffers are never communicated. (Not so for Adam: its update is
    nonlinear in the gradient; nor with ``gradient_clip_val``: each rank clips its own gradient before its local
    update, where BSP clips the averaged one.)

    Unlike Lightning's ``DDPStrategy(model_averaging_period=...)``, this works on gloo/CPU as on NCCL/GPU, averages
    buffers too, and checkpoints its step counter. SIGTERM is checked at averaging steps only (local steps stay
    free of collectives), so with a long period a signal is acted on at the next averaging.

    With ``average_at_end`` (default) the replicas are averaged once more when training ends (tag ``"final"``, one
    all-reduce), so the model Lightning hands back and later evaluates is the global model, not rank 0's replica
    (with an outer optimizer: its step on the local steps since the last averaging, skipped when there were none).

    Args:
        period: averaging period :math:`p \ge 1` in optimizer steps.
        warmup_steps: steps at the start that average every step (>= 0).
        offset: where in each period the averaging falls, an integer in [0, ``period`` - 1]: 0 (default, Alg. 1)
            averages right after the first step of each period, ``period - 1`` after its last.
        outer_optimizer: ``None`` (plain averaging: every rank takes the mean) or an outer optimizer spec such as
            ``{"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}`` (DiLoCo's): at each averaging the mean
            of the replicas gives the pseudo-gradient :math:`\Delta = \theta_{global} - \text{mean}`, the outer
            optimizer steps :math:`\theta_{global}`, every rank takes it (see
            :meth:`~lightning_sync.strategies.base.SyncStrategy.average_state`); buffers keep the plain mean.
        average_at_end: average once more when training ends (a bool).
        evaluate: what validation during fit and the main checkpoint file hold: ``"average"`` (default: the
            replicas' exact average, one all-reduce of the model per validation) or ``"last_sync"`` (the global model
            of the last sync, kept on every rank: no communication, one model-sized copy per rank; see
            :mod:`~lightning_sync.strategies.evaluation`).
    """

    strategy_name = "localsgd"
    strategy_description = "Local SGD (CPSGD): average parameters every `period` steps"
    carries_sigterm = True
    fault_tolerance_refusal = None

    def __init__(
        self,
        period: int = 8,
        warmup_steps: int = 0,
        offset: int = 0,
        average_at_end: bool = True,
        evaluate: Literal["average", "last_sync"] = "average",
        outer_optimizer: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.period = check_int("period", period, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.offset = check_int("offset", offset, 0, self.period - 1)
        self._averaging_options(outer_optimizer, average_at_end, evaluate)
        super().__init__(**kwargs)
        self.schedule = ConstantPeriod(self.period, self.warmup_steps, self.offset)
        self._step = 0

    def _after_update(self, optimizer: Optimizer) -> None:
        synced = self.schedule.should_average(self._step)
        self._step += 1
        if synced:
            self.average_state(tag="params")
            self._check_sigterm()
        self.step_counter.record(synced)

    def _ft_next_step_syncs(self) -> bool:
        return self.schedule.should_average(self._step)

    def _ft_method_config(self) -> dict[str, Any]:
        return {
            **super()._ft_method_config(),
            "period": self.period,
            "warmup_steps": self.warmup_steps,
            "offset": self.offset,
        }

    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        metrics["period"] = float(self.period)
        return metrics

    def strategy_state(self) -> dict[str, Any]:
        state = super().strategy_state()
        state["step"] = self._step
        return state

    def load_strategy_state(self, state: dict[str, Any]) -> None:
        super().load_strategy_state(state)
        self._step = int(state["step"])
