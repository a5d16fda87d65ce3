"""SelSync data partitioning (SelDP).

Implements the data-partitioning scheme of SelSync (paper §III-D, Fig. 7b): instead of giving every worker
a disjoint shard of the dataset (DefDP, what :class:`torch.utils.data.DistributedSampler` does), the dataset
is split into ``N`` equal chunks ``DP0 .. DP(N-1)`` and worker ``r`` iterates over *all* of them as a
circular queue whose head is rotated to its own chunk: ``DPr, DP(r+1), ..., DP(r+N-1)`` (indices mod ``N``).

Every worker therefore trains on the whole dataset (local-SGD phases do not skew the replicas towards a
local shard), while at any given step the ``N`` workers read from ``N`` different chunks, so when a step is
synchronised no two workers contribute gradients from the same data.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sized

import torch

from lightning_sync.data.sharding import CheckedDistributedSampler

__all__ = ["SelDPSampler", "seldp_indices"]


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be an int, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}") from None


def _validate_replicas_rank(num_replicas: int, rank: int) -> None:
    _check_int("num_replicas", num_replicas)
    _check_int("rank", rank)
    if num_replicas < 1:
        raise ValueError(f"`num_replicas` must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"`rank` must be in [0, num_replicas - 1] = [0, {num_replicas - 1}], got {rank}")


def _chunk_size(num_samples: int, num_replicas: int, drop_last: bool) -> int:
    if drop_last:
        return num_samples // num_replicas
    return math.ceil(num_samples / num_replicas)


def seldp_indices(
    num_samples: int,
    num_replicas: int,
    rank: int,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[int]:
    """Return the SelDP index order of one epoch for worker ``rank`` (SelSync paper §III-D, Fig. 7b).

    Construction, with ``M = num_samples`` and ``N = num_replicas``:

    1. One dataset order shared by **all** ranks: a permutation drawn from a ``torch.Generator`` seeded with
       ``seed + epoch`` (``torch.randperm``, exactly like :class:`~torch.utils.data.DistributedSampler`), or
       the identity when ``shuffle=False``. Ranks never communicate: they agree because they use the same
       ``seed`` and ``epoch``.
    2. The order is cut into ``N`` equal contiguous chunks ``DP0 .. DP(N-1)`` of size ``c``:

       * ``drop_last=False``: ``c = ceil(M / N)``; the order is padded to ``N * c`` by wrapping around its
         start (repeated as often as needed when ``M < N``), as ``DistributedSampler`` pads;
       * ``drop_last=True``: ``c = floor(M / N)``; the ``M - N * c`` trailing samples of the order are dropped
         (different samples each epoch when shuffling). ``M < N`` then gives an empty epoch.

    3. Rank ``r`` iterates the chunks as a circular queue whose head is its own chunk:
       ``DPr, DP(r+1), ..., DP(r+N-1)`` (mod ``N``), i.e. the padded order rotated left by ``r * c``.

    Properties:

    * each rank's epoch has ``N * c`` indices: **an SelDP epoch is ``N`` times longer (in samples and steps)
      than a DistributedSampler epoch**, because every rank sees the whole dataset -- the paper's design;
    * every sample appears at least once per epoch on every rank: exactly once when ``N`` divides ``M``; with
      padding the ``N * c - M`` padded samples appear twice (more often only when ``M < N``); with
      ``drop_last`` the dropped samples never appear;
    * at position ``p`` rank ``r`` reads from chunk ``(r + p // c) mod N``, so at every position the ``N``
      ranks are in ``N`` different chunks and, when ``N`` divides ``M`` (or with ``drop_last``), read ``N``
      different samples -- a synchronised step never aggregates the same sample twice.

    Args:
        num_samples: dataset size ``M`` (>= 0).
        num_replicas: number of workers ``N`` (>= 1).
        rank: this worker's rank, in ``[0, N - 1]``.
        epoch: epoch number, mixed into the shuffle seed.
        seed: base seed of the shuffle; must be identical on all ranks.
        shuffle: shuffle the shared order every epoch (identity order otherwise).
        drop_last: drop the tail to make chunks ``floor(M / N)`` long instead of padding to ``ceil(M / N)``.

    Returns:
        The dataset indices for this rank's epoch, a list of ``N * c`` ints.

    Raises:
        ValueError: ``num_samples < 0``, ``num_replicas < 1`` or ``rank`` outside ``[0, num_replicas - 1]``.
    """
    num_samples = _check_int("num_samples", num_samples)
    _validate_replicas_rank(num_replicas, rank)
    if num_samples < 0:
        raise ValueError(f"`num_samples` must be >= 0, got {num_samples}")

    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order: list[int] = torch.randperm(num_samples, generator=g).tolist()
    else:
        order = list(range(num_samples))

    c = _chunk_size(num_samples, num_replicas, drop_last)
    total = num_replicas * c
    if total == 0:
        return []
    if total > num_samples:  # pad by wrapping around (only when drop_last=False)
        padding = total - num_samples
        order += (order * math.ceil(padding / num_samples))[:padding]
    else:
        order = order[:total]
    head = rank * c
    return order[head:] + order[:head]


class SelDPSampler(CheckedDistributedSampler):
    """Distributed sampler implementing SelSync's data partitioning, SelDP (paper §III-D, Fig. 7b).

    Drop-in replacement for :class:`~torch.utils.data.DistributedSampler` (same constructor, ``set_epoch``
    inherited): the dataset order shared by all ranks is cut into ``num_replicas`` contiguous chunks and rank
    ``r`` iterates them in circular order starting at its own chunk. See :func:`seldp_indices` for the exact
    construction and guarantees.

    Unlike ``DistributedSampler``, **each rank sees the whole dataset each epoch**, so ``len(sampler)`` is
    ``num_replicas * chunk_size`` (about ``len(dataset)``) and an epoch is ``num_replicas`` times longer in
    steps than with the default partitioning. Being a ``DistributedSampler`` subclass, Lightning leaves it in
    place when it is set by the user's DataLoader and calls ``set_epoch`` on it every epoch.

    Attributes:
        chunk_size: ``c``, size of one chunk ``DPi``.
        num_samples: ``num_replicas * chunk_size``, indices yielded per rank and epoch (``len(self)``).
        total_size: length of the padded (or truncated) shared order, also ``num_replicas * chunk_size``.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self.chunk_size: int = _chunk_size(len(dataset), self.num_replicas, self.drop_last)
        self.num_samples = self.num_replicas * self.chunk_size
        self.total_size = self.num_samples

    def __iter__(self) -> Iterator[int]:
        return iter(
            seldp_indices(
                len(self.dataset),  # type: ignore[arg-type]
                self.num_replicas,
                self.rank,
                epoch=self.epoch,
                seed=self.seed,
                shuffle=self.shuffle,
                drop_last=self.drop_last,
            )
        )

    def __len__(self) -> int:
        return self.num_samples

    def chunk_of(self, position: int) -> int:
        """Chunk ``DPi`` this rank reads at ``position`` of its epoch: ``(rank + position // c) % N``.

        Raises:
            ValueError: ``position`` outside ``[0, len(self) - 1]``.
        """
        _check_int("position", position)
        if not 0 <= position < self.num_samples:
            raise ValueError(
                f"`position` must be in [0, len(sampler) - 1] = [0, {self.num_samples - 1}], got {position}"
            )
        return (self.rank + position // self.chunk_size) % self.num_replicas

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_replicas={self.num_replicas}, rank={self.rank},"
            f" shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, epoch={self.epoch},"
            f" chunk_size={self.chunk_size})"
        )
