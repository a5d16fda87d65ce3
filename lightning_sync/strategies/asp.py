"""ASP (asynchronous parallel, Hogwild-style) on the sharded parameter server (Sync-Switch §II-B, SelSync §II-C)."""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor

from lightning_sync.core.ps import update_scale_for, warmup_factor
from lightning_sync.core.validation import check_int
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
    (Hogwild: each worker's full step), which needs a rate tuned down by about :math:`m`.
    See :class:`~lightning_sync.strategies.ps.ParameterServerStrategy` for sharding, work assignment, checkpoints
    and what Lightning features are supported.

    Args:
        update_scale: ``"auto"`` (:math:`1/m`) or a number > 0 multiplying every pushed update.
        warmup_steps: pushes over which the scale ramps linearly from 0 (``(k+1)/warmup_steps`` for this rank's
            push ``k``), for the staleness of the first updates; 0 (default) = off.
        shard_size: largest parameter-server shard, in elements.
    """

    strategy_name = "asp"
    strategy_description = "ASP: asynchronous push/pull on a sharded parameter server"
    mode = "asp"

    def __init__(self, update_scale: float | Literal["auto"] = "auto", warmup_steps: int = 0, **kwargs: Any) -> None:
        update_scale_for(update_scale, 1)  # validates: 'auto' or a number > 0
        self.update_scale = update_scale
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        super().__init__(**kwargs)
        #: this rank's pushes in the asynchronous phase (the warm-up's step count; checkpointed)
        self.async_pushes = 0

    def _push_scale(self) -> float:
        scale = update_scale_for(self.update_scale, self.world_size) * warmup_factor(
            self.async_pushes, self.warmup_steps
        )
        self.async_pushes += 1
        return scale

    def strategy_state(self) -> dict[str, Any]:
        state = super().strategy_state()
        state["async_pushes"] = self.async_pushes
        return state

    def load_strategy_state(self, state: dict[str, Any]) -> None:
        super().load_strategy_state(state)
        self.async_pushes = int(state.get("async_pushes", 0))

    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        metrics["update_scale"] = update_scale_for(self.update_scale, max(1, self.world_size))
        return metrics

    def _exchange(self, delta: Tensor, epoch: int) -> bool:
        self.ps.push(delta, epoch, want_reply=True, wait=True)
        self.ps.wait_params()
        return self._take()
