"""A DataLoader that Lightning can restore in the middle of an epoch.

Lightning 2.6 saves and restores the state of a training DataLoader only when the loader implements the
``state_dict()`` / ``load_state_dict()`` protocol (``lightning.fabric.utilities.types._Stateful``): the fit
loop stores ``[loader.state_dict() for stateful loaders]`` under ``loops.fit_loop.state_dict.combined_loader``
and, on restart, calls ``loader.load_state_dict(...)`` in ``FitLoop.setup_data`` *before* creating the
epoch's iterator. Without it Lightning warns that resuming from a mid-epoch checkpoint is unreliable: the
resumed epoch restarts the loader from its first batch (and stops after the number of batches that were left).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import _DatasetKind

__all__ = ["ResumableDataLoader"]


class _SkipFirstIndices:
    """Index sampler proxy that drops the first ``loader._index_skip`` entries of each iteration started
    while the skip is armed, so the skipped batches are never fetched from the dataset (only their indices
    are drawn).
    """

    def __init__(self, base: Iterable[Any], loader: ResumableDataLoader) -> None:
        self.base = base
        # weak: a persistent-workers iterator keeps this proxy, and a loader <-> iterator reference cycle
        # would leave the worker shutdown to the cyclic GC, where it times out (measured: 10 s per loader)
        self._loader = weakref.ref(loader)

    def __iter__(self) -> Iterator[Any]:
        loader = self._loader()
        skip = loader._index_skip if loader is not None else 0
        it = iter(self.base)
        return itertools.islice(it, skip, None) if skip else it

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]


def _as_epoch(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


class ResumableDataLoader(DataLoader):
    """:class:`~torch.utils.data.DataLoader` with ``state_dict()`` / ``load_state_dict()`` (mid-epoch resume).

    The loader counts the batches yielded by its current iteration. ``state_dict()`` returns
    ``{"batches_yielded": n, "sampler_epoch": e}`` where ``e`` is the ``epoch`` attribute of the sampler
    (e.g. a :class:`~torch.utils.data.DistributedSampler` or :class:`~lightning_sync.data.SelDPSampler` after
    ``set_epoch``) when the iteration started, or ``None`` when the sampler has none.
    ``load_state_dict(state)`` makes the **next** ``__iter__`` skip ``n`` batches, so a resumed run sees
    exactly the remaining batches of the interrupted epoch; the skip applies once, later iterations are
    complete epochs. A state without ``"sampler_epoch"`` (e.g. ``{"batches_yielded": n}``) is accepted.

    The skip is not applied (the next iteration is a full epoch) when the saved epoch was already complete
    (``n >= len(loader)``) or when both the saved and the current sampler epoch are known and differ, which is
    the case when Lightning resumes from an end-of-epoch checkpoint with ``limit_train_batches`` (it calls
    ``set_epoch(next_epoch)`` before the first batch is drawn; the decision is taken lazily at the first
    ``next()``, after that call).

    For map-style datasets the skip happens at the index level: the first ``n`` entries of the
    ``batch_sampler`` (or ``sampler`` with ``batch_size=None``) are drawn and discarded, so the skipped
    samples are never loaded; for iterable-style datasets the first ``n`` batches are fetched and discarded.

    The resumed batches equal the interrupted ones only if the sampler order is reproducible from state that
    is itself restored: seeded samplers keyed on the epoch (``DistributedSampler``, ``SelDPSampler``) are;
    a ``RandomSampler`` drawing from the global RNG is not.

    Distributed training: Lightning writes the checkpoint from rank 0, so the state restored on every rank is
    rank 0's batch count. That is valid for synchronous strategies in which every rank consumes the same
    number of batches per epoch (equal-length distributed samplers, one batch per step on every rank);
    strategies that let ranks advance at different speeds must save per-rank loader state themselves.

    The constructor is exactly :class:`~torch.utils.data.DataLoader`'s (``*args, **kwargs`` passed through) so
    Lightning can re-instantiate the loader with an injected sampler
    (``lightning.pytorch.utilities.data._update_dataloader``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # set before DataLoader.__init__: the `_index_sampler` property below may be read during it
        self._index_skip = 0
        self._batches_yielded = 0
        self._state_epoch: int | None = None
        self._pending: dict[str, Any] | None = None
        self._iter_token: object | None = None
        super().__init__(*args, **kwargs)

    # -- index-level skipping -------------------------------------------------------------------------------
    @property
    def _index_sampler(self) -> Any:  # overrides DataLoader._index_sampler (read when an iterator is created)
        base = self.batch_sampler if self._auto_collation else self.sampler
        if getattr(self, "_index_skip", 0) > 0 or (self.persistent_workers and self.num_workers > 0):
            # persistent workers keep the index sampler captured at creation and re-iterate it every epoch:
            # always hand them the proxy so a later armed skip still reaches them
            return _SkipFirstIndices(base, self)
        return base

    def _can_skip_indices(self) -> bool:
        if self._dataset_kind != _DatasetKind.Map:
            return False
        existing = getattr(self, "_iterator", None)
        return existing is None or isinstance(getattr(existing, "_index_sampler", None), _SkipFirstIndices)

    # -- state -------------------------------------------------------------------------------------------
    def _sampler_epoch(self) -> int | None:
        batch_sampler = getattr(self, "batch_sampler", None)
        candidates = (getattr(self, "sampler", None), getattr(batch_sampler, "sampler", None))
        for sampler in candidates:
            epoch = _as_epoch(getattr(sampler, "epoch", None))
            if epoch is not None:
                return epoch
        return None

    def _resolve_skip(self, pending: Mapping[str, Any] | None, epoch: int | None) -> int:
        if not pending:
            return 0
        n = int(pending.get("batches_yielded", 0))
        if n <= 0:
            return 0
        saved_epoch = _as_epoch(pending.get("sampler_epoch"))
        if saved_epoch is not None and epoch is not None and saved_epoch != epoch:
            return 0  # the interrupted epoch had ended: this is a new one
        try:
            length: int | None = len(self)
        except TypeError:  # iterable dataset without __len__
            length = None
        if length is not None and n >= length:
            return 0  # the interrupted epoch was complete
        return n

    def state_dict(self) -> dict[str, Any]:
        """Position in the current (or last) epoch.

        Returns:
            ``{"batches_yielded": int, "sampler_epoch": int | None}``.
        """
        return {"batches_yielded": self._batches_yielded, "sampler_epoch": self._state_epoch}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Make the next ``__iter__`` resume after ``state_dict["batches_yielded"]`` batches (once).

        Raises:
            ValueError: ``batches_yielded`` is missing or not a non-negative int.
        """
        n = state_dict.get("batches_yielded") if isinstance(state_dict, Mapping) else None
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"`state_dict['batches_yielded']` must be an int >= 0, got {n!r}")
        epoch = _as_epoch(state_dict.get("sampler_epoch"))
        self._pending = {"batches_yielded": n, "sampler_epoch": epoch}
        # state_dict() before the next iteration round-trips the loaded state; live iterations stop counting
        self._batches_yielded = n
        self._state_epoch = epoch
        self._iter_token = None

    # -- iteration ---------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        pending, self._pending = self._pending, None
        token = object()
        self._iter_token = token
        if pending is None:
            self._batches_yielded = 0
            self._state_epoch = self._sampler_epoch()  # refreshed at the first next(), after set_epoch()
        return self._iterate(token, pending)

    def _iterate(self, token: object, pending: dict[str, Any] | None) -> Iterator[Any]:
        # runs at the first next(): after Lightning's set_epoch() for the epoch
        epoch = self._sampler_epoch()
        skip = self._resolve_skip(pending, epoch)
        if self._iter_token is token:
            self._batches_yielded = skip
            self._state_epoch = epoch
        index_skip = skip if self._can_skip_indices() else 0
        self._index_skip = index_skip
        try:
            it = super().__iter__()
        finally:
            self._index_skip = 0
        for _ in range(skip - index_skip):
            try:
                next(it)
            except StopIteration:
                return
        for batch in it:
            if self._iter_token is token:
                self._batches_yielded += 1
            yield batch


def ordered_loader(dataset: Dataset, batch_size: int, num_workers: int = 0) -> DataLoader:
    """An evaluation loader: the split in order, every sample once (validation and test of the data modules)."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
