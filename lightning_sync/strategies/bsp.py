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

    **Sharded replicas** (``sharded=True`` with ``replica_size``; :mod:`~lightning_sync.strategies.sharded_topology`):
    FSDP over every rank, as HSDP lays it out. Inside a replica FSDP2 reduce-scatters (averages) the gradients during
    backward; after backward every rank's local gradient shard — packed into the flat gradient buffer with the
    floating buffers beside it — is averaged over the ranks holding the same shard index in every replica (one
    all-reduce per flat buffer, not overlapped with backward; compressed with ``compression``), written back into
    FSDP2's gradients, and the user's optimizer updates the shard. The mean of the replicas' means is the mean over all
    ranks, so the update is Lightning's ``ModelParallelStrategy`` with ``fully_shard`` over all ranks (tested equal in
    float64) while a rank sends its shard's bytes between replicas, not the model's. The floating buffers, each rank's
    own under FSDP2, are averaged over the replica's shards too (an exact all-reduce inside the replica): every rank
    holds the mean of all ranks' buffers, as flat BSP. ``bucket_cap_mb`` has no effect there (FSDP2's
    reduce-scatter is the in-backward part) and ``find_unused_parameters=True`` is refused at construction.

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
    fault_tolerance_refusal = None  # a quorum at every step's end, the gradients averaged over it (ft_topology.py)
    strategy_description = "Bulk-synchronous parallel: gradient all-reduce every step, counted by lightning_sync"
    sharded_refusal = None  # FSDP2 inside the replica, the local gradient shards averaged between (HSDP)
    #: sharded groups fault-tolerant: every rank's local gradient shard over its shard index's quorum, every step
    sharded_fault_tolerance_refusal = None
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
        if self.find_unused_parameters and kwargs.get("sharded"):
            raise ValueError(
                "BSPStrategy(sharded=True) does not support find_unused_parameters=True: inside a sharded replica "
                "FSDP2 reduce-scatters the gradients, and between replicas the local gradient shards travel in one "
                "all-reduce after backward, not in DDP's hooked buckets that find the unused parameters. Use "
                "find_unused_parameters=False (a parameter a replica did not use contributes zeros to the average)"
            )
        if self.find_unused_parameters and kwargs.get("fault_tolerance") is not None:
            raise ValueError(
                "BSPStrategy(fault_tolerance=...) does not support find_unused_parameters=True: which parameters no "
                "rank used is found inside a replica group, not across the groups of the quorum. Use "
                "find_unused_parameters=False (a parameter a group did not use contributes zeros to the average)"
            )
        super().__init__(**kwargs)

    def _ft_next_step_syncs(self) -> bool:
        """Fault-tolerant: every step averages the gradients over the replica groups, so every step's end holds the
        quorum of the next."""
        return True

    def _ft_method_config(self) -> dict[str, Any]:
        return {"bucket_cap_mb": self.bucket_cap_mb}

    def _overlap_grads(self) -> tuple[Communicator, str] | None:
        return self.comm, "grads"

    def _gradient_is_local(self) -> bool:
        """Every step's gradient is every rank's mean, DDP's: ``gradient_clip_val`` as given (``local_clipping``)."""
        return False

    def _after_backward(self, optimizer: Optimizer) -> None:
        self.average_grads(tag="grads", verify_update=True)
        self.step_counter.record(synced=True)
