"""Lightning's per-step SIGTERM check, made a counted collective that listens to every rank.

Lightning 2.6 broadcasts rank 0's SIGTERM flag at the start of every training step
(``_TrainingEpochLoop._broadcast_sigterm_tensor``), straight through ``torch.distributed``: uncounted, not
link-emulated, and deaf to a signal on any other rank. :class:`SigtermCheck` replaces it with one 4-byte all-reduce
(max) after the update, through the communicator; methods that communicate every step fold the flag into their own
collective instead (``carries_sigterm``), and periodic methods check only at their sync points.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor


class SigtermCheck:
    """Mixin of :class:`~lightning_sync.strategies.SyncStrategy`."""

    _sigterm_buf: Tensor | None

    def _route_sigterm_check(self: Any) -> None:
        """At train start: route Lightning's per-step check through this strategy (see the module docstring)."""
        loop = self.lightning_module.trainer.fit_loop.epoch_loop
        if hasattr(loop, "_broadcast_sigterm_tensor"):
            loop._broadcast_sigterm_tensor = self._sigterm_step

    def _restore_sigterm_check(self: Any) -> None:
        loop = self.lightning_module.trainer.fit_loop.epoch_loop
        loop.__dict__.pop("_broadcast_sigterm_tensor", None)

    def _sigterm_flag(self) -> float:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return 1.0 if trainer is not None and getattr(trainer, "received_sigterm", False) else 0.0

    def _sigterm_step(self) -> None:
        """Replaces Lightning's check at the start of the step; the check runs after the update instead
        (:meth:`_check_sigterm`), where a flag raised during this step still reaches every rank before any rank
        leaves the loop at the end of the batch."""

    def _check_sigterm(self) -> None:
        """Stop every rank together when any rank received SIGTERM (Lightning's version listens to rank 0 only)."""
        if self._sigterm_buf is None:
            self._sigterm_buf = torch.zeros(1, device=self._comm_device())
        flag = self._sigterm_buf
        flag.fill_(self._sigterm_flag())
        self.comm.all_reduce(flag, op="max", tag="lightning")
        if flag.item() > 0:
            raise SIGTERMException()
