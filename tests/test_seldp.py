"""SelDP partitioning (SelSync paper §III-D, Fig. 7b): pure function and sampler."""

from __future__ import annotations

import math
import pickle
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sync.data import SelDPSampler, seldp_indices


def _cases() -> list[tuple[int, int]]:
    cases = set()
    for n in range(1, 6):
        for m in (n * 7, n * 7 + 1, n * 7 + n - 1, 1, n - 1, n + 1, 0):
            if m >= 0:
                cases.add((m, n))
    return sorted(cases)


CASES = _cases()


def _chunk(m: int, n: int, drop_last: bool) -> int:
    return m // n if drop_last else math.ceil(m / n)


def _all_ranks(m: int, n: int, **kw) -> list[list[int]]:
    return [seldp_indices(m, n, r, **kw) for r in range(n)]


def check_seldp_properties(m: int, n: int, epoch: int, seed: int, shuffle: bool, drop_last: bool) -> None:
    """All guarantees documented in seldp_indices, for one configuration."""
    c = _chunk(m, n, drop_last)
    ranks = _all_ranks(m, n, epoch=epoch, seed=seed, shuffle=shuffle, drop_last=drop_last)
    base = ranks[0]
    for r, idx in enumerate(ranks):
        # length: N * c, every index valid
        assert len(idx) == n * c
        assert all(0 <= i < m for i in idx)
        # circular queue of the same shared order: rank r is rank 0's sequence rotated by r * c
        assert idx == base[r * c :] + base[: r * c]
        counts = Counter(idx)
        if drop_last:
            # the n*c kept samples are distinct, the remainder is never seen
            assert len(counts) == n * c and max(counts.values(), default=1) == 1
            assert len(set(range(m)) - set(counts)) == m - n * c
        else:
            # every sample at least once
            assert set(counts) == set(range(m))
            if m % n == 0:
                assert all(v == 1 for v in counts.values())
            elif m >= n:
                # the n*c - m padded samples appear exactly twice
                assert sorted(counts.values()) == [1] * (m - (n * c - m)) + [2] * (n * c - m)
        # chunks seen by this rank: chunk (r + p // c) mod N at position p
        chunks = [idx[k * c : (k + 1) * c] for k in range(n)]
        base_chunks = [base[k * c : (k + 1) * c] for k in range(n)]
        assert chunks == [base_chunks[(r + k) % n] for k in range(n)]
    # every position: the N ranks are in N distinct chunks
    if c > 0:
        for p in range(n * c):
            assert sorted((r + p // c) % n for r in range(n)) == list(range(n))
            if drop_last or m % n == 0:
                # ... and therefore read N distinct samples
                assert len({ranks[r][p] for r in range(n)}) == n
    # all ranks use the same permutation: same multiset, same chunk contents
    assert all(Counter(idx) == Counter(base) for idx in ranks)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("m", "n"), CASES)
def test_seldp_properties(m: int, n: int, shuffle: bool, drop_last: bool) -> None:
    for epoch in (0, 3):
        check_seldp_properties(m, n, epoch, seed=11, shuffle=shuffle, drop_last=drop_last)


def test_fig7b_order_without_shuffle() -> None:
    # Fig. 7b: 4 workers, worker r reads DPr, DP(r+1), ... (mod 4)
    m, n = 8, 4
    assert seldp_indices(m, n, 0, shuffle=False) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert seldp_indices(m, n, 1, shuffle=False) == [2, 3, 4, 5, 6, 7, 0, 1]
    assert seldp_indices(m, n, 3, shuffle=False) == [6, 7, 0, 1, 2, 3, 4, 5]


def test_padding_and_drop_last_examples() -> None:
    # M=10, N=3: c=4, padded with samples 0, 1 (wrap around)
    assert seldp_indices(10, 3, 0, shuffle=False) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    assert seldp_indices(10, 3, 2, shuffle=False) == [8, 9, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7]
    # drop_last: c=3, sample 9 dropped
    assert seldp_indices(10, 3, 1, shuffle=False, drop_last=True) == [3, 4, 5, 6, 7, 8, 0, 1, 2]
    # M < N
    assert seldp_indices(1, 3, 2) == [0, 0, 0]
    assert seldp_indices(2, 5, 0, shuffle=False) == [0, 1, 0, 1, 0]
    assert seldp_indices(2, 5, 4, drop_last=True) == []
    assert seldp_indices(0, 2, 1) == []


def test_epochs_differ_and_ranks_agree() -> None:
    m, n = 40, 4
    e0 = _all_ranks(m, n, epoch=0, seed=5)
    e1 = _all_ranks(m, n, epoch=1, seed=5)
    assert e0[0] != e1[0]
    # same for every call (deterministic) and rank r is a rotation of rank 0 in each epoch
    assert e0 == _all_ranks(m, n, epoch=0, seed=5)
    for r in range(n):
        assert e1[r] == e1[0][r * 10 :] + e1[0][: r * 10]
    # seed changes the order too
    assert seldp_indices(m, n, 0, seed=6) != e0[0]
    # shuffle=False ignores epoch and seed
    assert seldp_indices(m, n, 2, epoch=7, seed=1, shuffle=False) == seldp_indices(m, n, 2, shuffle=False)


def test_same_permutation_as_distributed_sampler() -> None:
    # the shared order is DistributedSampler's: interleaving its shards rebuilds rank 0's SelDP order
    from torch.utils.data import DistributedSampler

    m, n, seed, epoch = 23, 3, 4, 2
    shards = []
    for r in range(n):
        s = DistributedSampler(range(m), num_replicas=n, rank=r, seed=seed)
        s.set_epoch(epoch)
        shards.append(list(s))
    padded = [shards[k % n][k // n] for k in range(n * len(shards[0]))]
    assert seldp_indices(m, n, 0, epoch=epoch, seed=seed) == padded


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("m", "n"), [(21, 3), (22, 3), (5, 5), (3, 5), (17, 1)])
def test_sampler_equals_function(m: int, n: int, shuffle: bool, drop_last: bool) -> None:
    data = list(range(m))
    for r in range(n):
        s = SelDPSampler(data, num_replicas=n, rank=r, shuffle=shuffle, seed=3, drop_last=drop_last)
        c = _chunk(m, n, drop_last)
        assert s.chunk_size == c
        assert len(s) == n * c
        for epoch in (0, 1, 4):
            s.set_epoch(epoch)
            expected = seldp_indices(m, n, r, epoch=epoch, seed=3, shuffle=shuffle, drop_last=drop_last)
            assert list(s) == expected
            assert len(list(s)) == len(s)
        assert [s.chunk_of(p) for p in range(len(s))] == [(r + p // c) % n for p in range(n * c)]


def test_sampler_is_distributed_sampler_and_picklable() -> None:
    from torch.utils.data import DistributedSampler

    s = SelDPSampler(list(range(30)), num_replicas=3, rank=2, seed=9)
    assert isinstance(s, DistributedSampler)
    s.set_epoch(5)
    s2 = pickle.loads(pickle.dumps(s))
    assert list(s2) == list(s)
    assert s2.epoch == 5
    assert "SelDPSampler" in repr(s)


def test_chunk_of_bounds() -> None:
    s = SelDPSampler(list(range(10)), num_replicas=2, rank=1)
    assert s.chunk_of(0) == 1 and s.chunk_of(4) == 1 and s.chunk_of(5) == 0 and s.chunk_of(9) == 0
    with pytest.raises(ValueError, match="position"):
        s.chunk_of(10)
    with pytest.raises(ValueError, match="position"):
        s.chunk_of(-1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_replicas": 0, "rank": 0}, "num_replicas"),
        ({"num_replicas": -2, "rank": 0}, "num_replicas"),
        ({"num_replicas": 3, "rank": 3}, "rank"),
        ({"num_replicas": 3, "rank": -1}, "rank"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SelDPSampler(list(range(10)), **kwargs)
    with pytest.raises(ValueError, match=match):
        seldp_indices(10, kwargs["num_replicas"], kwargs["rank"])


def test_bad_num_samples_and_types() -> None:
    with pytest.raises(ValueError, match="num_samples"):
        seldp_indices(-1, 2, 0)
    with pytest.raises(TypeError, match="num_replicas"):
        seldp_indices(10, 2.0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        seldp_indices(10, 3, 5)


@settings(max_examples=150, deadline=None)
@given(
    m=st.integers(min_value=0, max_value=60),
    n=st.integers(min_value=1, max_value=7),
    epoch=st.integers(min_value=0, max_value=1000),
    seed=st.integers(min_value=0, max_value=2**31),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
def test_seldp_property_based(m: int, n: int, epoch: int, seed: int, shuffle: bool, drop_last: bool) -> None:
    check_seldp_properties(m, n, epoch, seed, shuffle, drop_last)
