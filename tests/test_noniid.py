"""Non-IID partitioners (SelSync paper §II-B, §III-E): LabelSkew, Dirichlet, label histograms."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from lightning_sync.data.noniid import Dirichlet, LabelSkew, format_label_counts, label_counts

# 10 classes of unequal sizes (20, 23, ..., 47 samples), labels interleaved so indices are not sorted by class
SIZES = [20 + 3 * c for c in range(10)]
_G = torch.Generator().manual_seed(123)
LABELS = torch.cat([torch.full((n,), c) for c, n in enumerate(SIZES)])[torch.randperm(sum(SIZES), generator=_G)]
M = LABELS.numel()
DATASET = TensorDataset(torch.arange(M, dtype=torch.float32).unsqueeze(1), LABELS)


def _digits_labels() -> torch.Tensor:
    from sklearn.datasets import load_digits

    return torch.as_tensor(load_digits().target)


def _all_ranks(cls, n, *args, **kw):
    return [cls(DATASET, *args, num_replicas=n, rank=r, **kw) for r in range(n)]


def _labels_of(part) -> set[int]:
    return set(LABELS[torch.as_tensor(part, dtype=torch.int64)].tolist())


def _check_cover(partition, m=M):
    flat = [i for part in partition for i in part]
    assert len(flat) == len(set(flat)) == m
    assert set(flat) == set(range(m))


# ------------------------------------------------------------------------------------------------ disjoint cover
@pytest.mark.parametrize("n", range(1, 7))
def test_label_skew_disjoint_cover(n):
    for k in range(math.ceil(10 / n), 11):
        s = LabelSkew(DATASET, k, num_replicas=n, rank=0, seed=n + k)
        assert len(s.partition) == n
        _check_cover(s.partition)
        # exactly k distinct labels per rank, also when N*k is not a multiple of C
        assert all(len(_labels_of(p)) == k for p in s.partition)


@pytest.mark.parametrize("n", range(1, 7))
@pytest.mark.parametrize("alpha", [0.05, 0.5, 10.0])
def test_dirichlet_disjoint_cover(n, alpha):
    s = Dirichlet(DATASET, alpha, num_replicas=n, rank=n - 1, seed=7)
    assert len(s.partition) == n
    _check_cover(s.partition)
    assert min(s.part_sizes) >= 1


# ------------------------------------------------------------------------------------------------------ LabelSkew
@pytest.mark.parametrize(("n", "k"), [(5, 2), (10, 1), (4, 5), (2, 5), (1, 10)])
def test_label_skew_exact_labels_divisible(n, k):
    ranks = _all_ranks(LabelSkew, n, k, seed=3)
    partition = ranks[0].partition
    for s in ranks[1:]:
        assert s.partition == partition  # identical on every rank
    shards = n * k // 10
    for part in partition:
        assert len(_labels_of(part)) == k
    # each class is split into N*k/C near-equal shards, held by N*k/C different ranks
    counts = label_counts(LABELS, partition)
    for c in range(10):
        held = counts[:, c][counts[:, c] > 0]
        assert held.numel() == shards
        assert int(held.sum()) == SIZES[c]
        assert int(held.max() - held.min()) <= 1


def test_label_skew_paper_setups():
    """1 label per worker on 10 workers (CIFAR10-like); 10 labels per worker (CIFAR100-like, 100 classes)."""
    s = LabelSkew(DATASET, 1, num_replicas=10, rank=0)
    assert sorted(next(iter(_labels_of(p))) for p in s.partition) == list(range(10))
    labels100 = torch.arange(100).repeat(5)
    ds100 = TensorDataset(torch.zeros(500, 1), labels100)
    s = LabelSkew(ds100, 10, num_replicas=10, rank=0)
    _check_cover(s.partition, 500)
    assert all(len(set(labels100[p].tolist())) == 10 for p in s.partition)
    assert all(len(p) == 50 for p in s.partition)


def test_label_skew_non_divisible_rule():
    # N*k = 12 shards for C = 10 classes: the 2 largest classes (9 and 8) are split in two, the others not
    s = LabelSkew(DATASET, 3, num_replicas=4, rank=0, seed=1)
    counts = label_counts(LABELS, s.partition)
    ranks_per_class = (counts > 0).sum(0).tolist()
    assert ranks_per_class == [1] * 8 + [2, 2]
    assert (counts > 0).sum(1).tolist() == [3, 3, 3, 3]


def test_label_skew_deterministic_and_seeded():
    a = LabelSkew(DATASET, 2, num_replicas=5, rank=0, seed=11)
    b = LabelSkew(DATASET, 2, num_replicas=5, rank=3, seed=11)
    c = LabelSkew(DATASET, 2, num_replicas=5, rank=0, seed=12)
    assert a.partition == b.partition
    assert a.partition != c.partition
    # the label deal itself (which labels go to which rank) depends on the seed
    deals = {
        seed: tuple(
            frozenset(_labels_of(p)) for p in LabelSkew(DATASET, 2, num_replicas=5, rank=0, seed=seed).partition
        )
        for seed in range(5)
    }
    assert len(set(deals.values())) > 1
    assert deals[0] == tuple(frozenset(_labels_of(p)) for p in LabelSkew(DATASET, 2, num_replicas=5, rank=4).partition)


def test_label_skew_digits():
    y = _digits_labels()
    ds = TensorDataset(torch.zeros(len(y), 1), y)
    s = LabelSkew(ds, 2, num_replicas=5, rank=2)
    _check_cover(s.partition, len(y))
    assert all(len(set(y[p].tolist())) == 2 for p in s.partition)


# ------------------------------------------------------------------------------------------------------ Dirichlet
def _mean_max_share(partition) -> float:
    counts = label_counts(LABELS, partition).double()
    share = counts.max(1).values / counts.sum(1)
    return float(share.mean())


def test_dirichlet_deterministic_by_seed():
    a = Dirichlet(DATASET, 0.5, num_replicas=4, rank=0, seed=5)
    b = Dirichlet(DATASET, 0.5, num_replicas=4, rank=2, seed=5)
    c = Dirichlet(DATASET, 0.5, num_replicas=4, rank=0, seed=6)
    assert a.partition == b.partition
    assert torch.equal(a.label_counts(), b.label_counts())
    assert not torch.equal(a.label_counts(), c.label_counts())


def test_dirichlet_alpha_controls_skew():
    for n in (4, 6):
        skewed = [_mean_max_share(Dirichlet(DATASET, 0.1, num_replicas=n, rank=0, seed=s).partition) for s in range(5)]
        iid = [_mean_max_share(Dirichlet(DATASET, 100.0, num_replicas=n, rank=0, seed=s).partition) for s in range(5)]
        assert sum(skewed) / 5 > sum(iid) / 5 + 0.2
        assert max(iid) < 0.3  # close to the global mix (largest class is 47/335 = 0.14)


def test_dirichlet_min_samples():
    for seed in range(5):
        s = Dirichlet(DATASET, 0.1, num_replicas=6, rank=0, seed=seed, min_samples=30)
        assert min(s.part_sizes) >= 30
        assert 1 <= s.attempts <= Dirichlet.max_attempts
        _check_cover(s.partition)
    with pytest.raises(ValueError, match="min_samples"):
        Dirichlet(DATASET, 0.01, num_replicas=6, rank=0, min_samples=55)  # ~M / N: never drawn
    with pytest.raises(ValueError, match="min_samples"):
        Dirichlet(DATASET, 1.0, num_replicas=6, rank=0, min_samples=M // 6 + 1)  # impossible outright


def test_dirichlet_tiny_alpha_underflow():
    s = Dirichlet(DATASET, 1e-4, num_replicas=3, rank=0, min_samples=1)
    _check_cover(s.partition)
    # alpha -> 0: every class on a single rank
    assert ((label_counts(LABELS, s.partition) > 0).sum(0) == 1).all()


def test_dirichlet_empty_part_needs_truncate():
    with pytest.raises(ValueError, match="min_samples"):
        Dirichlet(DATASET, 1e-4, num_replicas=12, rank=0, min_samples=0)  # 10 classes, 12 ranks: some rank empty
    s = Dirichlet(DATASET, 1e-4, num_replicas=12, rank=0, min_samples=0, equalize="truncate")
    assert len(s) == 0 and list(s) == []


# -------------------------------------------------------------------------------------------------- equalisation
@pytest.mark.parametrize(("cls", "arg"), [(LabelSkew, 3), (Dirichlet, 0.3)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_equalize_repeat(cls, arg, shuffle):
    ranks = _all_ranks(cls, 4, arg, equalize="repeat", shuffle=shuffle, seed=2)
    sizes = ranks[0].part_sizes
    assert len(set(sizes)) > 1  # parts really are unequal
    for s in ranks:
        assert len(s) == max(sizes)
        for epoch in range(3):
            s.set_epoch(epoch)
            out = list(s)
            own = s.partition[s.rank]
            assert len(out) == len(s)
            assert set(out) == set(own)  # only own samples, all of them
            counts = Counter(out)
            lo, hi = min(counts.values()), max(counts.values())
            assert hi - lo <= 1  # cyclic: repeated at most one more time than any other
            n = len(own)
            if len(out) > n:
                assert out[n:] == out[: len(out) - n]  # repeats follow the epoch's order


@pytest.mark.parametrize("shuffle", [True, False])
def test_equalize_truncate(shuffle):
    ranks = _all_ranks(Dirichlet, 4, 0.3, equalize="truncate", shuffle=shuffle, seed=2)
    smallest = min(ranks[0].part_sizes)
    for s in ranks:
        assert len(s) == smallest
        seen = []
        for epoch in range(4):
            s.set_epoch(epoch)
            out = list(s)
            assert len(out) == len(set(out)) == smallest
            assert set(out) <= set(s.partition[s.rank])
            seen.append(set(out))
        if shuffle and len(s.partition[s.rank]) > smallest:
            assert len({frozenset(x) for x in seen}) > 1  # different samples dropped per epoch
        if not shuffle:
            assert all(x == seen[0] for x in seen)


def test_set_epoch_changes_order():
    s = LabelSkew(DATASET, 2, num_replicas=5, rank=1, seed=0)
    e0 = list(s)
    assert list(s) == e0  # same epoch: same order
    s.set_epoch(1)
    e1 = list(s)
    assert e1 != e0 and set(e1) == set(e0)  # own part reordered (repeated samples may differ)
    # shuffle=False: own part in dataset order, every epoch
    t = LabelSkew(DATASET, 2, num_replicas=5, rank=1, seed=0, shuffle=False, equalize="truncate")
    t.set_epoch(3)
    assert list(t) == sorted(t.partition[1])[: len(t)]


def test_drop_last_has_no_effect_on_indices():
    a = LabelSkew(DATASET, 3, num_replicas=4, rank=1, drop_last=False)
    b = LabelSkew(DATASET, 3, num_replicas=4, rank=1, drop_last=True)
    assert len(a) == len(b) and list(a) == list(b) and b.drop_last


# ---------------------------------------------------------------------------------------------- counts / summary
def test_label_counts_and_summary():
    s = LabelSkew(DATASET, 3, num_replicas=4, rank=0)
    counts = s.label_counts()
    assert counts.shape == (4, 10) and counts.dtype == torch.int64
    assert counts.sum(1).tolist() == s.part_sizes
    assert counts.sum(0).tolist() == SIZES
    assert torch.equal(label_counts(LABELS.tolist(), s.partition, num_classes=12)[:, :10], counts)
    table = s.summary()
    lines = table.splitlines()
    assert len(lines) == 1 + 4
    assert lines[0].split()[:3] == ["rank", "total", "labels"]
    for r, line in enumerate(lines[1:]):
        cells = [int(x) for x in line.split()]
        assert cells[0] == r and cells[1] == s.part_sizes[r] and cells[2] == 3 and cells[3:] == counts[r].tolist()
    assert format_label_counts(torch.zeros(2, 0, dtype=torch.int64)).count("\n") == 2
    with pytest.raises(ValueError, match="counts"):
        format_label_counts(torch.zeros(3))
    with pytest.raises(ValueError, match="num_classes"):
        label_counts(LABELS, s.partition, num_classes=5)
    with pytest.raises(ValueError, match="partition"):
        label_counts(LABELS, [[M]])


# ------------------------------------------------------------------------------------------------ label lookup
class _Targets(Dataset):
    def __init__(self, labels):
        self.targets = list(labels)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        raise AssertionError("labels must come from .targets")


class _LabelsAttr(_Targets):
    def __init__(self, labels):
        self.labels = torch.as_tensor(labels)

    def __len__(self):
        return len(self.labels)


class _Pairs(Dataset):
    def __init__(self, labels):
        self.y = list(labels)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.zeros(1), torch.tensor(self.y[i])


class _NoLabels(Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return torch.zeros(1)


def test_label_lookup_order():
    ref = LabelSkew(DATASET, 2, num_replicas=5, rank=0).partition
    for ds in (_Targets(LABELS.tolist()), _LabelsAttr(LABELS), _Pairs(LABELS.tolist())):
        assert LabelSkew(ds, 2, num_replicas=5, rank=0).partition == ref
    # explicit labels= wins over the dataset's own
    perm = (LABELS + 1) % 10
    assert (
        LabelSkew(DATASET, 2, num_replicas=5, rank=0, labels=perm).partition
        == LabelSkew(_Targets(perm.tolist()), 2, num_replicas=5, rank=0).partition
    )
    with pytest.raises(ValueError, match="labels="):
        LabelSkew(_NoLabels(), 1, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="one label per sample"):
        LabelSkew(DATASET, 1, num_replicas=1, rank=0, labels=[0, 1])
    with pytest.raises(ValueError, match="non-negative"):
        LabelSkew(_Targets([0, -1]), 1, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="integers"):
        LabelSkew(_Targets([0.5, 1.0]), 1, num_replicas=1, rank=0)


# -------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"labels_per_rank": 0}, "labels_per_rank"),
        ({"labels_per_rank": 11}, "labels_per_rank"),
        ({"labels_per_rank": 2, "num_replicas": 4}, "labels_per_rank"),  # 4 * 2 < 10
        ({"labels_per_rank": 1.5}, "labels_per_rank"),
        ({"labels_per_rank": True}, "labels_per_rank"),
        ({"equalize": "pad"}, "equalize"),
        ({"num_replicas": 0}, "num_replicas"),
        ({"rank": 5}, "rank"),
        ({"rank": -1}, "rank"),
        ({"seed": -1}, "seed"),
    ],
)
def test_label_skew_bad_input(kwargs, name):
    kw = {"labels_per_rank": 2, "num_replicas": 5, "rank": 0, **kwargs}
    with pytest.raises(ValueError, match=name):
        LabelSkew(DATASET, **kw)


def test_label_skew_class_too_small():
    labels = torch.tensor([0] * 10 + [1])  # class 1 has one sample but would be split into 2 shards
    with pytest.raises(ValueError, match="labels_per_rank"):
        LabelSkew(TensorDataset(torch.zeros(11, 1), labels), 1, num_replicas=4, rank=0)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": -1.0}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"alpha": float("inf")}, "alpha"),
        ({"equalize": "none"}, "equalize"),
        ({"num_replicas": 0}, "num_replicas"),
        ({"rank": 4}, "rank"),
        ({"min_samples": -1}, "min_samples"),
    ],
)
def test_dirichlet_bad_input(kwargs, name):
    kw = {"alpha": 1.0, "num_replicas": 4, "rank": 0, **kwargs}
    with pytest.raises(ValueError, match=name):
        Dirichlet(DATASET, **kw)


def test_pickle_and_repr():
    import pickle

    s = Dirichlet(DATASET, 0.5, num_replicas=3, rank=1, seed=4)
    s.set_epoch(2)
    t = pickle.loads(pickle.dumps(s))
    assert list(t) == list(s) and t.partition == s.partition
    assert "Dirichlet(alpha=0.5" in repr(s) and "rank=1" in repr(s)
    assert "LabelSkew(labels_per_rank=2" in repr(LabelSkew(DATASET, 2, num_replicas=5, rank=0))


# -------------------------------------------------------------------------------------------------- Lightning
K_DIGITS = 5  # 2 ranks x 5 labels cover the 10 digit classes (N * k >= C)
BATCH = 32


def _fit_skewed(rank: int, out: str) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    import lightning_sync
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.models import DigitsCNN

    dm = DigitsDataModule(batch_size=BATCH)
    dm.setup("fit")
    dataset = dm.train_dataset
    sampler = LabelSkew(dataset, labels_per_rank=K_DIGITS, num_replicas=2, rank=rank, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.steps = 0
            self.labels: set[int] = set()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.steps += 1
            self.labels.update(batch[1].tolist())

    rec = Record()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_sync.BSPStrategy(),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[rec],
    )
    trainer.fit(DigitsCNN(), train_dataloaders=loader)
    used = trainer.train_dataloader.sampler
    result = {
        "steps": rec.steps,
        "num_training_batches": trainer.num_training_batches,
        "global_step": trainer.global_step,
        "status": str(trainer.state.status.value),
        "finished": bool(trainer.state.finished),
        "epoch": trainer.current_epoch,
        "sampler": type(used).__name__,
        "len": len(sampler),
        "part_sizes": sampler.part_sizes,
        "own_labels": sorted(_labels_of_ds(dataset, sampler.partition[rank])),
        "seen_labels": sorted(rec.labels),
    }
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def _labels_of_ds(dataset, part) -> set[int]:
    return set(dataset.tensors[1][torch.as_tensor(part, dtype=torch.int64)].tolist())


def test_bsp_epoch_on_label_skew(tmp_path):
    from lightning_sync.launch import launch_local

    launch_local(_fit_skewed, 2, str(tmp_path))
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = math.ceil(res[0]["len"] / BATCH)
    assert res[0]["part_sizes"] == res[1]["part_sizes"]
    assert res[0]["part_sizes"][0] != res[0]["part_sizes"][1]  # unequal parts: rank padding exercised
    assert res[0]["len"] == res[1]["len"] == max(res[0]["part_sizes"])
    for r in res:
        assert r["sampler"] == "LabelSkew"  # Lightning kept the DistributedSampler subclass
        assert r["steps"] == r["num_training_batches"] == r["global_step"] == expected
        assert r["status"] == "finished" and r["finished"]
        assert r["epoch"] == 1
        assert len(r["own_labels"]) == K_DIGITS
        assert r["seen_labels"] == r["own_labels"]
    assert set(res[0]["own_labels"]).isdisjoint(res[1]["own_labels"])
