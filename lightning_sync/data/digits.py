"""Small embedded dataset for tests and examples: scikit-learn's handwritten digits (no download)."""

from __future__ import annotations

import math
from typing import Literal

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ..core.validation import check_int, check_real
from .loader import ResumableDataLoader, ordered_loader
from .noniid import Dirichlet, LabelSkew

__all__ = ["DigitsDataModule"]


def _check_fraction(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) < 1.0:
        raise ValueError(f"`{name}` must be in the open interval (0, 1), got {value!r}")
    return float(value)


def stratified_split(labels: torch.Tensor, fractions: tuple[float, ...], seed: int) -> tuple[torch.Tensor, ...]:
    """Deterministic stratified split of ``range(len(labels))``.

    Returns ``len(fractions) + 1`` disjoint sorted index tensors covering all samples: part ``i`` has
    ``round(fractions[i] * M)`` samples, the last part the rest. Samples are shuffled with a
    ``torch.Generator`` seeded with ``seed``, then interleaved by class in proportion to class frequencies
    (each sample is keyed by its fractional position within its class), so every part has about the global
    class proportions.
    """
    m = labels.numel()
    g = torch.Generator()
    g.manual_seed(seed)
    perm = torch.randperm(m, generator=g)
    shuffled = labels[perm]
    keys = torch.empty(m, dtype=torch.float64)
    for cls in torch.unique(shuffled):
        where = (shuffled == cls).nonzero(as_tuple=True)[0]
        keys[where] = (torch.arange(where.numel(), dtype=torch.float64) + 0.5) / where.numel()
    order = perm[torch.sort(keys, stable=True).indices]
    sizes = [round(f * m) for f in fractions]
    parts = []
    start = 0
    for size in sizes:
        parts.append(order[start : start + size].sort().values)
        start += size
    parts.append(order[start:].sort().values)
    return tuple(parts)


class DigitsDataModule(pl.LightningDataModule):
    """LightningDataModule on scikit-learn's handwritten digits (``sklearn.datasets.load_digits``).

    1797 grayscale 8x8 images of the digits 0-9 that ship inside scikit-learn (no download). Images are
    float32 tensors of shape ``(1, 8, 8)`` (``(64,)`` with ``flatten=True``), scaled to ``[0, 1]`` then
    standardised with the scalar mean/std of the training split; labels are int64. The train/val/test split
    is stratified by class and determined by ``seed`` only (identical on every rank and process).

    Data is built in :meth:`setup` (not ``__init__``), so the module stays small and picklable for spawn.
    ``train_dataloader()`` returns a :class:`~lightning_sync.data.ResumableDataLoader` (``shuffle=True``,
    ``drop_last=False``) so mid-epoch checkpoints resume; under a distributed strategy Lightning swaps its
    ``RandomSampler`` for a ``DistributedSampler`` (or a SelDP callback for a ``SelDPSampler``).

    Args:
        batch_size: per-process batch size, >= 1.
        val_fraction: fraction of the 1797 samples in the validation split, in (0, 1).
        test_fraction: fraction in the test split, in (0, 1); ``val_fraction + test_fraction < 1``.
        seed: seed of the split.
        num_workers: DataLoader workers, >= 0.
        flatten: give images as vectors of 64 features instead of ``(1, 8, 8)``.
        partition: ``"iid"`` (Lightning's DistributedSampler, or SelDP through its callback), or a non-IID split of
            the training set over the ranks: ``"labelskew"`` (:class:`~lightning_sync.data.LabelSkew` with
            ``labels_per_rank``) or ``"dirichlet"`` (:class:`~lightning_sync.data.Dirichlet` with
            ``dirichlet_alpha``), seeded by ``seed``; ranks' epoch lengths are equalised by repeating own samples.
    """

    num_classes: int = 10
    num_samples: int = 1797

    def __init__(
        self,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        seed: int = 0,
        num_workers: int = 0,
        flatten: bool = False,
        partition: Literal["iid", "labelskew", "dirichlet"] = "iid",
        labels_per_rank: int = 2,
        dirichlet_alpha: float = 0.5,
    ) -> None:
        super().__init__()
        if partition not in ("iid", "labelskew", "dirichlet"):
            raise ValueError(f"`partition` must be 'iid', 'labelskew' or 'dirichlet', got {partition!r}")
        check_int("labels_per_rank", labels_per_rank, 1, 10)
        check_real("dirichlet_alpha", dirichlet_alpha, 0.0, low_open=True)
        self.partition = partition
        self.labels_per_rank = labels_per_rank
        self.dirichlet_alpha = float(dirichlet_alpha)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be an int >= 1, got {batch_size!r}")
        val_fraction = _check_fraction("val_fraction", val_fraction)
        test_fraction = _check_fraction("test_fraction", test_fraction)
        if not val_fraction + test_fraction < 1.0:
            raise ValueError(
                f"`val_fraction + test_fraction` must be < 1, got {val_fraction} + {test_fraction}"
                f" = {val_fraction + test_fraction}"
            )
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"`num_workers` must be an int >= 0, got {num_workers!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"`seed` must be an int, got {seed!r}")
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.flatten = bool(flatten)
        self.save_hyperparameters()
        self.train_dataset: TensorDataset | None = None
        self.val_dataset: TensorDataset | None = None
        self.test_dataset: TensorDataset | None = None
        #: indices into ``load_digits()`` of each split (sorted), filled by :meth:`setup`
        self.split_indices: dict[str, torch.Tensor] = {}
        self.mean: float | None = None
        self.std: float | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one image: ``(1, 8, 8)``, or ``(64,)`` with ``flatten=True``."""
        return (64,) if self.flatten else (1, 8, 8)

    def prepare_data(self) -> None:
        """Nothing to download: the digits ship inside scikit-learn."""

    def setup(self, stage: str | None = None) -> None:
        """Load, split and standardise the data (idempotent; same result on every rank)."""
        if self.train_dataset is not None:
            return
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.as_tensor(digits.images, dtype=torch.float32) / 16.0  # pixel values are 0..16
        labels = torch.as_tensor(digits.target, dtype=torch.int64)
        fractions = (self.test_fraction, self.val_fraction)
        test_idx, val_idx, train_idx = stratified_split(labels, fractions, self.seed)
        train_images = images[train_idx]
        mean = train_images.mean().item()
        std = train_images.std().item()
        if not math.isfinite(std) or std <= 0:
            std = 1.0
        self.mean, self.std = mean, std
        images = (images - mean) / std
        images = images.reshape(-1, *self.input_shape)
        self.split_indices = {"train": train_idx, "val": val_idx, "test": test_idx}
        self.train_dataset = TensorDataset(images[train_idx], labels[train_idx])
        self.val_dataset = TensorDataset(images[val_idx], labels[val_idx])
        self.test_dataset = TensorDataset(images[test_idx], labels[test_idx])

    def train_dataloader(self) -> ResumableDataLoader:
        """Shuffled, resumable loader of the training split (over this rank's non-IID part when partitioned)."""
        self.setup()
        if self.partition == "iid":
            return ResumableDataLoader(
                self.train_dataset,
                batch_size=self.batch_size,
                shuffle=True,
                drop_last=False,
                num_workers=self.num_workers,
            )
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        if self.partition == "labelskew":
            sampler: LabelSkew | Dirichlet = LabelSkew(
                self.train_dataset, self.labels_per_rank, num_replicas=world, rank=rank, seed=self.seed
            )
        else:
            sampler = Dirichlet(self.train_dataset, self.dirichlet_alpha, num_replicas=world, rank=rank, seed=self.seed)
        return ResumableDataLoader(
            self.train_dataset, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        """Loader of the validation split, in order."""
        self.setup()
        return ordered_loader(self.val_dataset, self.batch_size, self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """Loader of the test split, in order."""
        self.setup()
        return ordered_loader(self.test_dataset, self.batch_size, self.num_workers)
