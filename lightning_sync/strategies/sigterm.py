"""Lightning's per-step SIGTERM check, made a counted collective that listens to every rank.

Lightning 2.6 broadcasts rank 0's SIGTERM flag at the start of every training step
(``_TrainingEpochLoop._broadcast_sigterm_tensor``), straight through ``torch.distributed``: uncounted, not
link-emulated, and deaf to a signal on any other rank. :class:`SigtermCheck`, a component every
:class:`~lightning_sync.strategies.SyncStrategy` owns (``strategy.sigterm``), replaces it with one 4-byte all-reduce
(max) after the update, through the communicator (:meth:`SigtermCheck.check`); methods that communicate every step
fold :meth:`SigtermCheck.flag` into their own collective instead (``carries_sigterm``: SelSync's vote, which may
hold this rank's flag back from Lightning until a vote carries it, :meth:`SigtermCheck.defer`), and periodic methods
call :meth:`SigtermCheck.check` at their sync points only.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor

from lightning_sync.comm import Communicator


class SigtermHost(Protocol):
    """What :class:`SigtermCheck` uses of the strategy that owns it."""

    comm: Communicator
    lightning_module: Any

    def _comm_device(self) -> torch.device: ...


class SigtermCheck:
    """Every rank stops together when any rank received SIGTERM (see the module docstring). The strategy's
    ``on_train_start`` calls :meth:`route`, ``on_train_end`` :meth:`restore`."""

    def __init__(self, strategy: SigtermHost) -> None:
        self.strategy = strategy
        self._buf: Tensor | None = None
        #: this rank's SIGTERM, taken from Lightning until a collective that carries it is read (:meth:`defer`)
        self.deferred = False

    def _trainer(self) -> Any:
        module = self.strategy.lightning_module
        return module.trainer if module is not None else None

    def route(self) -> None:
        """At train start: route Lightning's per-step check through this component (see the module docstring)."""
        loop = self._trainer().fit_loop.epoch_loop
        if hasattr(loop, "_broadcast_sigterm_tensor"):
            loop._broadcast_sigterm_tensor = self._skip

    def restore(self) -> None:
        loop = self._trainer().fit_loop.epoch_loop
        loop.__dict__.pop("_broadcast_sigterm_tensor", None)

    def _skip(self) -> None:
        """Replaces Lightning's check at the start of the step; the check runs after the update instead
        (:meth:`check`), where a flag raised during this step still reaches every rank before any rank leaves the
        loop at the end of the batch."""

    def flag(self) -> float:
        """1.0 if this rank received SIGTERM (or holds it back, :meth:`defer`), else 0.0: what a collective carries."""
        if self.deferred:
            return 1.0
        trainer = self._trainer()
        return 1.0 if trainer is not None and getattr(trainer, "received_sigterm", False) else 0.0

    def check(self) -> None:
        """Stop every rank together when any rank received SIGTERM (Lightning's version listens to rank 0 only):
        one 4-byte all-reduce (max), tag ``"lightning"``; raises ``SIGTERMException`` on every rank."""
        if self._buf is None:
            self._buf = torch.zeros(1, device=self.strategy._comm_device())
        flag = self._buf
        flag.fill_(self.flag())
        self.strategy.comm.all_reduce(flag, op="max", tag="lightning")
        if flag.item() > 0:
            raise SIGTERMException()

    def defer(self) -> None:
        """A collective read one step later carries this rank's flag (SelSync's ``vote="overlapped"``): Lightning
        would stop this rank alone at the end of its batch, so its flag moves here until :meth:`release`."""
        connector = getattr(self._trainer(), "_signal_connector", None)
        if connector is not None and getattr(connector, "received_sigterm", False):
            connector.received_sigterm = False
            self.deferred = True

    def release(self) -> None:
        """Lightning's flag as it would have been: set again if :meth:`defer` took it."""
        if self.deferred:
            self.deferred = False
            connector = getattr(self._trainer(), "_signal_connector", None)
            if connector is not None:
                connector.received_sigterm = True
