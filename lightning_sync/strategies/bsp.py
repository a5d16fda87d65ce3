"""BSP: bulk-synchronous parallel, the baseline every comparison is made against (SelSync §II-A, Eq. 1)."""

from __future__ import annotations

from torch.optim import Optimizer

from lightning_sync.strategies.base import SyncStrategy


class BSPStrategy(SyncStrategy):
    """Average gradients over all ranks after every backward, then step: Eq. 1 of the SelSync paper.

    The same update as Lightning's ``ddp`` (whose ``DistributedDataParallel`` all-reduces gradient buckets),
    but through this pack's :class:`~lightning_sync.comm.Communicator`, so its bytes, collectives and blocked time
    are counted and link-emulated exactly like every other method's. One all-reduce per step over the flat
    gradient buffer, which also carries the floating buffers (BatchNorm statistics are averaged every step).
    Unlike DDP, the all-reduce runs after backward rather than overlapping it bucket by bucket.
    """

    strategy_name = "bsp"
    strategy_description = "Bulk-synchronous parallel: gradient all-reduce every step, counted by lightning_sync"
    replicas_diverge = False  # identical gradients every step keep parameters and momentum identical

    def _after_backward(self, optimizer: Optimizer) -> None:
        self.average_grads(tag="grads", verify_update=True)
        self.step_counter.record(synced=True)
