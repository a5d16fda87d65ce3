"""CIFAR10DataModule on a tiny generated CIFAR-10 folder (same file layout and pickle format, no download)."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_sync.data import ResumableDataLoader
from lightning_sync.data.cifar import CIFAR10_MEAN, CIFAR10_STD, CIFAR10DataModule, random_crop_flip

PER_BATCH = 20
N_TRAIN = 5 * PER_BATCH
N_TEST = 10
NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _write(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f)


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, np.ndarray]:
    """Parent folder of a fake ``cifar-10-batches-py`` (random images) plus the raw train data and labels."""
    root = tmp_path_factory.mktemp("cifar")
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(123)
    datas, labels = [], []
    for i in range(1, 6):
        data = rng.integers(0, 256, size=(PER_BATCH, 3072), dtype=np.uint8)
        lab = [(j + i) % 10 for j in range(PER_BATCH)]
        _write(folder / f"data_batch_{i}", {b"batch_label": b"training batch", b"labels": lab, b"data": data})
        datas.append(data)
        labels.extend(lab)
    test = rng.integers(0, 256, size=(N_TEST, 3072), dtype=np.uint8)
    _write(folder / "test_batch", {b"batch_label": b"testing batch", b"labels": list(range(N_TEST)), b"data": test})
    meta = {b"label_names": [n.encode() for n in NAMES], b"num_cases_per_batch": PER_BATCH, b"num_vis": 3072}
    _write(folder / "batches.meta", meta)
    return root, np.concatenate(datas), np.array(labels)


def _dm(root: Path, **kwargs) -> CIFAR10DataModule:
    kwargs.setdefault("batch_size", 8)
    dm = CIFAR10DataModule(str(root), **kwargs)
    dm.prepare_data()
    dm.setup()
    return dm


def test_sizes_shapes_dtypes_and_attributes(cifar_root) -> None:
    root, _, raw_labels = cifar_root
    dm = _dm(root)
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (90, 10, N_TEST)
    train, val = dm.split_indices["train"], dm.split_indices["val"]
    assert torch.equal(torch.cat([train, val]).sort().values, torch.arange(N_TRAIN))
    assert torch.equal(torch.bincount(torch.as_tensor(raw_labels)[val], minlength=10), torch.ones(10, dtype=torch.long))
    assert dm.num_classes == 10 and dm.input_shape == (3, 32, 32) and dm.classes == NAMES
    for ds in (dm.train_dataset, dm.val_dataset, dm.test_dataset):
        x, y = ds[0]
        assert x.shape == (3, 32, 32) and x.dtype == torch.float32
        assert y.dtype == torch.int64 and y.dim() == 0
    loader = dm.train_dataloader()
    assert isinstance(loader, ResumableDataLoader)
    xb, yb = next(iter(loader))
    assert xb.shape == (8, 3, 32, 32) and xb.dtype == torch.float32 and yb.shape == (8,) and yb.dtype == torch.int64
    val_loader = dm.val_dataloader()
    assert not isinstance(val_loader, ResumableDataLoader)
    assert torch.equal(torch.cat([b[1] for b in val_loader]), dm.val_dataset.labels)  # in order
    test_labels = torch.cat([b[1] for b in dm.test_dataloader()])
    assert torch.equal(test_labels, torch.arange(N_TEST))


def test_deterministic_split_by_seed(cifar_root) -> None:
    root = cifar_root[0]
    a, b, c = _dm(root, seed=0), _dm(root, seed=0), _dm(root, seed=1)
    for k in ("train", "val"):
        assert torch.equal(a.split_indices[k], b.split_indices[k])
    assert torch.equal(a.train_dataset.images, b.train_dataset.images)
    assert not torch.equal(a.split_indices["val"], c.split_indices["val"])
    assert len(_dm(root, val_fraction=0.3).val_dataset) == 30


def test_pixels_round_trip_and_normalisation(cifar_root) -> None:
    root, raw, raw_labels = cifar_root
    plain = _dm(root, augment=False, normalize=False)
    normed = _dm(root, augment=False, normalize=True)
    mean = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(3, 1, 1)
    for split in ("train", "val"):
        for j, i in enumerate(plain.split_indices[split].tolist()[:5]):
            expected = torch.from_numpy(raw[i].reshape(3, 32, 32)).float() / 255
            x, y = getattr(plain, f"{split}_dataset")[j]
            assert torch.equal(x, expected) and int(y) == raw_labels[i]
            xn, _ = getattr(normed, f"{split}_dataset")[j]
            assert torch.allclose(xn, (expected - mean) / std, atol=1e-6)
    with open(root / "cifar-10-batches-py" / "test_batch", "rb") as f:
        test = pickle.load(f, encoding="bytes")
    x, _ = plain.test_dataset[3]
    assert torch.equal(x, torch.from_numpy(test[b"data"][3].reshape(3, 32, 32)).float() / 255)
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0


def test_augmentation_keeps_shapes_and_is_train_only(cifar_root) -> None:
    root = cifar_root[0]
    dm = _dm(root, augment=True, normalize=False)
    assert dm.train_dataset.augment and not dm.val_dataset.augment and not dm.test_dataset.augment
    torch.manual_seed(0)
    outs = [dm.train_dataset[0][0] for _ in range(20)]
    assert all(o.shape == (3, 32, 32) and o.dtype == torch.float32 for o in outs)
    assert any(not torch.equal(o, outs[0]) for o in outs[1:])  # random crops/flips differ
    xb, _ = next(iter(dm.train_dataloader()))
    assert xb.shape == (8, 3, 32, 32)
    for dtype in (torch.uint8, torch.float32):
        img = torch.arange(3 * 32 * 32).reshape(3, 32, 32).to(dtype)
        out = random_crop_flip(img)
        assert out.shape == img.shape and out.dtype == dtype
    # a zero shift with no flip is the identity; the crop is otherwise a shifted window of the padded image
    img = torch.rand(3, 32, 32)
    padded = F.pad(img, (4, 4, 4, 4))
    for _ in range(10):
        out = random_crop_flip(img)
        found = any(
            torch.equal(out, cand)
            for t in range(9)
            for s in range(9)
            for cand in (padded[:, t : t + 32, s : s + 32], padded[:, t : t + 32, s : s + 32].flip(-1))
        )
        assert found


def test_data_dir_parent_or_batches_folder(cifar_root, tmp_path) -> None:
    root = cifar_root[0]
    a = _dm(root, augment=False)
    b = _dm(root / "cifar-10-batches-py", augment=False)
    assert torch.equal(a.train_dataset.images, b.train_dataset.images)
    assert torch.equal(a.test_dataset.images, b.test_dataset.images)
    assert b.classes == NAMES
    # a renamed batches folder is accepted when it holds the files directly
    renamed = tmp_path / "my_cifar"
    shutil.copytree(root / "cifar-10-batches-py", renamed)
    assert len(_dm(renamed).test_dataset) == N_TEST


def test_missing_data_raises_helpful_error(cifar_root, tmp_path) -> None:
    missing = tmp_path / "nowhere"
    dm = CIFAR10DataModule(str(missing))  # lazy: nothing is read at construction
    for call in (dm.prepare_data, dm.setup):
        with pytest.raises(FileNotFoundError, match="cifar-10-batches-py") as info:
            call()
        msg = str(info.value)
        assert str(missing) in msg and "https://www.cs.toronto.edu/~kriz/cifar.html" in msg and "data_batch_1" in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no CIFAR-10 data"):
        CIFAR10DataModule(str(empty)).prepare_data()
    partial = tmp_path / "partial" / "cifar-10-batches-py"
    shutil.copytree(cifar_root[0] / "cifar-10-batches-py", partial)
    (partial / "data_batch_3").unlink()
    (partial / "batches.meta").unlink()
    with pytest.raises(FileNotFoundError, match="lacks data_batch_3, batches.meta") as info:
        CIFAR10DataModule(str(partial.parent)).prepare_data()
    assert "kriz/cifar.html" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2.0}, "batch_size"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"val_fraction": float("nan")}, "val_fraction"),
        ({"seed": "0"}, "seed"),
        ({"num_workers": -1}, "num_workers"),
        ({"augment": "yes"}, "augment"),
        ({"normalize": None}, "normalize"),
        ({"data_dir": None}, "data_dir"),
        ({"data_dir": ""}, "data_dir"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    kwargs.setdefault("data_dir", "/does/not/matter")
    with pytest.raises(ValueError, match=match):
        CIFAR10DataModule(**kwargs)


def test_picklable_and_lazy(cifar_root) -> None:
    dm = CIFAR10DataModule(str(cifar_root[0]), batch_size=4)
    assert dm.train_dataset is None and dm.test_dataset is None
    dm2 = pickle.loads(pickle.dumps(dm))
    assert dm2.batch_size == 4 and dm2.hparams["batch_size"] == 4
    dm2.setup("test")
    assert dm2.train_dataset is None and len(dm2.test_dataset) == N_TEST
    dm2.setup("fit")
    assert len(dm2.train_dataset) == 90


class TinyCNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1).flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_fit_two_steps(cifar_root) -> None:
    dm = CIFAR10DataModule(str(cifar_root[0]), batch_size=16)
    model = TinyCNN()
    before = model.conv.weight.detach().clone()
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2
    assert not torch.equal(before, model.conv.weight.detach())
