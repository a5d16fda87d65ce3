"""``DistributedSampler`` with its arguments checked: the base of the pack's samplers (non-IID, SelDP)."""

from __future__ import annotations

from collections.abc import Sized

from torch.utils.data import DistributedSampler

from lightning_sync.core.validation import check_int

__all__ = ["CheckedDistributedSampler"]


class CheckedDistributedSampler(DistributedSampler):
    """PyTorch's ``DistributedSampler`` whose ``num_replicas`` (>= 1) and ``rank`` (in ``[0, num_replicas - 1]``) are
    checked when given, and again once the defaults were taken from ``torch.distributed``: a ``ValueError`` naming
    the argument and its range, instead of an index error later."""

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is not None:
            num_replicas = check_int("num_replicas", num_replicas, 1)
        if rank is not None:
            rank = check_int("rank", rank, 0, None if num_replicas is None else num_replicas - 1)
        seed = check_int("seed", seed, 0)
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        check_int("num_replicas", self.num_replicas, 1)
        check_int("rank", self.rank, 0, self.num_replicas - 1)
