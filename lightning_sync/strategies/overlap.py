"""The gradient all-reduce overlapped with backward, on the strategy's side.

Methods that average gradients over the whole model (BSP, Sync-Switch's BSP phase, OSP's whole-model RS) take
``bucket_cap_mb``; :class:`OverlappedGrads`, a component every :class:`~lightning_sync.strategies.SyncStrategy` owns
(``strategy.overlap``), then keeps a :class:`~lightning_sync.comm.buckets.GradBuckets` over the flat gradient buffer
(DDP's bucketing: hooks on the parameters' gradient accumulators launch each bucket's all-reduce as soon as its
gradients are ready). Before the closure of a step whose ``_after_backward`` will call ``average_grads(tag, comm)``
the method announces it (``_overlap_grads``) and the buckets are armed; ``average_grads`` then launches the rest and
waits for all (:meth:`OverlappedGrads.finish`). A broken announcement raises, and buckets in flight are abandoned,
never waited on, when the step fails.

Which bucket size, and what the buckets carry on a step, is the replica layout's answer
(:meth:`~lightning_sync.strategies.replicas.ReplicaGroups.bucket_cap`,
:meth:`~lightning_sync.strategies.replicas.ReplicaGroups.overlap_plan`): with replica groups the exact in-replica
all-reduce of every step, else the method's announcement. This file does not branch on the layout.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from lightning_sync.comm import CommHandle, Communicator, FlatState
from lightning_sync.comm.buckets import GradBuckets
from lightning_sync.strategies.replicas import OverlapPlan, ReplicaGroups


class OverlapHost(Protocol):
    """What :class:`OverlappedGrads` uses of the strategy that owns it: the method's ``bucket_cap_mb``,
    ``find_unused_parameters`` and announcement (``_overlap_grads``), its ``compressor`` (no overlap with
    compression), its replica layout and its communicator over all ranks."""

    bucket_cap_mb: float | None
    find_unused_parameters: bool
    compressor: Any
    comm: Communicator
    replicas: ReplicaGroups

    def _overlap_grads(self) -> OverlapPlan | None: ...


class OverlappedGrads:
    """The strategy's :class:`~lightning_sync.comm.buckets.GradBuckets` (see the module docstring). ``configure_ddp``
    calls :meth:`setup`, the closure of ``optimizer_step`` :meth:`arm`, :meth:`abandon` and :meth:`check_finished`,
    ``average_grads`` :meth:`finish` (through the topology), ``teardown`` :meth:`remove`."""

    def __init__(self, strategy: OverlapHost) -> None:
        self.strategy = strategy
        self.buckets: GradBuckets | None = None

    def setup(self, flat: FlatState, model: Any) -> None:
        """At setup, once the flat state exists: drop a previous setup's hooks and, with a bucket size, hook the
        buckets onto this one."""
        self.remove()
        s = self.strategy
        cap = s.replicas.bucket_cap(s.bucket_cap_mb)
        if cap is not None:
            names = {i: name for i, (name, _) in enumerate(model.named_parameters())}
            self.buckets = GradBuckets(flat, cap, names, s.find_unused_parameters)

    def remove(self) -> None:
        if self.buckets is not None:
            self.buckets.remove()
            self.buckets = None

    def _method_plan(self) -> OverlapPlan | None:
        if self.strategy.compressor is not None:
            # compressed gradient averaging is one compressed all-reduce per flat buffer after backward (buffers
            # exact, beside it): the buckets' overlap is not combined with compression
            return None
        return self.strategy._overlap_grads()

    def arm(self) -> None:
        """Before the closure: arm the buckets with this step's plan, if any."""
        buckets = self.buckets
        if buckets is None:
            return
        plan = self.strategy.replicas.overlap_plan(self._method_plan)
        if plan is None:
            return
        comm, tag = plan

        def launch(tensor: Tensor) -> CommHandle:
            return comm.all_reduce(tensor, op="avg", tag=tag, async_op=True)

        buckets.arm(launch, key=(comm, tag))

    def finish(self, comm: Communicator, tag: str) -> list[Tensor] | None:
        """In ``average_grads``: if buckets were launched during backward, launch the rest and wait for all; return
        what they averaged, or ``None`` when this step announced no overlap."""
        buckets = self.buckets
        if buckets is None or not buckets.armed:
            return None
        if buckets.key != (comm, tag):
            raise RuntimeError(
                f"average_grads(tag={tag!r}) over another communicator or tag than {type(self.strategy).__name__}."
                f"_overlap_grads() announced for this step ({buckets.key[1]!r})"
            )
        return buckets.finish(comm)

    def check_finished(self) -> None:
        """After ``_after_backward``: the announced average must have been taken."""
        buckets = self.buckets
        if buckets is not None and buckets.armed:
            buckets.finish(self.strategy.comm)  # nothing left in flight, then say whose contract was broken
            raise RuntimeError(
                f"{type(self.strategy).__name__}._overlap_grads() announced a gradient average for this step, but "
                "_after_backward did not call average_grads with that communicator and tag"
            )

    def abandon(self) -> None:
        """The step failed: never wait for buckets in flight (a peer may be gone)."""
        if self.buckets is not None:
            self.buckets.abandon()
