"""ASP (asynchronous parallel, Hogwild-style) on the sharded parameter server (Sync-Switch §II-B, SelSync §II-C)."""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_sync.core.ps import update_scale_for, warmup_factor, worker_momentum_for
from lightning_sync.core.validation import check_int
from lightning_sync.strategies.param_groups import for_the_step
from lightning_sync.strategies.ps import ParameterServerStrategy


class ASPStrategy(ParameterServerStrategy):
    r"""After each local optimizer step a worker pushes its (scaled) delta to the servers, which add it to the global
    parameters as it arrives, and pulls the fresh global parameters, which replace its replica. A worker waits for
    the servers' round trip, never for another worker: ranks run at their own pace.

    Optimizer-agnostic: each rank's own optimizer, LR schedule and momentum produce the delta (for SGD, −η·g);
    momentum buffers stay local. **Learning rate**: the rate in the user's optimizer is DDP's (for the average
    gradient of the global batch). With ``update_scale="auto"`` (default) every push is scaled by :math:`1/m`
    (:math:`m` = ranks pushing), so :math:`m` pushes move the global model as one DDP step does — per-sample step
    equivalence, see :func:`~lightning_sync.core.ps.update_scale_for`; the servers apply
    :math:`\tilde x \leftarrow \tilde x - \frac{\eta}{m} g` per push. ``update_scale=1.0`` is the papers' literal ASP
    (Hogwild: each worker's full step), which needs a rate tuned down by about :math:`m`. **Momentum**: asynchrony
    adds its own (Mitliagkas et al. 2016), so with ``worker_momentum="auto"`` (default) each worker's optimizer
    steps with a lower momentum derived from the user's, :math:`1 - \mu_w = (1 - \mu)(m + 1)/2`
    (:func:`~lightning_sync.core.ps.worker_momentum_for`: 0.9 → 0.75 for 4 ranks). It is set on every parameter
    group that has a ``momentum`` entry (SGD, RMSprop) for the optimizer step only and restored afterwards, so
    schedulers, logs of ``param_groups`` and checkpoints see the user's value; optimizers without one (Adam's
    ``betas``) are left as they are. ``worker_momentum=None`` keeps the user's momentum (the behaviour before).
    See :class:`~lightning_sync.strategies.ps.ParameterServerStrategy` for sharding, work assignment, checkpoints
    and what Lightning features are supported.

    Args:
        update_scale: ``"auto"`` (:math:`1/m`) or a number > 0 multiplying every pushed update.
        warmup_steps: pushes over which the scale ramps linearly from 0 (``(k+1)/warmup_steps`` for this rank's
            push ``k``), for the staleness of the first updates; 0 (default) = off.
        worker_momentum: ``"auto"`` (derived from the user's momentum and the number of ranks, above), ``None``
            (the user's momentum unchanged) or a number in ``[0, 1)`` used as the workers' momentum.
        shard_size: largest parameter-server shard, in elements.
    """

    strategy_name = "asp"
    strategy_description = "ASP: asynchronous push/pull on a sharded parameter server"
    mode = "asp"
    state_fields = ("async_pushes",)

    def __init__(
        self,
        update_scale: float | Literal["auto"] = "auto",
        warmup_steps: int = 0,
        worker_momentum: float | Literal["auto"] | None = "auto",
        **kwargs: Any,
    ) -> None:
        update_scale_for(update_scale, 1)  # validates: 'auto' or a number > 0
        worker_momentum_for(worker_momentum, 0.0, 1)  # validates: 'auto', None or a number in [0, 1)
        self.update_scale = update_scale
        self.worker_momentum = worker_momentum
        self._momentum_used: float | None = None  # the first momentum group's value at the last pushing step
        self._momentum_told = False
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        super().__init__(**kwargs)
        #: this rank's pushes in the asynchronous phase (the warm-up's step count; checkpointed)
        self.async_pushes = 0

    def _pushes_this_step(self) -> bool:
        """Whether this step's update is pushed to the servers (Sync-Switch: only in its ASP phase)."""
        return True

    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.worker_momentum is None or not self._pushes_this_step():
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        m = self.world_size
        with for_the_step(optimizer, "momentum", lambda mu: worker_momentum_for(self.worker_momentum, mu, m)) as own:
            if own:
                self._momentum_used = worker_momentum_for(self.worker_momentum, own[0], m)
            elif self.worker_momentum != "auto":
                raise ValueError(
                    f"worker_momentum={self.worker_momentum!r} needs an optimizer with a 'momentum' entry in its "
                    f"parameter groups (SGD, RMSprop); {type(optimizer).__name__} has none: pass worker_momentum=None "
                    "(or 'auto', which leaves such an optimizer as it is)"
                )
            if not self._momentum_told:
                self._momentum_told = True
                rank_zero_info(
                    f"{type(self).__name__}: workers step with momentum {self._momentum_used} (worker_momentum="
                    f"{self.worker_momentum!r}, the user's {own[0]}, {m} ranks pushing)"
                    if own
                    else f"{type(self).__name__}: {type(optimizer).__name__} has no 'momentum' in its parameter "
                    "groups; worker_momentum leaves it as it is"
                )
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _push_scale(self) -> float:
        scale = update_scale_for(self.update_scale, self.world_size) * warmup_factor(
            self.async_pushes, self.warmup_steps
        )
        self.async_pushes += 1
        return scale

    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        metrics["update_scale"] = update_scale_for(self.update_scale, max(1, self.world_size))
        if self._momentum_used is not None:
            metrics["worker_momentum"] = self._momentum_used
        return metrics

    def _exchange(self, delta: Tensor, epoch: int) -> bool:
        self.ps.push(delta, epoch, want_reply=True, wait=True)
        self.ps.wait_params()
        return self._take()
