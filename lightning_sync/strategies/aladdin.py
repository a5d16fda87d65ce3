"""ALADDIN: asymmetric centralized training (``aladdin.md`` Alg. 1-2, §3.2-3.3)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_sync.core.ps import aladdin_alpha, check_alpha
from lightning_sync.core.validation import check_int
from lightning_sync.strategies.ps import ParameterServerStrategy


class ALADDINStrategy(ParameterServerStrategy):
    """Workers never wait: every step a worker applies its own update (local self-update, Alg. 1 line 3) and sends
    it to the servers without waiting for anything back (line 4, asymmetric). The servers accumulate the deltas and
    apply them lazily, with weight 1/n so the global model is the workers' average (Alg. 2 lines 6, 8; Lemma 1; see
    :class:`~lightning_sync.core.ps.ShardServer`), when a worker's ``period``-th push since its last update arrives,
    and then send that worker the global parameters (line 10); the worker mixes them in,
    x ← (1 − α)·x + α·x̃ (Eq. 3, Alg. 1 line 6), at the first step after they arrive, checked without blocking.

    The sends of one step are still in flight during the next step's compute; the next push waits for them (a
    server that cannot keep up slows its workers down, as a real one would).

    Args:
        period: π >= 1, pushes of a worker between the global parameters it receives.
        alpha: the weight of the global parameters: ``None`` (default) for α = 1 − 1/√(nπ) (§3.2), a number in
            (0, 1], or ``"per_push"`` for the α_i = 1 − 1/√c̃ each server sends with the parameters (Alg. 2 line 9,
            c̃ = pushes it accumulated since its last global update).
        aggregate: how the servers apply accumulated updates: ``"mean"`` (default; weight 1/n, the global model is the
            workers' average, Lemma 1) or ``"sum"`` (Alg. 2 line 8 as printed).
    """

    strategy_name = "aladdin"
    strategy_description = "ALADDIN: asymmetric parameter server (wait-free workers, lazy global update)"
    mode = "aladdin"

    def __init__(
        self, period: int = 4, alpha: float | str | None = None, aggregate: str = "mean", **kwargs: Any
    ) -> None:
        self.period = check_int("period", period, 1)
        self.alpha = check_alpha(alpha)
        if aggregate not in ("mean", "sum"):
            raise ValueError(f"aggregate must be 'mean' (weight 1/n) or 'sum' (Alg. 2 as printed), got {aggregate!r}")
        self.aggregate = aggregate
        super().__init__(**kwargs)
        self.alpha_value: float | None = None  # resolved at setup (needs the world size)

    def _server_kwargs(self) -> dict[str, Any]:
        return {"mode": self.mode, "period": self.period, "aggregate": self.aggregate}

    def _on_flat_ready(self) -> None:
        super()._on_flat_ready()
        if self.alpha is None:
            self.alpha_value = aladdin_alpha(self.world_size, self.period)
        elif isinstance(self.alpha, float):
            self.alpha_value = self.alpha
        else:
            self.alpha_value = None  # per push: the server's α_i

    def _exchange(self, delta: Tensor, epoch: int) -> bool:
        self.ps.push(delta, epoch, want_reply=False, wait=False)
        return self._take(alpha=self.alpha_value)

    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        metrics["period"] = float(self.period)
        if self.alpha_value is not None:
            metrics["alpha"] = self.alpha_value
        return metrics
