"""What the strategy does to the training data: SelSync's data injection and registered loader transforms.

Lightning prepares the training dataloader (its ``DistributedSampler``) and hands every batch to
``training_step``; :class:`TrainingData`, a component every :class:`~lightning_sync.strategies.SyncStrategy` owns
(``strategy.training_data``; the strategy's ``process_dataloader`` and ``training_step`` hand it the loader and the
batch), then applies the transforms callbacks registered (SelDP swaps the sampler for its own) and, with
``injection``, rebuilds the loader at the reduced batch size and mixes the shared samples into each batch
(:class:`~lightning_sync.strategies.injection.DataInjector`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.trainer.states import RunningStage

from lightning_sync.comm import Communicator
from lightning_sync.core.validation import check_int
from lightning_sync.data.waits import bound_worker_waits
from lightning_sync.strategies.injection import DataInjector

#: a training-dataloader transform: ``(dataloader, strategy) -> dataloader`` (the strategy: the
#: :class:`~lightning_sync.strategies.SyncStrategy` that applies it)
DataLoaderTransform = Callable[[Any, Any], Any]


def check_injection(injection: Any, seed: Any) -> int:
    """The ``injection`` argument's form (``(alpha, beta)`` or ``None``; the values are the injector's to check) and
    ``injection_seed``; returns the seed."""
    if injection is not None and (not isinstance(injection, (tuple, list)) or len(injection) != 2):
        raise ValueError(f"injection must be (alpha, beta) with both in (0, 1], or None; got {injection!r}")
    return check_int("injection_seed", seed, 0)


class DataHost(Protocol):
    """What :class:`TrainingData` uses of the strategy that owns it."""

    comm: Communicator
    injector: DataInjector | None
    world_size: int
    lightning_module: Any
    _timeout: timedelta | None

    def _comm_device(self) -> torch.device: ...


class TrainingData:
    """The transforms registered for the training loader, and the strategy's ``injector`` applied to it and to
    every training batch (see the module docstring)."""

    def __init__(self, strategy: DataHost) -> None:
        self.strategy = strategy
        self.transforms: list[DataLoaderTransform] = []

    def add_transform(self, transform: DataLoaderTransform) -> None:
        """Register ``transform`` (once) for the *training* dataloader, after Lightning prepared it."""
        if transform not in self.transforms:
            self.transforms.append(transform)

    def batch_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``training_step``'s arguments, the batch (the first) with the injected samples mixed in."""
        s = self.strategy
        if s.injector is not None and args:
            args = (s.injector.inject(args[0], s.comm, s._comm_device()), *args[1:])
        return args

    def metrics(self) -> dict[str, float]:
        """What the injector sent (``sync_metrics``), none without injection."""
        injector = self.strategy.injector
        if injector is None:
            return {}
        return {
            "injected_samples": float(injector.injected_samples),
            "injected_payload_bytes": float(injector.payload_bytes),
        }

    def loader(self, dataloader: object) -> object:
        """Every loader (train, val, test, predict) Lightning prepared: a worker that never delivers stops this rank
        within the collectives' timeout instead of hanging it (:mod:`lightning_sync.data.waits`); the training
        loader then goes through the registered transforms and the injector's rebuild."""
        s = self.strategy
        bound_worker_waits(dataloader, s._timeout if s._timeout is not None else default_pg_timeout)
        trainer = s.lightning_module.trainer if s.lightning_module is not None else None
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING:
            for transform in self.transforms:
                dataloader = transform(dataloader, s)
            if s.injector is not None:
                dataloader = s.injector.rebuild_loader(dataloader, s.world_size)
        return dataloader
