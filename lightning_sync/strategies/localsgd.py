"""Local SGD with constant-period parameter averaging: CPSGD (Jiang & Agrawal, ADPSGD paper, Alg. 1)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from torch.optim import Optimizer

from lightning_sync.core.periodic import ConstantPeriod
from lightning_sync.core.validation import check_int
from lightning_sync.strategies.periodic import PeriodicAveraging


class LocalSGDStrategy(PeriodicAveraging):
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
    buffers too, and checkpoints its step counter. SIGTERM is checked at averaging steps only, and with
    ``average_at_end`` the replicas are averaged once more at the end
    (:class:`~lightning_sync.strategies.periodic.PeriodicAveraging`).

    Args:
        period: averaging period :math:`p \ge 1` in optimizer steps.
        warmup_steps: steps at the start that average every step (>= 0).
        offset: where in each period the averaging falls, an integer in [0, ``period`` - 1]: 0 (default, Alg. 1)
            averages right after the first step of each period, ``period - 1`` after its last.
        average_at_end, evaluate, outer_optimizer: the periodic family's, see
            :class:`~lightning_sync.strategies.periodic.PeriodicAveraging`.
    """

    strategy_name = "localsgd"
    strategy_description = "Local SGD (CPSGD): average parameters every `period` steps"
    sharded_refusal = None
    #: sharded replica groups run fault-tolerant: a torchft Manager per rank, each shard averaged over its quorum
    sharded_fault_tolerance_refusal = None
    ft_config_fields = ("period", "warmup_steps", "offset")
    state_fields = ("_step",)

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
        super().__init__(average_at_end=average_at_end, evaluate=evaluate, outer_optimizer=outer_optimizer, **kwargs)
        self.schedule = ConstantPeriod(self.period, self.warmup_steps, self.offset)
        self._step = 0

    def _sync_if_due(self, optimizer: Optimizer) -> bool:
        synced = self.schedule.should_average(self._step)
        self._step += 1
        if synced:
            self.average_state(tag="params")
        return synced

    def _ft_next_step_syncs(self) -> bool:
        return self.schedule.should_average(self._step)

    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        metrics["period"] = float(self.period)
        return metrics
