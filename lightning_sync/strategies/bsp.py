"""BSP: bulk-synchronous parallel, the baseline every comparison is made against (SelSync §II-A, Eq. 1)."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from lightning_sync.comm import Communicator
from lightning_sync.comm.buckets import DEFAULT_BUCKET_CAP_MB, check_bucket_cap_mb
from lightning_sync.core.validation import check_bool
from lightning_sync.strategies.base import SyncStrategy


class BSPStrategy(SyncStrategy):
    """Average gradients over all ranks after every backward, then step: Eq. 1 of the SelSync paper.

    The same update as Lightning's ``ddp``, and like its ``DistributedDataParallel`` the gradients are all-reduced
    in buckets during backward, each as soon as its gradients are ready (:mod:`lightning_sync.comm.buckets`), but
    through this pack's :class:`~lightning_sync.comm.Communicator`, so bytes, collectives and blocked time are
    counted and link-emulated exactly like every other method's. The floating buffers travel with the gradients
    (BatchNorm statistics are averaged every step).

    With replica groups (``replica_size``) it is a two-level all-reduce: the buckets average over the replica's ranks
    during backward, then the replicas' gradient is averaged over their first ranks (after backward, not overlapped;
    compressed with ``compression``) and broadcast inside each replica — equal to the flat all-reduce in exact
    arithmetic, with the flat bytes on R ranks between replicas.

    Args:
        bucket_cap_mb: bucket size in MiB (DDP's argument, default 25), a number > 0; ``None`` all-reduces the
            whole gradient buffer once after backward (no overlap).
        find_unused_parameters: as DDP's: one extra small all-reduce per step finds the parameters no rank used, and
            their gradient is ``None`` (the optimizer skips them). Without it a parameter that gets no gradient on
            some rank contributes zeros there (no hang either way), and one no rank used gets a zero gradient that
            the optimizer applies (weight decay, momentum).
        **kwargs: :class:`~lightning_sync.strategies.base.SyncStrategy` arguments.
    """

    strategy_name = "bsp"
    strategy_name = "bsp"
    fault_tolerance_refusal = (
        "it all-reduces gradients at every step, so a quorum would be needed at every step: that is torchft's own "
        "DDP (torchft.DistributedDataParallel); this mode makes the periodic methods (local SGD, DiLoCo) "
        "fault-tolerant, which need a quorum at their syncs only"
    )
    strategy_description = "Bulk-synchronous parallel: gradient all-reduce every step, counted by lightning_sync"
    replicas_diverge = False  # identical gradients every step keep parameters and momentum identical

    def __init__(
        self,
        bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
        find_unused_parameters: bool = False,
        **kwargs: Any,
    ) -> None:
        self.bucket_cap_mb = check_bucket_cap_mb(bucket_cap_mb)
        self.intra_bucket_cap_mb = self.bucket_cap_mb  # replica groups: the buckets of the average inside a replica
        self.find_unused_parameters = check_bool("find_unused_parameters", find_unused_parameters)
        if self.find_unused_parameters and self.bucket_cap_mb is None:
            raise ValueError(
                "find_unused_parameters=True needs bucket_cap_mb (a number > 0): the unused parameters are found by "
                "the bucketed all-reduce's gradient hooks"
            )
        super().__init__(**kwargs)

    def _overlap_grads(self) -> tuple[Communicator, str] | None:
        return self.comm, "grads"

    def _gradient_is_local(self) -> bool:
        """Every step's gradient is every rank's mean, DDP's: ``gradient_clip_val`` as given (``local_clipping``)."""
        return False

    def _after_backward(self, optimizer: Optimizer) -> None:
        self.average_grads(tag="grads", verify_update=True)
        self.step_counter.record(synced=True)
