"""A one-line-per-epoch progress report on rank 0 (for scripted runs such as ``lightning-sync compare``)."""

from __future__ import annotations

import sys
import time

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_only


class EpochPrinter(Callback):
    """Print ``epoch i/N, step, elapsed, ETA`` and the logged validation metrics at the end of every epoch."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0 = time.perf_counter()

    @rank_zero_only
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        elapsed = time.perf_counter() - self._t0
        done, total = trainer.current_epoch + 1, trainer.max_epochs or 0
        eta = elapsed / done * (total - done) if total and total > 0 else float("nan")
        vals = " ".join(
            f"{k}={float(v):.4f}" for k, v in sorted(trainer.callback_metrics.items()) if k.startswith("val/")
        )
        print(
            f"[progress] epoch {done}/{total} step {trainer.global_step} elapsed {elapsed:.1f}s eta {eta:.1f}s {vals}",
            flush=True,
        )
        sys.stdout.flush()
