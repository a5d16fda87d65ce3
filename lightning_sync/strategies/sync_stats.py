"""Log LSSR and communication totals through the Trainer's loggers and progress bar.

:class:`SyncStats` is the callback every strategy adds unless the user did (``sync_stats=True``), so it lives beside
the strategies, below them: it reads what any strategy with accounting offers (:class:`Accounted`) and imports none
of them. Users import it from :mod:`lightning_sync.callbacks`.
"""

from __future__ import annotations

import time
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_sync.core.validation import check_bool, check_optional_int

__all__ = ["Accounted", "SyncStats"]


@runtime_checkable
class Accounted(Protocol):
    """What :class:`SyncStats` reads of a strategy: every :class:`~lightning_sync.strategies.SyncStrategy` has it."""

    step_counter: Any

    def sync_metrics(self) -> dict[str, float]: ...
    def sync_event_metrics(self) -> dict[str, float]: ...


class SyncStats(Callback):
    """Logs a lightning_sync strategy's :meth:`~lightning_sync.strategies.SyncStrategy.sync_metrics`.

    Every ``log_every_n_steps`` training steps (the Trainer's value by default), at the first step, the last
    batch of each epoch and the final step it logs, under ``prefix``:

    ========================  =================================================================================
    ``lssr``                  local-to-synchronous step ratio, Eq. 4 of SelSync: local / (local + sync)
    ``local_steps``           optimizer steps applied without synchronisation
    ``sync_steps``            optimizer steps that synchronised (parameters or gradients)
    ``bytes_sent``            bytes this rank sent for training (all tags but setup/checkpoint/verify)
    ``bytes_<tag>``           bytes per tag: ``params``, ``grads``, ``vote``, ``lightning`` (Lightning's own
                              collectives: ``sync_dist`` logging, barriers), ``setup``, ``checkpoint``...
    ``bytes_intra``           with replica groups (``replica_size``): training bytes sent inside the replica
                              (tags ``intra/<tag>``); ``blocked_intra_s`` the seconds blocked there
    ``bytes_inter``           with replica groups: the rest, sent between replicas (``blocked_inter_s``); the
                              two add up to ``bytes_sent``
    ``collectives``           collectives issued for training; ``blocking_collectives`` those waited on at once
    ``blocked_s``             seconds the training thread was blocked in communication (emulated delay included)
    ``wall_s``                seconds since training started (rank 0's clock)
    ``delta``, ``voters``     SelSync only: this rank's last relative gradient change and how many ranks voted
    ========================  =================================================================================

    At every step that synchronised it also logs the strategy's
    :meth:`~lightning_sync.strategies.SyncStrategy.sync_event_metrics` (ADPSGD: ``period``, ``s_k``, ``c2``).

    Values are rank 0's (loggers write on rank 0); with the all-reduce based strategies the counts are the same
    on every rank. LSSR is also shown in the progress bar. Without a logger (``Trainer(logger=False)``) the values
    still reach ``trainer.callback_metrics`` (and the progress bar), without Lightning's "no logger configured"
    warning. The callback only reads the strategy's counters: it
    never communicates.

    Args:
        prefix: string put before every metric name (may be empty).
        log_every_n_steps: an integer >= 1, or ``None`` for the Trainer's ``log_every_n_steps``.
        prog_bar: whether LSSR is shown in the progress bar (a bool).
    """

    def __init__(self, prefix: str = "sync/", log_every_n_steps: int | None = None, prog_bar: bool = True) -> None:
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a string (possibly empty), got {prefix!r}")
        log_every_n_steps = check_optional_int("log_every_n_steps", log_every_n_steps, 1, "the Trainer's")
        self.prefix = prefix
        self.log_every_n_steps = log_every_n_steps
        self.prog_bar = check_bool("prog_bar", prog_bar)
        self._last_syncs = 0
        self._t0 = time.perf_counter()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, Accounted):
            raise ValueError(
                f"SyncStats reads the accounting of a lightning_sync strategy, but the Trainer uses "
                f"{type(trainer.strategy).__name__}. Use e.g. strategy='bsp' (BSP with accounting) or 'selsync'."
            )

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, metrics: dict[str, float]) -> None:
        # to the loggers only when the Trainer has one (``logger=False`` is an ordinary configuration: Lightning
        # would warn at every value); ``callback_metrics`` and the progress bar get the values either way
        to_logger = bool(trainer.loggers)
        for key, value in metrics.items():
            pl_module.log(
                self.prefix + key,
                float(value),
                on_step=True,
                on_epoch=False,
                prog_bar=self.prog_bar and key == "lssr",
                logger=to_logger,
                rank_zero_only=True,
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, Accounted)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        step = trainer.global_step
        final = trainer.max_steps != -1 and step >= trainer.max_steps
        if step % every == 0 or step == 1 or trainer.is_last_batch or final:
            metrics = strategy.sync_metrics()
            metrics["wall_s"] = time.perf_counter() - self._t0
            self._log(trainer, pl_module, metrics)
        syncs = strategy.step_counter.sync_steps
        if syncs != self._last_syncs:
            self._last_syncs = syncs
            self._log(trainer, pl_module, strategy.sync_event_metrics())


def add_sync_stats(module: Any, wanted: bool) -> None:
    """A strategy's ``setup_environment``: add a :class:`SyncStats` to the Trainer of ``module`` unless it has one
    (``wanted``: the strategy's ``sync_stats``; ``False`` opts out), so LSSR and bytes reach the progress bar and
    loggers without extra wiring. Added before Lightning calls the callbacks' ``setup``, so the callback is set up
    like one the user passed."""
    trainer = module.trainer if module is not None else None
    if wanted and trainer is not None and not any(isinstance(cb, SyncStats) for cb in trainer.callbacks):
        trainer.callbacks.append(SyncStats())
