"""Turn on SelDP partitioning (SelSync §III-D, Fig. 7b) without editing the DataModule."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, DistributedSampler

from lightning_sync.core.validation import MAX_INT64, check_optional_int
from lightning_sync.data.seldp import SelDPSampler
from lightning_sync.strategies.base import SyncStrategy


class SelDP(Callback):
    """Replace the training loader's ``DistributedSampler`` (DefDP) with :class:`~lightning_sync.data.SelDPSampler`.

    Every rank then iterates the whole training set as a circular queue of N chunks starting at its own chunk,
    reshuffled each epoch with a seed shared by all ranks, so at every step the N ranks read N different chunks.
    An SelDP epoch is N times as many steps as a DefDP epoch (each rank sees every sample).

    How it interacts with ``use_distributed_sampler``:

    * ``True`` (Lightning's default): Lightning first injects its ``DistributedSampler``; this callback swaps it
      for an ``SelDPSampler`` with the same ``shuffle``, ``seed`` and ``drop_last``.
    * A DataModule that already sets a ``DistributedSampler`` subclass keeps it (Lightning leaves those alone);
      this callback then raises rather than silently overriding it, unless it is already an ``SelDPSampler``.
    * ``False``: nothing is injected and this callback raises; set ``SelDPSampler`` in your DataModule instead
      (the other supported form: a ``DistributedSampler`` subclass, which Lightning calls ``set_epoch`` on).

    Lightning has no public hook for swapping a sampler: the strategy applies this in ``process_dataloader``
    and rebuilds the loader with Lightning's private ``_update_dataloader`` helper, which is why the package
    pins ``lightning>=2.6,<2.7``. Works with every lightning_sync strategy (BSP included).

    Args:
        seed: shuffle seed shared by all ranks, an integer in [0, 2**63 - 1]; ``None`` (default) keeps the seed of
            the sampler it replaces.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = check_optional_int("seed", seed, 0, "keep the sampler's seed", MAX_INT64)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not isinstance(trainer.strategy, SyncStrategy):
            raise ValueError(
                f"SelDP swaps the training sampler through a lightning_sync strategy, but the Trainer uses "
                f"{type(trainer.strategy).__name__}. Use a lightning_sync strategy (e.g. 'bsp' or 'selsync'), "
                "or set lightning_sync.data.SelDPSampler in your DataModule."
            )
        trainer.strategy.add_dataloader_transform(self._transform)

    def _transform(self, dataloader: Any, strategy: SyncStrategy) -> Any:
        if not isinstance(dataloader, DataLoader):
            raise ValueError(f"SelDP needs a torch DataLoader as training loader, got {type(dataloader).__name__}")
        sampler = dataloader.sampler
        if isinstance(sampler, SelDPSampler):
            return dataloader
        if type(sampler) is not DistributedSampler:
            raise ValueError(
                "SelDP replaces the DistributedSampler Lightning injects, but the training loader uses "
                f"{type(sampler).__name__}. Keep use_distributed_sampler=True and a plain sampler, or use "
                "lightning_sync.data.SelDPSampler in your DataModule directly."
            )
        seldp = SelDPSampler(
            sampler.dataset,
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            shuffle=sampler.shuffle,
            seed=sampler.seed if self.seed is None else self.seed,
            drop_last=sampler.drop_last,
        )
        return _update_dataloader(dataloader, seldp)
