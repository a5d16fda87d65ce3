"""CIFAR-10 from a local copy of the "CIFAR-10 python version" (no download, no torchvision dataset class)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from ..core.validation import check_int, check_real
from .digits import stratified_split
from .loader import ResumableDataLoader, ordered_loader

__all__ = ["CIFAR10DataModule", "CIFAR10Tensors", "random_crop_flip"]

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
BATCHES_DIR = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
META_FILE = "batches.meta"
#: per-channel mean / std of the 50k CIFAR-10 training images (pixel values scaled to [0, 1])
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def _layout_help() -> str:
    return (
        f"expected the CIFAR-10 python version: a folder '{BATCHES_DIR}/' holding {', '.join(TRAIN_FILES)}, "
        f"{TEST_FILE} and {META_FILE} (pass that folder or its parent as `data_dir`); get "
        f"cifar-10-python.tar.gz from {CIFAR10_URL} and extract it (nothing is downloaded automatically)"
    )


def resolve_batches_dir(data_dir: str | os.PathLike[str]) -> Path:
    """The ``cifar-10-batches-py`` folder given itself or its parent; ``FileNotFoundError`` when a file is missing."""
    root = Path(data_dir).expanduser()
    if (root / BATCHES_DIR).is_dir():
        folder = root / BATCHES_DIR
    elif root.is_dir() and (root.name == BATCHES_DIR or (root / TRAIN_FILES[0]).is_file()):
        folder = root
    elif not root.exists():
        raise FileNotFoundError(f"CIFAR-10 data_dir {str(root)!r} does not exist; {_layout_help()}")
    else:
        raise FileNotFoundError(
            f"no CIFAR-10 data in {str(root)!r} (nor in {str(root / BATCHES_DIR)!r}); {_layout_help()}"
        )
    missing = [name for name in (*TRAIN_FILES, TEST_FILE, META_FILE) if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"CIFAR-10 folder {str(folder)!r} lacks {', '.join(missing)}; {_layout_help()}")
    return folder


def _load_pickle(path: Path) -> dict[Any, Any]:
    with open(path, "rb") as f:
        obj = pickle.load(f, encoding="bytes")
    if not isinstance(obj, dict):
        raise ValueError(f"{str(path)!r} is not a CIFAR-10 batch file (unpickled a {type(obj).__name__}, not a dict)")
    return obj


def _get(obj: dict[Any, Any], key: str, path: Path) -> Any:
    for k in (key.encode(), key):
        if k in obj:
            return obj[k]
    raise ValueError(f"{str(path)!r} is not a CIFAR-10 batch file: no key b{key!r}")


def load_batch(path: Path) -> tuple[Tensor, Tensor]:
    """Images ``uint8 [N, 3, 32, 32]`` and labels ``int64 [N]`` of one CIFAR-10 batch pickle."""
    obj = _load_pickle(path)
    data = torch.as_tensor(_get(obj, "data", path))
    labels = torch.as_tensor(list(_get(obj, "labels", path)), dtype=torch.int64)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(
            f"{str(path)!r}: b'data' must be uint8 of shape [N, 3072], got {data.dtype} {tuple(data.shape)}"
        )
    if labels.shape != (data.shape[0],):
        raise ValueError(f"{str(path)!r}: {labels.numel()} labels for {data.shape[0]} images")
    if labels.numel() and not (0 <= int(labels.min()) and int(labels.max()) < CIFAR10DataModule.num_classes):
        raise ValueError(f"{str(path)!r}: labels must be in [0, 9], got [{int(labels.min())}, {int(labels.max())}]")
    return data.reshape(-1, 3, 32, 32).clone(), labels


def load_label_names(path: Path) -> list[str]:
    """The ``label_names`` of ``batches.meta`` as strings."""
    names = _get(_load_pickle(path), "label_names", path)
    return [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in names]


def random_crop_flip(image: Tensor, padding: int = 4) -> Tensor:
    """Random ``H x W`` crop of ``image`` (``[C, H, W]``, any dtype) zero-padded by ``padding``, then a horizontal flip
    with probability 1/2 (torchvision's ``RandomCrop(32, padding=4)`` + ``RandomHorizontalFlip()``; global torch RNG).
    """
    h, w = image.shape[-2:]
    padded = F.pad(image, (padding, padding, padding, padding))
    top, left = torch.randint(0, 2 * padding + 1, (2,)).tolist()
    out = padded[..., top : top + h, left : left + w]
    if torch.rand(()) < 0.5:
        out = out.flip(-1)
    return out.contiguous()


class CIFAR10Tensors(Dataset):
    """Map-style dataset over ``uint8`` images ``[N, 3, 32, 32]`` and ``int64`` labels.

    Items are ``(float32 [3, 32, 32], int64 scalar)``: the image is optionally augmented (:func:`random_crop_flip`,
    on the uint8 data), scaled to ``[0, 1]`` and optionally normalised with ``(x - mean) / std`` per channel.
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        augment: bool = False,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
    ) -> None:
        if images.shape[0] != labels.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels")
        self.images = images
        self.labels = labels
        self.augment = augment
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image = self.images[index]
        if self.augment:
            image = random_crop_flip(image)
        x = image.to(torch.float32).div_(255.0)
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return x, self.labels[index]


class CIFAR10DataModule(pl.LightningDataModule):
    """LightningDataModule on a local copy of CIFAR-10 (the "CIFAR-10 python version"; never downloads).

    ``data_dir`` is the extracted ``cifar-10-batches-py`` folder (``data_batch_1`` ... ``data_batch_5``,
    ``test_batch``, ``batches.meta``) or its parent; get ``cifar-10-python.tar.gz`` from
    https://www.cs.toronto.edu/~kriz/cifar.html. The pickles are read directly (no md5 check); only load files you
    trust, since unpickling can run code. A missing folder or file raises ``FileNotFoundError`` saying what is
    expected.

    Images are float32 tensors ``(3, 32, 32)`` scaled to ``[0, 1]`` and, with ``normalize=True``, standardised with
    the usual per-channel CIFAR-10 mean/std (:data:`CIFAR10_MEAN`, :data:`CIFAR10_STD`); labels are int64. With
    ``augment=True`` training images get a random 32x32 crop of the 4-pixel zero-padded image and a random
    horizontal flip (plain torch ops, no PIL). The 50k training images are split into train/val, stratified by
    class and determined by ``seed`` only (identical on every rank and process); the test split is ``test_batch``.

    Data is read in :meth:`setup` (not ``__init__``), so the module stays small and picklable for spawn.
    ``train_dataloader()`` returns a :class:`~lightning_sync.data.ResumableDataLoader` (``shuffle=True``,
    ``drop_last=False``) so mid-epoch checkpoints resume; under a distributed strategy Lightning swaps its
    ``RandomSampler`` for a ``DistributedSampler`` (or a SelDP callback for a ``SelDPSampler``).

    Args:
        data_dir: the ``cifar-10-batches-py`` folder or its parent.
        batch_size: per-process batch size, >= 1.
        val_fraction: fraction of the 50k training images in the validation split, in (0, 1).
        seed: seed of the train/val split.
        num_workers: DataLoader workers, >= 0.
        augment: random crop (padding 4) + horizontal flip on the training split.
        normalize: standardise with the CIFAR-10 per-channel mean/std.
    """

    num_classes: int = 10
    input_shape: tuple[int, int, int] = (3, 32, 32)

    def __init__(
        self,
        data_dir: str,
        batch_size: int = 128,
        val_fraction: float = 0.1,
        seed: int = 0,
        num_workers: int = 0,
        augment: bool = True,
        normalize: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(data_dir, (str, os.PathLike)) or not str(data_dir):
            raise ValueError(f"data_dir must be a non-empty path (str), got {data_dir!r}")
        check_int("batch_size", batch_size, 1)
        check_real("val_fraction", val_fraction, 0.0, 1.0, low_open=True, high_open=True)
        check_int("seed", seed, -(2**63), 2**64 - 1)
        check_int("num_workers", num_workers, 0)
        for name, flag in (("augment", augment), ("normalize", normalize)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        self.data_dir = os.fspath(data_dir)
        self.batch_size = int(batch_size)
        self.val_fraction = float(val_fraction)
        self.seed = int(seed)
        self.num_workers = int(num_workers)
        self.augment = augment
        self.normalize = normalize
        self.save_hyperparameters()
        self.train_dataset: CIFAR10Tensors | None = None
        self.val_dataset: CIFAR10Tensors | None = None
        self.test_dataset: CIFAR10Tensors | None = None
        #: indices into the 50k concatenated training batches of the train and val splits (sorted), set by `setup`
        self.split_indices: dict[str, Tensor] = {}
        self._classes: list[str] | None = None

    @property
    def batches_dir(self) -> Path:
        """The ``cifar-10-batches-py`` folder (checks that every file is there)."""
        return resolve_batches_dir(self.data_dir)

    @property
    def classes(self) -> list[str]:
        """Label names from ``batches.meta`` (read on first access)."""
        if self._classes is None:
            self._classes = load_label_names(self.batches_dir / META_FILE)
        return list(self._classes)

    def prepare_data(self) -> None:
        """Check that the files are there (``FileNotFoundError`` otherwise); nothing is downloaded."""
        resolve_batches_dir(self.data_dir)

    def _stats(self) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
        return (CIFAR10_MEAN, CIFAR10_STD) if self.normalize else (None, None)

    def _setup_fit(self) -> None:
        if self.train_dataset is not None:
            return
        folder = self.batches_dir
        batches = [load_batch(folder / name) for name in TRAIN_FILES]
        images = torch.cat([b[0] for b in batches])
        labels = torch.cat([b[1] for b in batches])
        val_idx, train_idx = stratified_split(labels, (self.val_fraction,), self.seed)
        mean, std = self._stats()
        self.split_indices = {"train": train_idx, "val": val_idx}
        self.val_dataset = CIFAR10Tensors(images[val_idx], labels[val_idx], False, mean, std)
        self.train_dataset = CIFAR10Tensors(images[train_idx], labels[train_idx], self.augment, mean, std)

    def _setup_test(self) -> None:
        if self.test_dataset is not None:
            return
        images, labels = load_batch(self.batches_dir / TEST_FILE)
        mean, std = self._stats()
        self.test_dataset = CIFAR10Tensors(images, labels, False, mean, std)

    def setup(self, stage: str | None = None) -> None:
        """Read the splits a stage needs (``"fit"``/``"validate"``: train+val, ``"test"``: test, ``None``: all;
        idempotent; same result on every rank)."""
        if stage in (None, "fit", "validate"):
            self._setup_fit()
        if stage in (None, "test", "predict"):
            self._setup_test()

    def train_dataloader(self) -> ResumableDataLoader:
        """Shuffled, resumable loader of the training split (augmented when ``augment=True``)."""
        self._setup_fit()
        return ResumableDataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=False,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        """Loader of the validation split, in order."""
        self._setup_fit()
        return ordered_loader(self.val_dataset, self.batch_size, self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """Loader of the test split (``test_batch``), in order."""
        self._setup_test()
        return ordered_loader(self.test_dataset, self.batch_size, self.num_workers)
