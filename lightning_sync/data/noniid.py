"""Non-IID (label-skewed) data partitioning for distributed training.

The SelSync paper studies training on unbalanced, non-IID data (§II-B, Fig. 1b; §III-E; §IV-E): CIFAR10 and
CIFAR100 are split across 10 workers with **1 label per worker** (CIFAR10) and **10 labels per worker**
(CIFAR100), and SelSync's data-injection is evaluated against FedAvg on these splits. This module provides
such splits as :class:`torch.utils.data.DistributedSampler` subclasses:

* :class:`LabelSkew` -- every rank holds samples of exactly ``labels_per_rank`` labels (the standard
  "sort by label and deal shards" federated-learning split; ``labels_per_rank=1`` with 10 ranks on CIFAR10 and
  ``labels_per_rank=10`` with 10 ranks on CIFAR100 are the paper's setups);
* :class:`Dirichlet` -- per-class rank proportions drawn from a symmetric Dirichlet distribution with
  concentration ``alpha`` (small ``alpha``: strong skew, large ``alpha``: close to IID);
* :func:`label_counts` / :func:`format_label_counts` -- per-rank class histograms of a partition.

Both samplers skew by **label only** (no feature or quantity skew is introduced on purpose: samples of a class
are assigned at random, and part sizes differ only as a consequence of the label split). The partition is
fixed for the whole run: it is computed once in ``__init__`` from ``seed`` alone, identically on every rank
(each rank computes all ``num_replicas`` parts and keeps its own), and it is a disjoint cover of the dataset:
every sample belongs to exactly one rank.

Synchronous strategies need every rank to run the same number of steps per epoch, but skewed parts have
different sizes. The samplers therefore equalise the epoch length (``equalize``): ``"repeat"`` pads each
rank's own part to the largest part's size by cycling through its own samples, ``"truncate"`` cuts every part
to the smallest part's size. Being ``DistributedSampler`` subclasses, Lightning leaves them in place when they
are set on the user's DataLoader (no sampler injection) and calls ``set_epoch`` on them every epoch.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence, Sized
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from ..core.validation import check_int, check_real
from .sharding import CheckedDistributedSampler

__all__ = ["Dirichlet", "LabelSkew", "format_label_counts", "label_counts"]

_EQUALIZE = ("repeat", "truncate")


# ------------------------------------------------------------------------------------------------------ labels
def _as_label_tensor(values: Any, name: str = "labels") -> Tensor:
    """``values`` as a 1-D int64 tensor of non-negative integers (ValueError naming ``name`` otherwise)."""
    try:
        t = torch.as_tensor(np.asarray(values) if not isinstance(values, Tensor) else values)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{name} must be a 1-D sequence of non-negative integers ({e})") from None
    t = t.detach().cpu()
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one label per sample), got shape {tuple(t.shape)}")
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name} must hold integers, got dtype {t.dtype}")
    if t.is_floating_point():
        if not bool(torch.isfinite(t).all()) or not bool((t == t.round()).all()):
            raise ValueError(f"{name} must hold integers, got non-integral values of dtype {t.dtype}")
    t = t.to(torch.int64)
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"{name} must be non-negative integers, got {int(t.min())}")
    return t


def _resolve_labels(dataset: Sized, labels: Sequence[int] | Tensor | None) -> Tensor:
    """The labels of ``dataset``; see :class:`LabelSkew` for the lookup order."""
    n = len(dataset)
    if labels is not None:
        found, source = labels, "labels"
    elif getattr(dataset, "targets", None) is not None:
        found, source = dataset.targets, "dataset.targets"  # type: ignore[attr-defined]
    elif isinstance(getattr(dataset, "tensors", None), (tuple, list)) and len(dataset.tensors) >= 2:  # type: ignore[attr-defined]
        found, source = dataset.tensors[1], "dataset.tensors[1]"  # type: ignore[attr-defined]
    elif getattr(dataset, "labels", None) is not None:
        found, source = dataset.labels, "dataset.labels"  # type: ignore[attr-defined]
    else:
        try:
            found = [_scalar(dataset[i][1]) for i in range(n)]  # type: ignore[index]
        except Exception as e:  # noqa: BLE001 -- any failure means "cannot find the labels"
            raise ValueError(
                f"cannot find the dataset's labels (no `targets`, `tensors[1]` or `labels` attribute and"
                f" `dataset[i][1]` failed: {type(e).__name__}: {e}); pass labels= explicitly"
            ) from None
        source = "dataset[i][1]"
    t = _as_label_tensor(found, name=source)
    if t.numel() != n:
        raise ValueError(f"{source} must have one label per sample: got {t.numel()} labels for {n} samples")
    return t


def _scalar(value: Any) -> int:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"label is a tensor of shape {tuple(value.shape)}, not a scalar")
        return int(value.item())
    return int(value)


# ------------------------------------------------------------------------------------------------ histograms
def label_counts(labels: Sequence[int] | Tensor, partition: list[list[int]], num_classes: int | None = None) -> Tensor:
    """Per-rank class histogram of a partition.

    Args:
        labels: label of every dataset sample (non-negative integers).
        partition: one list of dataset indices per rank.
        num_classes: number of columns ``C``; ``max(labels) + 1`` by default (0 for no labels).

    Returns:
        int64 tensor of shape ``[len(partition), C]``: entry ``[r, c]`` is the number of indices of rank ``r``
        whose label is ``c`` (with multiplicity, should a part repeat an index).

    Raises:
        ValueError: bad ``labels``, an index outside ``[0, len(labels) - 1]``, or a label ``>= num_classes``.
    """
    t = _as_label_tensor(labels)
    top = int(t.max()) + 1 if t.numel() else 0
    if num_classes is None:
        num_classes = top
    num_classes = check_int("num_classes", num_classes, max(top, 0))
    counts = torch.zeros(len(partition), num_classes, dtype=torch.int64)
    for r, part in enumerate(partition):
        idx = torch.as_tensor(list(part), dtype=torch.int64)
        if idx.numel() == 0:
            continue
        if int(idx.min()) < 0 or int(idx.max()) >= t.numel():
            raise ValueError(f"partition[{r}] holds an index outside [0, {t.numel() - 1}]")
        counts[r] = torch.bincount(t[idx], minlength=num_classes)
    return counts


def format_label_counts(counts: Tensor) -> str:
    """A small printable table of a ``[num_ranks, num_classes]`` count matrix, one row per rank.

    Columns: ``rank``, ``total`` (samples), ``labels`` (number of classes present), then one column per class.
    """
    counts = torch.as_tensor(counts)
    if counts.dim() != 2:
        raise ValueError(f"counts must be 2-D [num_ranks, num_classes], got shape {tuple(counts.shape)}")
    rows = counts.to(torch.int64).tolist()
    header = ["rank", "total", "labels"] + [str(c) for c in range(counts.shape[1])]
    body = [
        [str(r), str(sum(row)), str(sum(1 for v in row if v))] + [str(v) for v in row] for r, row in enumerate(rows)
    ]
    widths = [max(len(line[j]) for line in [header, *body]) for j in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *body]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- base
class _NonIIDSampler(CheckedDistributedSampler, ABC):
    """Shared machinery: labels, argument checks, the fixed partition, equalised epochs."""

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None,
        rank: int | None,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        labels: Sequence[int] | Tensor | None,
        equalize: str,
    ) -> None:
        if equalize not in _EQUALIZE:
            raise ValueError(f"equalize must be one of {_EQUALIZE}, got {equalize!r}")
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self.equalize: str = equalize
        #: label of every dataset sample (int64)
        self.labels: Tensor = _resolve_labels(dataset, labels)
        #: columns of :meth:`label_counts` / :meth:`summary`: ``max(label) + 1``
        self.num_classes: int = int(self.labels.max()) + 1 if self.labels.numel() else 0
        #: every rank's dataset indices (sorted), identical on all ranks
        self.partition: list[list[int]] = self._build_partition()
        sizes = [len(p) for p in self.partition]
        if equalize == "repeat" and min(sizes) == 0 and max(sizes) > 0:
            empty = sizes.index(0)
            raise ValueError(
                f"equalize='repeat' needs every rank to hold at least one sample, but rank {empty} holds none"
                " (raise min_samples, or use equalize='truncate')"
            )
        #: indices yielded per rank and epoch (``len(self)``), the same on every rank
        self.num_samples = max(sizes) if equalize == "repeat" else min(sizes)
        self.total_size = self.num_samples * self.num_replicas

    @abstractmethod
    def _build_partition(self) -> list[list[int]]:
        """Every rank's sorted index list; implemented by :class:`LabelSkew` and :class:`Dirichlet`."""

    def __iter__(self) -> Iterator[int]:
        """This rank's own part, shuffled with ``seed + epoch``, equalised to ``len(self)`` indices."""
        own = self.partition[self.rank]
        if self.shuffle and own:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = [own[i] for i in torch.randperm(len(own), generator=g).tolist()]
        else:
            order = list(own)
        length = self.num_samples
        if length > len(order):  # equalize="repeat": cycle through the rank's own (shuffled) samples
            order = (order * math.ceil(length / len(order)))[:length]
        return iter(order[:length])

    def __len__(self) -> int:
        """The equalised epoch length, the same on every rank."""
        return self.num_samples

    @property
    def part_sizes(self) -> list[int]:
        """Size of every rank's part before equalisation."""
        return [len(p) for p in self.partition]

    def label_counts(self) -> Tensor:
        """``[num_replicas, num_classes]`` class histogram of the partition (before equalisation)."""
        return label_counts(self.labels, self.partition, self.num_classes)

    def summary(self) -> str:
        """Printable table of :meth:`label_counts`, one row per rank (see :func:`format_label_counts`)."""
        return format_label_counts(self.label_counts())

    def _repr_args(self) -> str:
        return ""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._repr_args()}num_replicas={self.num_replicas}, rank={self.rank},"
            f" shuffle={self.shuffle}, seed={self.seed}, equalize={self.equalize!r}, epoch={self.epoch},"
            f" num_samples={self.num_samples})"
        )


_SHARED_DOC = """
    Labels are taken, in this order, from: the ``labels`` argument; ``dataset.targets`` (torchvision datasets);
    ``dataset.tensors[1]`` (:class:`~torch.utils.data.TensorDataset`); ``dataset.labels``; else by reading
    ``dataset[i][1]`` for every ``i`` (slow for datasets that decode on access: pass ``labels=`` then). Labels
    must be non-negative integers, one per sample; a ``ValueError`` asks for ``labels=`` when none is found.

    **Fixed partition.** :attr:`partition` (every rank's sorted index list) is computed once in ``__init__`` from
    ``seed`` only, identically on every rank; the parts are disjoint and cover the dataset. The per-epoch
    ``shuffle`` (seeded with ``seed + epoch`` as in ``DistributedSampler``) only reorders a rank's own part.

    **Equal epoch lengths.** Parts have different sizes, but synchronous strategies need the same number of
    steps on every rank, so ``len(sampler)`` is the same on all ranks:

    * ``equalize="repeat"`` (default): ``len = max`` part size; each rank cycles through its *own* samples in the
      epoch's (shuffled) order until it has yielded that many -- every own sample appears at least once per
      epoch and no sample of another rank is ever used. Effect on the label distribution: a rank's label *set*
      is unchanged and, averaged over epochs, so are its label proportions (the repeated samples are the head of
      a fresh shuffle each epoch), though within one epoch they are slightly tilted towards the repeated
      samples' labels. Globally, samples of smaller parts are seen more often per epoch, so the labels held by
      small parts are over-represented relative to the dataset's label mix (no sample is discarded).
    * ``equalize="truncate"``: ``len = min`` part size; each rank yields the first ``len`` samples of its
      shuffled part, so different samples are dropped each epoch (the same ones every epoch if
      ``shuffle=False``).

    ``drop_last`` is accepted and stored for ``DistributedSampler`` compatibility but does not change the indices
    (lengths are already equal across ranks); to drop an incomplete last batch pass ``drop_last=True`` to the
    DataLoader. Being a ``DistributedSampler`` subclass, Lightning keeps it when set on the user's DataLoader and
    calls ``set_epoch`` every epoch.

    Attributes:
        partition: ``list[list[int]]``, the dataset indices of every rank (sorted), identical on all ranks.
        labels: int64 tensor, the label of every sample.
        num_classes: ``max(labels) + 1``, the columns of :meth:`label_counts`.
        num_samples: indices yielded per rank and epoch (``len(self)``).
"""


# ----------------------------------------------------------------------------------------------- LabelSkew
class LabelSkew(_NonIIDSampler):
    """Label-skewed partition: every rank holds samples of exactly ``labels_per_rank`` distinct labels.

    The SelSync paper's non-IID setup (§II-B Fig. 1b, §IV-E): CIFAR10 over 10 workers with 1 label per worker
    (``labels_per_rank=1``) and CIFAR100 over 10 workers with 10 labels per worker (``labels_per_rank=10``).
    The partition is by label only (no feature skew): the samples of a class are split among its ranks at
    random.

    **Dealing rule** (the standard FL "shards" split, with distinct labels guaranteed). Let ``C`` be the number
    of distinct labels present, ``N = num_replicas``, ``k = labels_per_rank`` and ``S = N * k`` shards. Requires
    ``1 <= k <= C`` and ``S >= C`` (otherwise some class would have no rank, and every sample must be assigned).

    1. Each class is split into ``q = S // C`` shards, and the ``S mod C`` largest classes (ties broken by the
       seeded class order) into ``q + 1``. When ``C`` divides ``S``, every class is split into exactly
       ``S / C`` shards. A class's samples are shuffled (seeded) and cut into near-equal shards (sizes differing
       by at most one).
    2. The shards are laid out class by class, classes in a seeded random order, and dealt round-robin: shard
       ``j`` goes to rank ``j mod N``. A class has at most ``ceil(S / C) <= N`` consecutive shards, so they go to
       distinct ranks: **every rank gets exactly k shards from k distinct classes, in the divisible case and
       otherwise**. When ``S mod C != 0`` some classes are spread over one more rank than others (so those ranks
       get smaller shards of them) and part sizes vary more; ``equalize`` evens out the epoch lengths.

    Every class must have at least as many samples as shards, otherwise a ``ValueError`` naming
    ``labels_per_rank`` is raised (an empty shard would leave a rank with fewer than ``k`` labels).
    """

    __doc__ = (
        (__doc__ or "")
        + _SHARED_DOC
        + """
    Args:
        dataset: the (sized) dataset to partition.
        labels_per_rank: ``k``, labels held by every rank, in ``[1, C]`` with ``num_replicas * k >= C``.
        num_replicas: number of ranks ``N`` (>= 1); the world size by default.
        rank: this rank, in ``[0, N - 1]``; the global rank by default.
        shuffle: reshuffle the rank's own part every epoch (seed ``seed + epoch``).
        seed: seed of the partition and of the shuffles (>= 0); must be identical on all ranks.
        drop_last: kept for ``DistributedSampler`` compatibility, no effect (see above).
        labels: one label per sample, overriding the lookup described above.
        equalize: ``"repeat"`` or ``"truncate"`` (see above).

    Raises:
        ValueError: an argument out of range (naming it), or labels that cannot be found or are not
            non-negative integers.
    """
    )

    def __init__(
        self,
        dataset: Sized,
        labels_per_rank: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        labels: Sequence[int] | Tensor | None = None,
        equalize: Literal["repeat", "truncate"] = "repeat",
    ) -> None:
        self.labels_per_rank: int = check_int("labels_per_rank", labels_per_rank, 1)
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last, labels, equalize)

    def _build_partition(self) -> list[list[int]]:
        n, k = self.num_replicas, self.labels_per_rank
        classes, inverse, sizes = torch.unique(self.labels, return_inverse=True, return_counts=True)
        c = classes.numel()
        if k > c:
            raise ValueError(f"labels_per_rank must be in [1, {c}] (the number of distinct labels), got {k}")
        shards = n * k
        if shards < c:
            raise ValueError(
                f"labels_per_rank must be >= ceil(C / num_replicas) = {math.ceil(c / n)} so that all {c} labels"
                f" are assigned (num_replicas * labels_per_rank >= C), got {k} with num_replicas={n}"
            )
        g = torch.Generator()
        g.manual_seed(self.seed)
        order = torch.randperm(c, generator=g)  # seeded class order: dealing order and tie-break
        q, extra = divmod(shards, c)
        count = torch.full((c,), q, dtype=torch.int64)
        by_size = order[torch.sort(sizes[order], descending=True, stable=True).indices]
        count[by_size[:extra]] += 1
        short = (sizes < count).nonzero(as_tuple=True)[0]
        if short.numel():
            j = int(short[0])
            raise ValueError(
                f"labels_per_rank={k} with num_replicas={n} splits label {int(classes[j])} into {int(count[j])}"
                f" shards but it has only {int(sizes[j])} samples; lower labels_per_rank or num_replicas"
            )
        class_shards: list[tuple[Tensor, ...]] = []
        for j in range(c):
            idx = (inverse == j).nonzero(as_tuple=True)[0]
            idx = idx[torch.randperm(idx.numel(), generator=g)]
            class_shards.append(torch.tensor_split(idx, int(count[j])))
        parts: list[list[Tensor]] = [[] for _ in range(n)]
        slot = 0
        for j in order.tolist():
            for shard in class_shards[j]:
                parts[slot % n].append(shard)
                slot += 1
        return [torch.cat(p).sort().values.tolist() if p else [] for p in parts]

    def _repr_args(self) -> str:
        return f"labels_per_rank={self.labels_per_rank}, "


# ----------------------------------------------------------------------------------------------- Dirichlet
class Dirichlet(_NonIIDSampler):
    """Dirichlet label-skewed partition: per class, the share of each rank is drawn from ``Dir(alpha)``.

    A common non-IID benchmark split, a graded alternative to the SelSync paper's ``k`` labels per worker
    (§II-B, §IV-E): for every class independently, proportions ``p ~ Dir(alpha, ..., alpha)`` over the
    ``num_replicas`` ranks are drawn and the class's (seeded-shuffled) samples are cut at
    ``round(cumsum(p) * class_size)``. Small ``alpha`` (e.g. 0.1) concentrates each class on few ranks (strong
    skew); large ``alpha`` (e.g. 100) gives nearly the global class mix on every rank. The partition is by label
    only (no feature skew); part sizes follow from the draws.

    The Dirichlet draw normalises ``Gamma(alpha, 1)`` variates from ``numpy.random.default_rng(seed + attempt)``
    (``torch.distributions.Dirichlet`` cannot take a generator); should all of a class's variates underflow
    to 0 (tiny ``alpha``), the class goes wholly to one rank drawn uniformly -- the ``alpha -> 0`` limit.
    Draws are repeated with ``attempt = 0, 1, ...`` until every rank holds at least ``min_samples`` samples,
    at most :attr:`max_attempts` times; :attr:`attempts` records how many draws were needed.
    """

    __doc__ = (
        (__doc__ or "")
        + _SHARED_DOC
        + """
    Args:
        dataset: the (sized) dataset to partition.
        alpha: Dirichlet concentration, > 0 (finite).
        num_replicas: number of ranks ``N`` (>= 1); the world size by default.
        rank: this rank, in ``[0, N - 1]``; the global rank by default.
        shuffle: reshuffle the rank's own part every epoch (seed ``seed + epoch``).
        seed: seed of the partition and of the shuffles (>= 0); must be identical on all ranks.
        drop_last: kept for ``DistributedSampler`` compatibility, no effect (see above).
        labels: one label per sample, overriding the lookup described above.
        equalize: ``"repeat"`` or ``"truncate"`` (see above).
        min_samples: minimum part size, >= 0 with ``num_replicas * min_samples <= len(dataset)``; with
            ``equalize="repeat"`` every part must be non-empty, so use ``min_samples >= 1`` there.

    Raises:
        ValueError: an argument out of range (naming it), labels that cannot be found, or no draw meeting
            ``min_samples`` within :attr:`max_attempts` attempts (naming ``min_samples``).
    """
    )

    #: bound on the number of Dirichlet draws tried to satisfy ``min_samples``
    max_attempts: int = 100

    def __init__(
        self,
        dataset: Sized,
        alpha: float,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        labels: Sequence[int] | Tensor | None = None,
        equalize: Literal["repeat", "truncate"] = "repeat",
        min_samples: int = 1,
    ) -> None:
        self.alpha: float = check_real("alpha", alpha, low=0.0, low_open=True)
        self.min_samples: int = check_int("min_samples", min_samples, 0)
        #: number of Dirichlet draws used to meet ``min_samples``
        self.attempts: int = 0
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last, labels, equalize)

    def _build_partition(self) -> list[list[int]]:
        n, m = self.num_replicas, self.labels.numel()
        if n * self.min_samples > m:
            raise ValueError(
                f"min_samples must be <= len(dataset) // num_replicas = {m // n} (every rank needs min_samples),"
                f" got {self.min_samples}"
            )
        labels = self.labels.numpy()
        classes = np.unique(labels)
        by_class = [np.flatnonzero(labels == cls) for cls in classes]
        for attempt in range(self.max_attempts):
            rng = np.random.default_rng(self.seed + attempt)
            parts: list[list[np.ndarray]] = [[] for _ in range(n)]
            for idx in by_class:
                idx = idx[rng.permutation(idx.size)]
                w = rng.gamma(self.alpha, 1.0, size=n)
                total = float(w.sum())
                if total > 0 and math.isfinite(total):
                    p = w / total
                else:  # every variate underflowed: the alpha -> 0 limit puts the class on one rank
                    p = np.zeros(n)
                    p[rng.integers(n)] = 1.0
                cuts = np.rint(np.cumsum(p) * idx.size).astype(np.int64)
                cuts = np.clip(cuts, 0, idx.size)
                cuts[-1] = idx.size
                for r, piece in enumerate(np.split(idx, cuts[:-1])):
                    parts[r].append(piece)
            out = [np.sort(np.concatenate(p)).tolist() if p else [] for p in parts]
            if min(len(p) for p in out) >= self.min_samples:
                self.attempts = attempt + 1
                return out
        raise ValueError(
            f"min_samples={self.min_samples}: no Dirichlet(alpha={self.alpha}) draw gave every one of the"
            f" {n} ranks at least min_samples samples in {self.max_attempts} attempts; lower min_samples or"
            " raise alpha"
        )

    def _repr_args(self) -> str:
        return f"alpha={self.alpha}, min_samples={self.min_samples}, "
