"""ResumableDataLoader (mid-epoch resume) and DigitsDataModule."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from lightning_sync.data import DigitsDataModule, ResumableDataLoader, SelDPSampler

# ---------------------------------------------------------------------------------------------------------
# ResumableDataLoader
# ---------------------------------------------------------------------------------------------------------


class RecordingDataset(Dataset):
    """Map-style dataset returning its index and recording which indices were loaded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loaded.append(int(i))
        return int(i)


class RangeIterable(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def _loader(n: int = 50, epoch: int = 2, batch_size: int = 4, **kwargs) -> ResumableDataLoader:
    ds = RecordingDataset(n)
    sampler = SelDPSampler(ds, num_replicas=2, rank=1, seed=3)
    sampler.set_epoch(epoch)
    return ResumableDataLoader(ds, batch_size=batch_size, sampler=sampler, **kwargs)


def _as_lists(batches) -> list[list[int]]:
    return [b.tolist() for b in batches]


def _take(loader: ResumableDataLoader, k: int) -> list[list[int]]:
    it = iter(loader)
    return [next(it).tolist() for _ in range(k)]


def test_is_lightning_stateful() -> None:
    from lightning.fabric.utilities.types import _Stateful

    assert isinstance(_loader(), _Stateful)


@pytest.mark.parametrize("k", [0, 1, 3, 12])
def test_resume_after_k_batches_yields_the_rest(k: int) -> None:
    full = _as_lists(_loader())
    assert len(full) == 13  # SelDP, N=2: 2 * 25 = 50 indices per rank, batches of 4

    interrupted = _loader()
    assert _take(interrupted, k) == full[:k]
    state = interrupted.state_dict()
    assert state["batches_yielded"] == k
    assert state["sampler_epoch"] == 2

    resumed = _loader()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # round-trips before iterating
    assert _as_lists(resumed) == full[k:]
    assert resumed.state_dict()["batches_yielded"] == len(full)
    # the skip applies once: the next epoch is complete
    assert _as_lists(resumed) == full


def test_skipped_batches_are_not_loaded() -> None:
    resumed = _loader()
    resumed.load_state_dict({"batches_yielded": 5})
    out = _as_lists(resumed)
    assert len(out) == 13 - 5
    assert sorted(resumed.dataset.loaded) == sorted(i for b in out for i in b)


def test_state_counts_during_iteration_and_interrupted_twice() -> None:
    full = _as_lists(_loader())
    first = _loader()
    _take(first, 4)
    second = _loader()
    second.load_state_dict(first.state_dict())
    it = iter(second)
    assert [next(it).tolist() for _ in range(3)] == full[4:7]
    assert second.state_dict()["batches_yielded"] == 7  # position in the epoch, not in the resumed run
    third = _loader()
    third.load_state_dict(second.state_dict())
    assert _as_lists(third) == full[7:]


def test_no_skip_when_epoch_changed_or_complete() -> None:
    interrupted = _loader(epoch=2)
    _take(interrupted, 3)
    state = interrupted.state_dict()
    # Lightning resumes an end-of-epoch checkpoint (e.g. with limit_train_batches) with set_epoch(next epoch)
    resumed = _loader(epoch=3)
    resumed.load_state_dict(state)
    assert _as_lists(resumed) == _as_lists(_loader(epoch=3))
    # a complete epoch is not skipped either
    done = _loader()
    full = _as_lists(done)
    resumed = _loader()
    resumed.load_state_dict(done.state_dict())
    assert _as_lists(resumed) == full


def test_new_iterator_resets_count_and_old_one_stops_counting() -> None:
    loader = _loader()
    it1 = iter(loader)
    next(it1), next(it1)
    assert loader.state_dict()["batches_yielded"] == 2
    it2 = iter(loader)
    next(it2)
    next(it1)
    assert loader.state_dict()["batches_yielded"] == 1


def test_default_sampler_without_epoch() -> None:
    ds = TensorDataset(torch.arange(30))
    full = [b[0].tolist() for b in ResumableDataLoader(ds, batch_size=4)]
    loader = ResumableDataLoader(ds, batch_size=4)
    loader.load_state_dict({"batches_yielded": 2})
    assert loader.state_dict()["sampler_epoch"] is None
    assert [b[0].tolist() for b in loader] == full[2:]


def test_batch_size_none_and_iterable_dataset() -> None:
    ds = RecordingDataset(10)
    loader = ResumableDataLoader(ds, batch_size=None)
    loader.load_state_dict({"batches_yielded": 4})
    assert list(loader) == list(range(4, 10))
    assert ds.loaded == list(range(4, 10))

    it_loader = ResumableDataLoader(RangeIterable(10), batch_size=3)
    it_loader.load_state_dict({"batches_yielded": 2})
    assert _as_lists(it_loader) == [[6, 7, 8], [9]]
    assert _as_lists(it_loader) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_load_state_dict_validation() -> None:
    loader = _loader()
    for bad in ({}, {"batches_yielded": -1}, {"batches_yielded": 1.5}, {"batches_yielded": True}):
        with pytest.raises(ValueError, match="batches_yielded"):
            loader.load_state_dict(bad)


def test_lightning_reinstantiation_keeps_class_and_resumes() -> None:
    from lightning.pytorch.utilities.data import _update_dataloader

    ds = RecordingDataset(40)
    original = ResumableDataLoader(ds, batch_size=5, shuffle=True, num_workers=0)
    sampler = SelDPSampler(ds, num_replicas=2, rank=0, seed=1)
    new = _update_dataloader(original, sampler)
    assert type(new) is ResumableDataLoader
    assert new.sampler is sampler and new.batch_size == 5
    full = _as_lists(new)
    again = _update_dataloader(original, sampler)
    again.load_state_dict({"batches_yielded": 3})
    assert _as_lists(again) == full[3:]
    # picklable for spawn
    assert _as_lists(pickle.loads(pickle.dumps(again))) == full


def test_persistent_workers_resume() -> None:
    full = _as_lists(_loader())
    loader = _loader(num_workers=2, persistent_workers=True)
    loader.load_state_dict({"batches_yielded": 6, "sampler_epoch": 2})
    assert _as_lists(loader) == full[6:]
    assert _as_lists(loader) == full
    loader.load_state_dict({"batches_yielded": 10, "sampler_epoch": 2})  # reused workers, armed again
    assert _as_lists(loader) == full[10:]


# ---------------------------------------------------------------------------------------------------------
# Lightning end to end: resume from every mid-epoch checkpoint sees exactly the uninterrupted batches
# ---------------------------------------------------------------------------------------------------------


def _fit_recording(tmp_path, ckpt_path=None, save=False, limit_train_batches=None):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list[tuple[int, list[int]]] = []

        def training_step(self, batch, batch_idx):
            (x,) = batch
            self.seen.append((self.current_epoch, x.tolist()))
            return self.layer(x.float().unsqueeze(1)).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self):
            ds = TensorDataset(torch.arange(22))
            return ResumableDataLoader(ds, batch_size=4, sampler=SelDPSampler(ds, num_replicas=1, rank=0, seed=7))

    callbacks = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)] if save else []
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=save,
        callbacks=callbacks,
        limit_train_batches=limit_train_batches,
        num_sanity_val_steps=0,
    )
    model = Recorder()
    trainer.fit(model, ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("limit_train_batches", [None, 4])
def test_lightning_mid_epoch_resume(tmp_path, limit_train_batches) -> None:
    # (a plain DataLoader fails this test: Lightning restarts it from its first batch)
    full = _fit_recording(tmp_path, save=True, limit_train_batches=limit_train_batches)
    per_epoch = 6 if limit_train_batches is None else 4
    assert len(full) == 3 * per_epoch
    # mid-epoch, last batch of an epoch (with limit_train_batches: the loader is not exhausted), next epoch
    steps = [2, per_epoch, per_epoch + 3] if limit_train_batches is None else [per_epoch, per_epoch + 1]
    for step in steps:
        (ckpt,) = list(tmp_path.glob(f"*-step={step}.ckpt"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = _fit_recording(tmp_path / "resumed", ckpt_path=str(ckpt), limit_train_batches=limit_train_batches)
        assert resumed == full[step:], f"resume from step {step}"
        assert not [w for w in caught if "not resumable" in str(w.message)]


# ---------------------------------------------------------------------------------------------------------
# DigitsDataModule
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits() -> DigitsDataModule:
    dm = DigitsDataModule(batch_size=64, seed=0)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_digits_split_sizes_and_disjoint(digits: DigitsDataModule) -> None:
    idx = digits.split_indices
    sizes = {k: v.numel() for k, v in idx.items()}
    assert sum(sizes.values()) == 1797
    assert sizes["test"] == round(0.2 * 1797) and sizes["val"] == round(0.1 * 1797)
    assert (len(digits.train_dataset), len(digits.val_dataset), len(digits.test_dataset)) == (
        sizes["train"],
        sizes["val"],
        sizes["test"],
    )
    all_idx = torch.cat(list(idx.values()))
    assert torch.equal(all_idx.sort().values, torch.arange(1797))


def test_digits_stratified(digits: DigitsDataModule) -> None:
    for ds in (digits.train_dataset, digits.val_dataset, digits.test_dataset):
        counts = torch.bincount(ds.tensors[1], minlength=10).float()
        props = counts / counts.sum()
        assert (props - 0.1).abs().max() < 0.02


def test_digits_deterministic_by_seed(digits: DigitsDataModule) -> None:
    same = DigitsDataModule(seed=0)
    same.setup()
    other = DigitsDataModule(seed=1)
    other.setup()
    for k in ("train", "val", "test"):
        assert torch.equal(same.split_indices[k], digits.split_indices[k])
    assert not torch.equal(other.split_indices["test"], digits.split_indices["test"])
    assert torch.equal(same.train_dataset.tensors[0], digits.train_dataset.tensors[0])


def test_digits_shapes_dtypes_and_standardisation(digits: DigitsDataModule) -> None:
    x, y = digits.train_dataset.tensors
    assert x.shape[1:] == (1, 8, 8) == digits.input_shape
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert DigitsDataModule.num_classes == 10 and int(y.min()) == 0 and int(y.max()) == 9
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1.0) < 1e-3
    xb, yb = next(iter(digits.train_dataloader()))
    assert xb.shape == (64, 1, 8, 8) and yb.shape == (64,)
    assert isinstance(digits.train_dataloader(), ResumableDataLoader)
    val = digits.val_dataloader()
    assert not isinstance(val, ResumableDataLoader)
    assert torch.equal(torch.cat([b[1] for b in val]), digits.val_dataset.tensors[1])  # in order
    assert sum(len(b[1]) for b in digits.test_dataloader()) == len(digits.test_dataset)

    flat = DigitsDataModule(flatten=True)
    assert flat.input_shape == (64,)
    flat.setup()
    assert flat.train_dataset.tensors[0].shape[1:] == (64,)
    assert torch.allclose(flat.train_dataset.tensors[0], x.reshape(-1, 64))


def test_digits_picklable_and_lazy() -> None:
    dm = DigitsDataModule(batch_size=8)
    assert dm.train_dataset is None
    dm2 = pickle.loads(pickle.dumps(dm))
    assert dm2.batch_size == 8 and dm2.hparams["batch_size"] == 8
    dm2.setup()
    assert len(dm2.train_dataset) > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"test_fraction": -0.1}, "test_fraction"),
        ({"val_fraction": 0.5, "test_fraction": 0.5}, "val_fraction \\+ test_fraction"),
        ({"num_workers": -1}, "num_workers"),
    ],
)
def test_digits_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DigitsDataModule(**kwargs)
