"""SSP (stale synchronous parallel) on the sharded parameter server (Sync-Switch §II-B, SelSync §II-C)."""

from __future__ import annotations

from typing import Any

from lightning_sync.core.validation import check_int
from lightning_sync.strategies.asp import ASPStrategy


class SSPStrategy(ASPStrategy):
    """ASP with bounded staleness: a worker whose clock (pushes so far) is more than ``staleness`` ahead of the
    slowest worker still training in its epoch blocks at its pull until that worker catches up. The servers keep
    the clocks (every server sees every push) and hold back the reply; ``staleness=0`` is lockstep progress through
    the servers. A rank that has consumed its epoch's data stops holding others back for that epoch.

    Args:
        staleness: the bound s >= 0 on how many steps a worker may run ahead of the slowest.
    """

    strategy_name = "ssp"
    strategy_description = "SSP: parameter server with bounded staleness"
    mode = "ssp"

    def __init__(self, staleness: int = 4, **kwargs: Any) -> None:
        self.staleness = check_int("staleness", staleness, 0)
        super().__init__(**kwargs)

    def _server_kwargs(self) -> dict[str, Any]:
        return {"mode": self.mode, "staleness": self.staleness}

    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        metrics["staleness"] = float(self.staleness)
        return metrics
