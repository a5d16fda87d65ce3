"""The gradient all-reduce overlapped with backward, on the strategy's side.

Methods that average gradients over the whole model (BSP, Sync-Switch's BSP phase, OSP's whole-model RS) take
``bucket_cap_mb``; the strategy then keeps a :class:`~lightning_sync.comm.buckets.GradBuckets` over the flat gradient
buffer (DDP's bucketing: hooks on the parameters' gradient accumulators launch each bucket's all-reduce as soon as its
gradients are ready). Before the closure of a step whose ``_after_backward`` will call ``average_grads(tag, comm)``
the method announces it (``_overlap_grads``) and the buckets are armed; ``average_grads`` then launches the rest and
waits for all (:meth:`OverlappedGrads._finish_grad_buckets`). A broken announcement raises, and buckets in flight
are abandoned, never waited on, when the step fails.
"""

from __future__ import annotations

from torch import Tensor

from lightning_sync.comm import CommHandle, Communicator
from lightning_sync.comm.buckets import GradBuckets


class OverlappedGrads:
    """Mixin of :class:`~lightning_sync.strategies.SyncStrategy`. The strategy's ``__init__`` sets ``_grad_buckets``;
    ``configure_ddp`` calls :meth:`_setup_grad_buckets`, the closure of ``optimizer_step``
    :meth:`_arm_grad_buckets`, :meth:`_abandon_grad_buckets` and :meth:`_check_grad_buckets_finished`, and
    ``average_grads`` :meth:`_finish_grad_buckets`.

    Uses from the strategy: ``bucket_cap_mb`` and ``find_unused_parameters`` (class attributes the methods set),
    ``_overlap_grads()`` (the method's announcement), ``compressor`` (no overlap with compression), ``flat``. With
    replica groups (:mod:`~lightning_sync.strategies.replicas`: ``grouped``, ``_intra``, ``intra_bucket_cap_mb``) the
    buckets carry the exact intra-replica all-reduce of every step instead, finished by ``_average_in_replica``.
    """

    _grad_buckets: GradBuckets | None

    def _setup_grad_buckets(self) -> None:
        """At setup, once the flat state exists: drop a previous setup's hooks and, with ``bucket_cap_mb``, hook the
        buckets onto this one."""
        if self._grad_buckets is not None:  # a previous setup's hooks
            self._grad_buckets.remove()
            self._grad_buckets = None
        # replica groups: the exact intra-replica all-reduce of every step (replicas.py), not the method's
        cap = self.intra_bucket_cap_mb if self.grouped else self.bucket_cap_mb
        if cap is not None:
            names = {i: name for i, (name, _) in enumerate(self.model.named_parameters())}
            self._grad_buckets = GradBuckets(self._flat, cap, names, self.find_unused_parameters)

    def _arm_grad_buckets(self) -> None:
        buckets = self._grad_buckets
        if buckets is None:
            return
        if self._intra is not None:  # replica groups: every step, over the replica's ranks, exact
            comm, tag = self._intra, "grads"
        else:
            if self.compressor is not None:
                # compressed gradient averaging is one compressed all-reduce per flat buffer after backward (buffers
                # exact, beside it): the buckets' overlap is not combined with compression
                return
            plan = self._overlap_grads()
            if plan is None:
                return
            comm, tag = plan

        def launch(tensor: Tensor) -> CommHandle:
            return comm.all_reduce(tensor, op="avg", tag=tag, async_op=True)

        buckets.arm(launch, key=(comm, tag))

    def _finish_grad_buckets(self, comm: Communicator, tag: str) -> list[Tensor] | None:
        """In ``average_grads``: if buckets were launched during backward, launch the rest and wait for all; return
        what they averaged, or ``None`` when this step announced no overlap."""
        buckets = self._grad_buckets
        if buckets is None or not buckets.armed:
            return None
        if buckets.key != (comm, tag):
            raise RuntimeError(
                f"average_grads(tag={tag!r}) over another communicator or tag than {type(self).__name__}."
                f"_overlap_grads() announced for this step ({buckets.key[1]!r})"
            )
        return buckets.finish(comm)

    def _check_grad_buckets_finished(self) -> None:
        """After ``_after_backward``: the announced average must have been taken."""
        buckets = self._grad_buckets
        if buckets is not None and buckets.armed:
            buckets.finish(self.comm)  # nothing left in flight, then say whose contract was broken
            raise RuntimeError(
                f"{type(self).__name__}._overlap_grads() announced a gradient average for this step, but "
                "_after_backward did not call average_grads with that communicator and tag"
            )

    def _abandon_grad_buckets(self) -> None:
        """The step failed: never wait for buckets in flight (a peer may be gone)."""
        if self._grad_buckets is not None:
            self._grad_buckets.abandon()
