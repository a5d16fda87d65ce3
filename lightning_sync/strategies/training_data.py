"""What the strategy does to the training data: SelSync's data injection and registered loader transforms.

Lightning prepares the training dataloader (its ``DistributedSampler``) and hands every batch to
``training_step``; :class:`TrainingData` then applies the transforms callbacks registered (SelDP swaps the sampler
for its own) and, with ``injection``, rebuilds the loader at the reduced batch size and mixes the shared samples into
each batch (:class:`~lightning_sync.strategies.injection.DataInjector`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.trainer.states import RunningStage

from lightning_sync.data.waits import bound_worker_waits
from lightning_sync.strategies.injection import DataInjector

if TYPE_CHECKING:
    from lightning_sync.strategies.base import SyncStrategy

#: a training-dataloader transform: ``(dataloader, strategy) -> dataloader``
DataLoaderTransform = Callable[[Any, "SyncStrategy"], Any]


class TrainingData:
    """Mixin of :class:`~lightning_sync.strategies.SyncStrategy`. The strategy's ``__init__`` sets ``injector`` and
    ``_dataloader_transforms``."""

    injector: DataInjector | None
    _timeout: timedelta | None
    _dataloader_transforms: list[DataLoaderTransform]

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.injector is not None and args:
            args = (self.injector.inject(args[0], self.comm, self._comm_device()), *args[1:])
        return super().training_step(*args, **kwargs)

    def add_dataloader_transform(self, transform: DataLoaderTransform) -> None:
        """Register a transform applied to the *training* dataloader after Lightning prepared it (SelDP uses
        this to swap Lightning's DistributedSampler for its own)."""
        if transform not in self._dataloader_transforms:
            self._dataloader_transforms.append(transform)

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        # every loader (train, val, test, predict): a worker that never delivers stops this rank within the
        # collectives' timeout instead of hanging it (lightning_sync.data.waits)
        bound_worker_waits(dataloader, self._timeout if self._timeout is not None else default_pg_timeout)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING:
            for transform in self._dataloader_transforms:
                dataloader = transform(dataloader, self)
            if self.injector is not None:
                dataloader = self.injector.rebuild_loader(dataloader, self.world_size)
        return dataloader
