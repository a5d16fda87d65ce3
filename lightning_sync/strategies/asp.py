"""ASP (asynchronous parallel, Hogwild-style) on the sharded parameter server (Sync-Switch §II-B, SelSync §II-C)."""

from __future__ import annotations

from torch import Tensor

from lightning_sync.strategies.ps import ParameterServerStrategy


class ASPStrategy(ParameterServerStrategy):
    """After each local optimizer step a worker pushes its delta to the servers, which add it to the global
    parameters as it arrives, and pulls the fresh global parameters, which replace its replica. A worker waits for
    the servers' round trip, never for another worker: ranks run at their own pace.

    Optimizer-agnostic: each rank's own optimizer, LR schedule and momentum produce the delta (for SGD, −η·g, so the
    servers apply x̃ ← x̃ − η·g per push as in Hogwild); momentum buffers stay local. With N workers the global model
    takes N workers' updates per round, so an SGD learning rate tuned for one worker may need scaling down.
    See :class:`~lightning_sync.strategies.ps.ParameterServerStrategy` for sharding, work assignment, checkpoints
    and what Lightning features are supported.
    """

    strategy_name = "asp"
    strategy_description = "ASP: asynchronous push/pull on a sharded parameter server"
    mode = "asp"

    def _exchange(self, delta: Tensor, epoch: int) -> bool:
        self.ps.push(delta, epoch, want_reply=True, wait=True)
        self.ps.wait_params()
        return self._take()
