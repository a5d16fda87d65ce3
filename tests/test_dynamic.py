"""Dynamic work assignment: DynamicBatchSampler, LocalCounter and dynamic_loader (in-process, no torch.distributed)."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from lightning_sync.data import DynamicBatchSampler, LocalCounter, SelDPSampler, dynamic_loader
from lightning_sync.launch import quiet_trainer_kwargs


class _Exhausted:
    """on_exhausted recorder: list of epochs it was called with."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self._lock = threading.Lock()

    def __call__(self, epoch: int) -> None:
        with self._lock:
            self.calls.append(epoch)


def _ranks(counter: LocalCounter, n: int, num_samples: int, batch_size: int, **kw) -> list[DynamicBatchSampler]:
    return [DynamicBatchSampler(num_samples, batch_size, counter.claim, **kw) for _ in range(n)]


def _interleaved(samplers: list[DynamicBatchSampler], rng: random.Random, weights: list[int] | None = None):
    """Advance the samplers in random order until all stop; returns per-rank lists of (position, batch)."""
    iters = {r: iter(s) for r, s in enumerate(samplers)}
    got: dict[int, list[tuple[int, list[int]]]] = {r: [] for r in iters}
    weights = weights or [1] * len(samplers)
    while iters:
        live = sorted(iters)
        r = rng.choices(live, weights=[weights[i] for i in live])[0]
        try:
            batch = next(iters[r])
        except StopIteration:
            del iters[r]
            continue
        got[r].append((samplers[r].positions[-1], batch))
    return got


def _expected_batches(num_samples: int, batch_size: int, seed: int, epoch: int, shuffle: bool, drop_last: bool):
    if shuffle:
        order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        order = list(range(num_samples))
    n = num_samples // batch_size if drop_last else -(-num_samples // batch_size)
    return [order[k * batch_size : (k + 1) * batch_size] for k in range(n)]


def _check_epoch(got, samplers, num_samples, batch_size, seed, epoch, shuffle, drop_last) -> None:
    expected = _expected_batches(num_samples, batch_size, seed, epoch, shuffle, drop_last)
    pairs = [pb for r in sorted(got) for pb in got[r]]
    # every batch position yielded exactly once in total, with the batch of the shared order at that position
    assert sorted(p for p, _ in pairs) == list(range(len(expected)))
    for p, batch in pairs:
        assert batch == expected[p]
    indices = Counter(i for _, b in pairs for i in b)
    if drop_last:
        assert sum(indices.values()) == len(expected) * batch_size
        assert max(indices.values(), default=1) == 1
    else:
        assert indices == Counter(range(num_samples))  # the dataset, each sample exactly once
    for r, s in enumerate(samplers):
        assert s.batches_yielded == len(got[r])
        assert s.positions == [p for p, _ in got[r]]
        assert s.positions == sorted(s.positions)  # a counter only grows


# -- sampler -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_samples,batch_size", [(50, 4), (48, 4), (7, 10), (1, 1), (101, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_interleaved_ranks_cover_every_position_once(num_samples, batch_size, drop_last, shuffle):
    rng = random.Random(num_samples * 7 + batch_size)
    counter = LocalCounter()
    exhausted = _Exhausted()
    samplers = _ranks(
        counter, 3, num_samples, batch_size, shuffle=shuffle, seed=5, drop_last=drop_last, on_exhausted=exhausted
    )
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        got = _interleaved(samplers, rng)
        _check_epoch(got, samplers, num_samples, batch_size, 5, epoch, shuffle, drop_last)
        # one claim per batch plus exactly one past-the-end claim per rank
        assert counter.claimed(epoch) == samplers[0].num_batches + 3
    assert Counter(exhausted.calls) == {0: 3, 1: 3, 2: 3}  # once per rank per epoch


def test_threads_share_one_counter():
    num_samples, batch_size, n_ranks = 997, 5, 3
    counter = LocalCounter()
    exhausted = _Exhausted()
    samplers = _ranks(counter, n_ranks, num_samples, batch_size, seed=11, on_exhausted=exhausted)
    for epoch in range(2):
        got: dict[int, list[tuple[int, list[int]]]] = {}
        barrier = threading.Barrier(n_ranks)

        def work(r: int, epoch: int = epoch, got: dict = got, barrier: threading.Barrier = barrier) -> None:
            s = samplers[r]
            s.set_epoch(epoch)
            out = []
            barrier.wait()
            for batch in s:
                out.append((s.positions[-1], batch))
                time.sleep(0)  # yield the GIL so the ranks interleave
            got[r] = out

        threads = [threading.Thread(target=work, args=(r,)) for r in range(n_ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
        _check_epoch(got, samplers, num_samples, batch_size, 11, epoch, True, False)
    assert Counter(exhausted.calls) == {0: n_ranks, 1: n_ranks}


def test_reshuffle_per_epoch_and_identical_across_ranks():
    a, b = _ranks(LocalCounter(), 2, 64, 8, seed=3)
    c = DynamicBatchSampler(64, 8, LocalCounter().claim, seed=4)
    assert torch.equal(a.order(0), b.order(0))
    assert torch.equal(a.order(1), b.order(1))
    assert not torch.equal(a.order(0), a.order(1))
    assert not torch.equal(a.order(0), c.order(0))  # another seed, another order
    assert sorted(a.order(1).tolist()) == list(range(64))
    # order() follows set_epoch, and rank b's batch at a position is rank a's order at that position
    b.set_epoch(1)
    assert torch.equal(b.order(), a.order(1))
    a.set_epoch(1)
    first_a = next(iter(a))  # position 0
    first_b = next(iter(b))  # position 1
    assert first_a + first_b == a.order(1)[:16].tolist()
    assert DynamicBatchSampler(10, 3, LocalCounter().claim, shuffle=False).order(5).tolist() == list(range(10))


def test_fast_rank_gets_proportionally_more_batches():
    counter = LocalCounter()
    fast, slow = _ranks(counter, 2, 4000, 10, seed=0)
    it_fast, it_slow = iter(fast), iter(slow)
    done = set()
    while len(done) < 2:
        for name, it, times in (("fast", it_fast, 3), ("slow", it_slow, 1)):  # fast is asked 3x as often
            for _ in range(times):
                if name in done:
                    break
                try:
                    next(it)
                except StopIteration:
                    done.add(name)
    assert fast.batches_yielded + slow.batches_yielded == 400
    assert fast.batches_yielded == pytest.approx(300, abs=3)
    assert slow.batches_yielded == pytest.approx(100, abs=3)


def test_claims_are_lazy_and_exhaustion_fires_once():
    counter = LocalCounter()
    exhausted = _Exhausted()
    s = DynamicBatchSampler(10, 4, counter.claim, on_exhausted=exhausted)
    it = iter(s)
    assert counter.claimed(0) == 0 and s.batches_yielded == 0 and s.positions == []
    next(it)
    assert counter.claimed(0) == 1
    next(it), next(it)
    assert counter.claimed(0) == 3 and exhausted.calls == []
    for _ in range(3):  # a DataLoader keeps calling next on an exhausted sampler iterator
        with pytest.raises(StopIteration):
            next(it)
    assert exhausted.calls == [0] and counter.claimed(0) == 4
    # a new iteration resets the per-iteration state; the spent epoch-0 counter gives nothing more
    assert list(s) == [] and s.batches_yielded == 0 and s.positions == [] and exhausted.calls == [0, 0]
    s.set_epoch(1)
    assert len(list(s)) == 3 and s.positions == [0, 1, 2] and exhausted.calls == [0, 0, 1]


def test_drop_last_semantics():
    full = list(DynamicBatchSampler(10, 4, LocalCounter().claim, shuffle=False))
    assert full == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    dropped = DynamicBatchSampler(10, 4, LocalCounter().claim, shuffle=False, drop_last=True)
    assert dropped.num_batches == 2 and list(dropped) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert DynamicBatchSampler(3, 4, LocalCounter().claim, drop_last=True).num_batches == 0
    assert list(DynamicBatchSampler(3, 4, LocalCounter().claim, drop_last=True)) == []
    assert DynamicBatchSampler(12, 4, LocalCounter().claim, drop_last=True).num_batches == 3


def test_no_len_so_dataloader_is_unsized():
    ds = TensorDataset(torch.arange(20.0))
    s = DynamicBatchSampler(20, 4, LocalCounter().claim)
    assert not hasattr(s, "__len__")
    with pytest.raises(TypeError):
        len(s)  # type: ignore[arg-type]
    loader = DataLoader(ds, batch_sampler=s)
    with pytest.raises(TypeError):
        len(loader)
    assert sum(len(b[0]) for b in loader) == 20


def test_lightning_set_sampler_epoch_reaches_the_batch_sampler():
    from lightning.fabric.utilities.data import _set_sampler_epoch, sized_len

    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_sampler=DynamicBatchSampler(8, 2, LocalCounter().claim))
    _set_sampler_epoch(loader, 4)
    assert loader.batch_sampler.epoch == 4
    assert sized_len(loader) is None  # Lightning sees an unsized loader


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_samples": 0}, "num_samples"),
        ({"num_samples": 2.5}, "num_samples"),
        ({"num_samples": True}, "num_samples"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": "4"}, "batch_size"),
        ({"seed": -1}, "seed"),
        ({"seed": None}, "seed"),
        ({"claim": 3}, "claim"),
        ({"on_exhausted": "x"}, "on_exhausted"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"num_samples": 10, "batch_size": 2, "claim": LocalCounter().claim, **kwargs}
    with pytest.raises(ValueError, match=match):
        DynamicBatchSampler(**args)


def test_bad_epoch_and_bad_claims():
    s = DynamicBatchSampler(10, 2, LocalCounter().claim)
    with pytest.raises(ValueError, match="epoch"):
        s.set_epoch(-1)
    with pytest.raises(RuntimeError, match="negative"):
        next(iter(DynamicBatchSampler(10, 2, lambda epoch: -1)))
    with pytest.raises(RuntimeError, match="must return an int"):
        next(iter(DynamicBatchSampler(10, 2, lambda epoch: 1.0)))  # type: ignore[arg-type,return-value]


def test_local_counter_is_per_epoch_and_thread_safe():
    counter = LocalCounter()
    assert [counter.claim(0) for _ in range(3)] == [0, 1, 2]
    assert counter.claim(1) == 0 and counter.claimed(0) == 3
    results: list[int] = []

    def work() -> None:
        got = [counter.claim(7) for _ in range(2000)]
        results.extend(got)  # list.extend is atomic under the GIL

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(8000))


# -- dynamic_loader ---------------------------------------------------------------------------------------


def _collate(batch):
    return torch.stack([x for (x,) in batch])


def _worker_init(worker_id: int) -> None:
    torch.manual_seed(worker_id)


def test_dynamic_loader_keeps_settings_and_works_with_workers():
    ds = TensorDataset(torch.arange(40.0))
    gen = torch.Generator().manual_seed(1)
    original = DataLoader(
        ds,
        batch_size=3,
        shuffle=True,
        num_workers=2,
        collate_fn=_collate,
        pin_memory=False,
        worker_init_fn=_worker_init,
        persistent_workers=True,
        timeout=20.0,
        prefetch_factor=3,
        multiprocessing_context="fork",
        generator=gen,
    )
    counter = LocalCounter()
    exhausted = _Exhausted()
    loader = dynamic_loader(original, counter.claim, on_exhausted=exhausted, seed=9)
    assert type(loader) is DataLoader and loader is not original and loader.dataset is ds
    for name in (
        "num_workers",
        "collate_fn",
        "pin_memory",
        "pin_memory_device",
        "worker_init_fn",
        "persistent_workers",
        "timeout",
        "prefetch_factor",
        "multiprocessing_context",
        "generator",
    ):
        assert getattr(loader, name) == getattr(original, name), name
    s = loader.batch_sampler
    assert isinstance(s, DynamicBatchSampler)
    assert (s.num_samples, s.batch_size, s.shuffle, s.seed, s.drop_last) == (40, 3, True, 9, False)
    with pytest.raises(TypeError):
        len(loader)
    for epoch in range(2):  # persistent workers re-iterate the same batch sampler
        s.set_epoch(epoch)
        batches = [b.tolist() for b in loader]
        assert sorted(int(x) for b in batches for x in b) == list(range(40))
        assert batches == [[float(i) for i in b] for b in _expected_batches(40, 3, 9, epoch, True, False)]
    assert exhausted.calls == [0, 1]


def test_dynamic_loader_takes_shuffle_and_seed_from_the_sampler():
    ds = TensorDataset(torch.arange(30.0))
    claim = LocalCounter().claim
    dist = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=3, rank=2, shuffle=True, seed=7))
    s = dynamic_loader(dist, claim).batch_sampler
    assert (s.num_samples, s.shuffle, s.seed) == (30, True, 7)  # the whole dataset, not the rank's shard
    assert dynamic_loader(dist, claim, seed=2).batch_sampler.seed == 2
    no_shuffle = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=3, rank=0, shuffle=False))
    assert dynamic_loader(no_shuffle, claim).batch_sampler.shuffle is False
    rand = dynamic_loader(DataLoader(ds, batch_size=4, shuffle=True, drop_last=True), claim).batch_sampler
    assert (rand.shuffle, rand.seed, rand.drop_last, rand.num_batches) == (True, 0, True, 7)
    seq = dynamic_loader(DataLoader(ds, batch_size=4), claim, seed=5).batch_sampler
    assert (seq.shuffle, seq.seed) == (False, 5)


def test_dynamic_loader_on_a_lightning_prepared_loader():
    from lightning.pytorch.utilities.data import _update_dataloader

    ds = TensorDataset(torch.arange(24.0))
    user = DataLoader(ds, batch_size=5, shuffle=True, collate_fn=_collate, drop_last=True)
    # what Lightning does under use_distributed_sampler=True
    prepared = _update_dataloader(user, DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=4))
    loader = dynamic_loader(prepared, LocalCounter().claim)
    s = loader.batch_sampler
    assert (s.num_samples, s.batch_size, s.shuffle, s.seed, s.drop_last) == (24, 5, True, 4, True)
    assert loader.collate_fn is _collate
    assert [b.tolist() for b in loader] == [[float(i) for i in b] for b in _expected_batches(24, 5, 4, 0, True, True)]


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


class _MyBatchSampler(BatchSampler):
    pass


class _MyDistributedSampler(DistributedSampler):
    pass


def _unsupported_loaders():
    ds = TensorDataset(torch.arange(10.0))
    return {
        "iterable": DataLoader(_Stream(), batch_size=2),
        "batch_size_none": DataLoader(ds, batch_size=None),
        "custom_batch_sampler": DataLoader(ds, batch_sampler=_MyBatchSampler(SequentialSampler(ds), 2, False)),
        "list_batch_sampler": DataLoader(ds, batch_sampler=[[0, 1], [2, 3]]),
        "weighted": DataLoader(ds, batch_size=2, sampler=WeightedRandomSampler([1.0] * 10, 10)),
        "subset": DataLoader(ds, batch_size=2, sampler=SubsetRandomSampler([1, 2, 3])),
        "distributed_subclass": DataLoader(ds, batch_size=2, sampler=_MyDistributedSampler(ds, 2, 0)),
        "seldp": DataLoader(ds, batch_size=2, sampler=SelDPSampler(ds, 2, 0)),
        "replacement": DataLoader(ds, batch_size=2, sampler=RandomSampler(ds, replacement=True)),
        "already_dynamic": DataLoader(ds, batch_sampler=DynamicBatchSampler(10, 2, LocalCounter().claim)),
    }


@pytest.mark.parametrize("name", list(_unsupported_loaders()))
def test_dynamic_loader_rejects_unsupported_loaders(name):
    loader = _unsupported_loaders()[name]
    with pytest.raises(ValueError, match="dynamic_loader") as info:
        dynamic_loader(loader, LocalCounter().claim)
    if name != "already_dynamic":
        assert "map-style dataset with the default batch sampler" in str(info.value)


def test_dynamic_loader_bad_arguments():
    ds = TensorDataset(torch.arange(10.0))
    with pytest.raises(ValueError, match="DataLoader"):
        dynamic_loader([[0, 1]], LocalCounter().claim)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        dynamic_loader(DataLoader(ds, batch_size=2), LocalCounter().claim, seed=-3)
    with pytest.raises(ValueError, match="claim"):
        dynamic_loader(DataLoader(ds, batch_size=2), None)  # type: ignore[arg-type]


def test_lightning_fit_runs_dynamic_epochs_and_validates_at_epoch_end():
    import lightning.pytorch as pl

    seen: list[tuple[int, int]] = []
    val_at: list[tuple[int, int]] = []

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            seen.append((self.current_epoch, batch.numel()))
            return self.layer(batch.unsqueeze(1)).sum()

        def validation_step(self, batch, batch_idx):
            if batch_idx == 0:
                val_at.append((self.current_epoch, len([e for e, _ in seen if e == self.current_epoch])))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    ds = TensorDataset(torch.arange(22.0))
    exhausted = _Exhausted()
    train = dynamic_loader(
        DataLoader(ds, batch_size=4, shuffle=True, collate_fn=_collate), LocalCounter().claim, on_exhausted=exhausted
    )
    val = DataLoader(ds, batch_size=11, collate_fn=_collate)
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", devices=1, **quiet_trainer_kwargs())
    trainer.fit(Model(), train_dataloaders=train, val_dataloaders=val)
    for epoch in range(3):
        assert sum(n for e, n in seen if e == epoch) == 22  # the whole dataset every epoch
    assert val_at == [(0, 6), (1, 6), (2, 6)]  # validation after the 6th (last) batch of each epoch
    assert exhausted.calls == [0, 1, 2]  # Lightning's set_epoch reached the batch sampler
    assert train.batch_sampler.epoch == 2
