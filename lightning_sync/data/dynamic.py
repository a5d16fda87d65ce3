"""Dynamic work assignment for asynchronous data-parallel training.

With a :class:`~torch.utils.data.DistributedSampler` every rank gets a fixed shard of ``ceil(M / N)`` samples
per epoch, so in an asynchronous strategy a fast rank idles at the end of the epoch while the slowest one
finishes its shard. Here all ranks instead iterate **one global order of batches** -- the same permutation of
the whole dataset on every rank, reshuffled each epoch from a shared seed, cut into batches at positions
``0, 1, 2, ...`` -- and a rank obtains its next batch by *claiming* the next unclaimed position from a counter
shared by all ranks. A faster rank claims more often and therefore processes more batches; the epoch ends on
every rank when the positions run out, i.e. when the data is consumed, and every batch of the epoch is
processed exactly once by exactly one rank.

The shared counter (e.g. ``TCPStore.add(f"epoch{e}", 1) - 1``) is not part of this module: it is injected as
a callable ``claim(epoch) -> position``. :class:`LocalCounter` is an in-process implementation for tests and
single-process use.
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

__all__ = ["DynamicBatchSampler", "LocalCounter", "dynamic_loader"]


def _check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int ``>= minimum``; ``ValueError`` naming ``name`` otherwise (bools are rejected)."""
    if not isinstance(value, bool):
        try:
            number = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if number >= minimum:
                return number
    raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}")


class LocalCounter:
    """Thread-safe in-process claim counter: one counter per epoch, each starting at 0.

    ``claim(epoch)`` returns ``0, 1, 2, ...`` on successive calls for the same epoch, whichever thread calls
    it, and never hands out a value twice. Share one instance between the :class:`DynamicBatchSampler` of
    several threads (or several samplers iterated in one thread) to emulate ranks drawing from one store.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: dict[int, int] = {}

    def claim(self, epoch: int) -> int:
        """Return the next unclaimed position of ``epoch`` and advance that epoch's counter."""
        with self._lock:
            position = self._next.get(epoch, 0)
            self._next[epoch] = position + 1
            return position

    def claimed(self, epoch: int) -> int:
        """Number of positions handed out so far for ``epoch`` (including claims past the end)."""
        with self._lock:
            return self._next.get(epoch, 0)

    def __repr__(self) -> str:
        with self._lock:
            return f"{type(self).__name__}({dict(self._next)})"


class DynamicBatchSampler(Sampler[list[int]]):
    """Batch sampler whose batches are claimed one at a time from a counter shared by all ranks.

    The epoch's global order is a permutation of ``range(num_samples)`` drawn from a ``torch.Generator``
    seeded with ``seed + epoch`` (exactly as :class:`~torch.utils.data.DistributedSampler` draws it), or the
    identity when ``shuffle=False``; every rank computes the same order because it uses the same ``seed`` and
    ``epoch``. Batch position ``k`` is ``order[k * batch_size:(k + 1) * batch_size]``; there are
    ``num_batches = ceil(num_samples / batch_size)`` positions, or ``floor`` with ``drop_last`` (the incomplete
    last batch is not used).

    Each time the next batch is requested the sampler calls ``claim(epoch)`` -- once per batch, lazily, never
    ahead of the request -- and yields the batch at the returned position. A position ``>= num_batches`` means
    the epoch's data is consumed: the iteration stops and ``on_exhausted(epoch)`` is called once (before the
    ``StopIteration``). Every rank therefore makes exactly one claim past the end per epoch.

    Usable as ``DataLoader(dataset, batch_sampler=sampler)``. Note that the DataLoader requests batches ahead
    of the training loop: with ``num_workers > 0`` up to ``prefetch_factor * num_workers`` batches are claimed
    ahead, and Lightning's data fetcher requests one more to detect the last batch. Those batches are still
    trained on by this rank, so coverage is unaffected, but ``on_exhausted`` means "this rank will claim
    nothing more this epoch", not "this rank has finished training on its batches".

    **No ``__len__``, on purpose.** How many batches a rank gets is decided at run time by the relative speed
    of the ranks, so no length is correct. Without ``__len__``, ``len(DataLoader)`` raises ``TypeError`` and
    Lightning treats the training loader as unsized (like an ``IterableDataset``): it prefetches one batch to
    detect the end of the epoch, runs the epoch until the sampler stops, and validates at the end of the epoch
    (``val_check_interval`` must then be ``1.0`` or an int). A length, even an estimate, would make Lightning
    stop fetching after that many batches -- leaving positions unclaimed, i.e. data silently skipped, or ending
    the epoch before the data is consumed -- and place its validation checks and progress totals on it.

    **Epochs.** Call ``set_epoch(epoch)`` before each epoch, with the same value on all ranks: the epoch
    selects both the shuffle and the counter that is claimed from. Lightning 2.6's ``_set_sampler_epoch``
    (called by the fit loop at each epoch start) calls ``set_epoch`` on ``dataloader.sampler`` and on
    ``dataloader.batch_sampler.sampler`` but **not** on ``dataloader.batch_sampler`` itself; this class
    therefore exposes itself as its own ``sampler`` attribute so that Lightning's call reaches it.

    Apply it to a Lightning training loader with :func:`dynamic_loader` after Lightning's sampler injection (in
    a strategy's ``process_dataloader``). A loader that already uses this sampler when Lightning prepares it
    needs ``Trainer(use_distributed_sampler=False)``: otherwise Lightning tries to re-instantiate the custom
    batch sampler around a ``DistributedSampler`` and fails.

    Args:
        num_samples: size of the (map-style) dataset, ``>= 1``.
        batch_size: samples per batch, ``>= 1``.
        claim: ``claim(epoch) -> int``: the next unclaimed global batch position of ``epoch``, shared by all
            ranks (``0, 1, 2, ...``; each value handed out once across ranks).
        shuffle: reshuffle the global order each epoch (identity order otherwise).
        seed: base seed of the shuffle, ``>= 0``; must be identical on all ranks.
        drop_last: drop the incomplete last batch.
        on_exhausted: called as ``on_exhausted(epoch)`` once per iteration, when a claim returns a position
            ``>= num_batches``.

    Attributes:
        epoch: the epoch set by :meth:`set_epoch` (``0`` initially); read when an iteration starts.
        num_batches: batch positions per epoch.
        batches_yielded: batches yielded by the current iteration (reset by ``__iter__``).
        positions: positions this rank obtained in the current iteration, in order (reset by ``__iter__``).

    Raises:
        ValueError: ``num_samples`` or ``batch_size`` not an int ``>= 1``, ``seed`` not an int ``>= 0``,
            ``claim`` (or a non-``None`` ``on_exhausted``) not callable.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        claim: Callable[[int], int],
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        on_exhausted: Callable[[int], None] | None = None,
    ) -> None:
        self.num_samples: int = _check_int("num_samples", num_samples, 1)
        self.batch_size: int = _check_int("batch_size", batch_size, 1)
        self.seed: int = _check_int("seed", seed, 0)
        if not callable(claim):
            raise ValueError(f"`claim` must be a callable claim(epoch) -> int, got {type(claim).__name__}")
        if on_exhausted is not None and not callable(on_exhausted):
            raise ValueError(
                f"`on_exhausted` must be None or a callable on_exhausted(epoch), got {type(on_exhausted).__name__}"
            )
        self.claim = claim
        self.on_exhausted = on_exhausted
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        if self.drop_last:
            self.num_batches: int = self.num_samples // self.batch_size
        else:
            self.num_batches = math.ceil(self.num_samples / self.batch_size)
        self.epoch: int = 0
        self.batches_yielded: int = 0
        self.positions: list[int] = []

    @property
    def sampler(self) -> DynamicBatchSampler:
        """This sampler itself: Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler``, not on
        ``dataloader.batch_sampler`` (``lightning.fabric.utilities.data._set_sampler_epoch``)."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next iteration (shuffle seed ``seed + epoch`` and the claimed counter).

        Raises:
            ValueError: ``epoch`` not an int ``>= 0``.
        """
        self.epoch = _check_int("epoch", epoch, 0)

    def order(self, epoch: int | None = None) -> torch.Tensor:
        """The global sample order of ``epoch`` (default: :attr:`epoch`), identical on every rank."""
        epoch = self.epoch if epoch is None else _check_int("epoch", epoch, 0)
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        # reset eagerly (a generator function would only reset at the first next()) and pin the epoch
        self.batches_yielded = 0
        self.positions = []
        return self._iterate(self.epoch, self.order())

    def _iterate(self, epoch: int, order: torch.Tensor) -> Iterator[list[int]]:
        while True:
            raw = self.claim(epoch)
            try:
                position = operator.index(raw)
            except TypeError:
                raise RuntimeError(f"`claim({epoch})` must return an int, got {type(raw).__name__}") from None
            if position < 0:
                raise RuntimeError(f"`claim({epoch})` returned a negative position ({position})")
            if position >= self.num_batches:
                if self.on_exhausted is not None:
                    self.on_exhausted(epoch)
                return
            start = position * self.batch_size
            batch: list[int] = order[start : start + self.batch_size].tolist()
            self.positions.append(position)
            self.batches_yielded += 1
            yield batch

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_samples={self.num_samples}, batch_size={self.batch_size},"
            f" shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, epoch={self.epoch},"
            f" num_batches={self.num_batches})"
        )


_UNSUPPORTED_HINT = (
    "Dynamic work assignment needs a map-style dataset with the default batch sampler (a DataLoader built "
    "with batch_size=..., and shuffle=... or a RandomSampler/SequentialSampler/DistributedSampler). Use such a "
    "loader, or build the DataLoader yourself with batch_sampler=DynamicBatchSampler(...), or keep static "
    "partitioning (DistributedSampler) for this loader."
)


def _shuffle_and_seed(sampler: object, seed: int | None) -> tuple[bool, int]:
    kind = type(sampler)
    if kind is DistributedSampler:
        return bool(sampler.shuffle), sampler.seed if seed is None else seed  # type: ignore[attr-defined]
    if kind is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:  # type: ignore[attr-defined]
            raise ValueError(
                "dynamic_loader: the loader's RandomSampler draws with replacement or a custom num_samples, "
                "but dynamic work assignment covers every sample exactly once per epoch. " + _UNSUPPORTED_HINT
            )
        return True, 0 if seed is None else seed
    if kind is SequentialSampler:
        return False, 0 if seed is None else seed
    raise ValueError(
        f"dynamic_loader: the loader uses the sampler {kind.__qualname__}, whose order dynamic work assignment "
        "would silently replace (only DistributedSampler, RandomSampler and SequentialSampler are "
        "supported). " + _UNSUPPORTED_HINT
    )


def dynamic_loader(
    dataloader: DataLoader,
    claim: Callable[[int], int],
    on_exhausted: Callable[[int], None] | None = None,
    seed: int | None = None,
) -> DataLoader:
    """Rebuild a (Lightning-prepared) training loader so its batches are claimed dynamically.

    The returned loader iterates the **whole** dataset through a :class:`DynamicBatchSampler` (instead of
    this rank's shard), with the original ``batch_size`` and ``drop_last``. ``shuffle`` and ``seed`` come from
    the original sampler:

    * :class:`~torch.utils.data.DistributedSampler` (what Lightning injects under
      ``use_distributed_sampler=True``, with ``shuffle`` matching the user's loader and ``seed`` from
      ``PL_GLOBAL_SEED``): its ``shuffle`` and ``seed``; its ``num_replicas``/``rank``/``drop_last`` no longer
      apply, as there are no shards;
    * :class:`~torch.utils.data.RandomSampler` (without replacement): ``shuffle=True``, ``seed`` or 0;
    * :class:`~torch.utils.data.SequentialSampler`: ``shuffle=False``.

    ``seed``, when given, replaces the sampler's seed; it must be the same on all ranks.

    Every other setting is kept: ``num_workers``, ``collate_fn``, ``pin_memory`` (and ``pin_memory_device``),
    ``worker_init_fn``, ``persistent_workers``, ``timeout``, ``prefetch_factor`` (when ``num_workers > 0``),
    ``multiprocessing_context``, ``generator`` and ``in_order``.

    The loader is constructed directly as ``DataLoader(dataset, batch_sampler=..., ...)`` from the effective
    settings read off the given instance, not through Lightning's ``_update_dataloader``: that helper can only
    substitute a *sampler* (for a default ``BatchSampler`` it forces ``batch_sampler=None`` and rebuilds one
    from ``batch_size``), and it re-instantiates the loader from the constructor arguments Lightning saved,
    which are missing for loaders created outside Lightning's hooks and would have to be edited (``batch_size``,
    ``shuffle``, ``drop_last`` are incompatible with ``batch_sampler``) in a form that depends on the
    subclass's signature. The result is therefore a plain :class:`~torch.utils.data.DataLoader`: behaviour
    added by a ``DataLoader`` subclass (e.g. ``ResumableDataLoader``'s batch-count resume state, which does not
    describe a dynamic epoch) is not carried over.

    Args:
        dataloader: the training loader (typically after Lightning's sampler injection).
        claim: ``claim(epoch) -> int``, see :class:`DynamicBatchSampler`.
        on_exhausted: see :class:`DynamicBatchSampler`.
        seed: shuffle seed overriding the sampler's (``None``: the ``DistributedSampler``'s seed, else 0).

    Returns:
        A new ``DataLoader`` whose ``batch_sampler`` is a :class:`DynamicBatchSampler` (``len()`` raises
        ``TypeError``).

    Raises:
        ValueError: ``dataloader`` is not a ``DataLoader``, has an ``IterableDataset``, ``batch_size=None``, a
            custom ``batch_sampler`` or an unsupported sampler; ``seed`` is not ``None`` or an int ``>= 0``;
            ``claim``/``on_exhausted`` are not callable.
    """
    if not isinstance(dataloader, DataLoader):
        raise ValueError(f"dynamic_loader needs a torch DataLoader, got {type(dataloader).__name__}")
    if seed is not None:
        seed = _check_int("seed", seed, 0)
    if isinstance(dataloader.dataset, IterableDataset):
        raise ValueError(
            "dynamic_loader: the loader wraps an IterableDataset, whose order is produced by the dataset itself "
            "and cannot be claimed by index. " + _UNSUPPORTED_HINT
        )
    if dataloader.batch_size is None:
        raise ValueError(
            "dynamic_loader: the loader has batch_size=None (no automatic batching), so there are no batches to "
            "claim. " + _UNSUPPORTED_HINT
        )
    batch_sampler = dataloader.batch_sampler
    if isinstance(batch_sampler, DynamicBatchSampler):
        raise ValueError("dynamic_loader: the loader already uses a DynamicBatchSampler")
    if type(batch_sampler) is not BatchSampler:
        raise ValueError(
            f"dynamic_loader: the loader uses the custom batch sampler {type(batch_sampler).__qualname__}, "
            "which dynamic work assignment would silently replace. " + _UNSUPPORTED_HINT
        )
    shuffle, seed = _shuffle_and_seed(dataloader.sampler, seed)
    dataset = dataloader.dataset
    try:
        num_samples = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"dynamic_loader: the dataset {type(dataset).__name__} has no __len__. " + _UNSUPPORTED_HINT
        ) from None
    sampler = DynamicBatchSampler(
        num_samples,
        dataloader.batch_size,
        claim,
        shuffle=shuffle,
        seed=seed,
        drop_last=dataloader.drop_last,
        on_exhausted=on_exhausted,
    )
    kwargs: dict[str, object] = {
        "num_workers": dataloader.num_workers,
        "collate_fn": dataloader.collate_fn,
        "pin_memory": dataloader.pin_memory,
        "timeout": dataloader.timeout,
        "worker_init_fn": dataloader.worker_init_fn,
        "multiprocessing_context": dataloader.multiprocessing_context,
        "generator": dataloader.generator,
        "prefetch_factor": dataloader.prefetch_factor if dataloader.num_workers > 0 else None,
        "persistent_workers": dataloader.persistent_workers,
        "pin_memory_device": dataloader.pin_memory_device,
    }
    if hasattr(dataloader, "in_order"):  # torch >= 2.6
        kwargs["in_order"] = dataloader.in_order
    return DataLoader(dataset, batch_sampler=sampler, **kwargs)  # type: ignore[arg-type]
