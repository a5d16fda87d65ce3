"""Gradient all-reduce in buckets, launched during backward as soon as each bucket's gradients are ready.

What ``DistributedDataParallel``'s reducer does, over :class:`~lightning_sync.comm.flat.FlatState`'s buffers and
through the :class:`~lightning_sync.comm.communicator.Communicator` (so bytes, collectives, blocked time and link
emulation stay the one accounting path):

* **Buckets** (:func:`plan_buckets`) are contiguous slices of each (device, dtype) group's flat gradient buffer,
  filled in *reverse* registration order — backward produces the last layers' gradients first — with whole
  parameters until a bucket holds at least ``bucket_cap_mb`` MiB (DDP's rule: a parameter larger than the cap is a
  bucket of its own). The slice that ends a group's buffer also carries the group's scratch tail, where the floating
  buffers (BatchNorm running statistics) travel with the gradients; they are copied in when that bucket is launched
  (the forward pass that updates them is over by then) and back after it completed. Unlike DDP, there is no separate
  1 MiB first bucket, and buckets are never rebuilt from the order observed at run time.
* **Launch.** Every trainable parameter has a post-accumulate-grad hook. While :class:`GradBuckets` is *armed* (the
  backward of a step that averages gradients), a parameter's hook marks it ready; a bucket whose parameters are all
  ready is launched as an asynchronous all-reduce — in a fixed order: bucket ``k`` only after buckets ``0..k-1``,
  as DDP's reducer does, so every rank issues the same collectives in the same order whatever order its autograd
  engine runs in. Its transfer is then really in flight while backward computes the earlier layers.
* **Finish** (:meth:`GradBuckets.finish`, after backward): buckets not launched yet — parameters that got no
  gradient in this backward, *unused parameters*, whose slots hold zeros — are launched now (DDP's
  ``find_unused_parameters`` marks them ready the same way), then every bucket is waited on. Only the waits block
  the training thread, so only they are counted as blocked time. With ``find_unused_parameters=True`` one more
  all-reduce (tag ``"unused"``, one int32 per parameter) tells every rank which parameters no rank used since the
  last step; their ``.grad`` is set to ``None`` so the optimizer skips them, exactly as DDP does. Without it, such a
  parameter has an all-zero averaged gradient that the optimizer applies like any other (weight decay and momentum
  act on it).

**Gradient accumulation**: only the backward of the micro-batch that steps is armed (Lightning runs the other
micro-batches' closures outside ``optimizer_step``); their hooks only record which parameters were used.

**Bytes**: ``k`` buckets send what one all-reduce of the whole buffer sends, up to gloo's ring segment rounding per
bucket (exactly the same total on 2 ranks, see :mod:`lightning_sync.comm.cost`): :func:`bucket_bytes`.

The collective is pluggable: :meth:`GradBuckets.arm` takes the function that launches one bucket's all-reduce and
returns its :class:`~lightning_sync.comm.communicator.CommHandle`, so a compressed all-reduce can be passed there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_sync.comm.communicator import CommHandle, Communicator
from lightning_sync.comm.cost import allreduce_bytes
from lightning_sync.comm.flat import FlatState
from lightning_sync.core.validation import check_real

__all__ = ["DEFAULT_BUCKET_CAP_MB", "Bucket", "GradBuckets", "bucket_bytes", "check_bucket_cap_mb", "plan_buckets"]

#: DDP's default ``bucket_cap_mb``
DEFAULT_BUCKET_CAP_MB = 25.0
_MIB = 1024 * 1024

Launch = Callable[[Tensor], CommHandle]


def check_bucket_cap_mb(value: Any) -> float | None:
    """The ``bucket_cap_mb`` argument: a bucket size in MiB, a number in (0, inf), or ``None`` (no overlap)."""
    if value is None:
        return None
    try:
        return check_real("bucket_cap_mb", value, 0.0, low_open=True)
    except ValueError as err:
        raise ValueError(f"{err} (or None: one all-reduce after backward, no overlap)") from None


@dataclass(frozen=True)
class Bucket:
    """One contiguous slice ``[start, stop)`` of ``flat.groups[group].grads``."""

    group: int
    start: int
    stop: int
    #: positions in ``module.parameters()`` of the parameters whose gradients the slice holds (reverse order)
    params: tuple[int, ...]
    #: those of :attr:`params` that are trainable: the bucket is ready when all of them have their gradient
    trainable: tuple[int, ...]
    #: whether the slice ends with the group's scratch tail (its floating buffers travel in this bucket)
    carries_buffers: bool

    @property
    def numel(self) -> int:
        return self.stop - self.start


def plan_buckets(flat: FlatState, bucket_cap_mb: float) -> list[Bucket]:
    """Buckets in launch order: per group, whole parameters in reverse registration order until a bucket holds
    ``>= bucket_cap_mb`` MiB of them; over groups, by the last-registered parameter they hold (a group holding only
    buffers goes last). Together the slices cover every group's gradient buffer exactly once."""
    cap = bucket_cap_mb * _MIB
    planned: list[tuple[int, Bucket]] = []
    for gi, g in enumerate(flat.groups):
        if g.grads.numel() == 0:
            continue
        size = g.grads.element_size()
        stop = g.grads.numel()  # the first bucket of a group (its last parameters) also takes the buffer tail
        members: list[int] = []
        nbytes = 0
        for j in reversed(range(len(g.params))):
            members.append(j)
            nbytes += g.param_views[j].numel() * size
            if nbytes >= cap or j == 0:
                start = g.param_offsets[j]
                planned.append(
                    (
                        max(g.param_order[m] for m in members),
                        Bucket(
                            group=gi,
                            start=start,
                            stop=stop,
                            params=tuple(g.param_order[m] for m in members),
                            trainable=tuple(g.param_order[m] for m in members if g.trainable[m]),
                            carries_buffers=stop == g.grads.numel() and g.buffer_numel > 0,
                        ),
                    )
                )
                stop, members, nbytes = start, [], 0
        if not g.params:  # buffers only
            planned.append((-1, Bucket(gi, 0, stop, (), (), True)))
    planned.sort(key=lambda kb: -kb[0])  # stable: a group's buckets keep their reverse order
    return [b for _, b in planned]


def bucket_bytes(flat: FlatState, buckets: list[Bucket], world_size: int, rank: int, backend: str) -> list[int]:
    """Bytes this rank sends for each bucket's all-reduce (:func:`~lightning_sync.comm.cost.allreduce_bytes`)."""
    return [
        allreduce_bytes(b.numel, flat.groups[b.group].grads.element_size(), world_size, rank, backend) for b in buckets
    ]


class GradBuckets:
    """The hooks and the per-step state of the bucketed, overlapped gradient all-reduce (see the module docstring).

    Args:
        flat: the strategy's flat state (gradients must be bound before each backward: ``flat.bind_grads()``).
        bucket_cap_mb: bucket size in MiB, > 0.
        names: ``{position in module.parameters(): name}``, for error messages.
        find_unused_parameters: exchange which parameters were used (one small all-reduce per step) and give the
            ones no rank used ``.grad = None``, as DDP does.

    Use: :meth:`arm` before the backward of a step that averages gradients, :meth:`finish` after it (returns the
    averaged gradient buffers); :meth:`abandon` on an error; :meth:`remove` at teardown. Thread-safe: on CUDA the
    hooks run on the autograd engine's device threads.
    """

    def __init__(
        self,
        flat: FlatState,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        names: dict[int, str] | None = None,
        find_unused_parameters: bool = False,
    ) -> None:
        if check_bucket_cap_mb(bucket_cap_mb) is None:
            raise ValueError("bucket_cap_mb must be a number in (0.0, inf) for GradBuckets, got None")
        self.flat = flat
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.buckets = plan_buckets(flat, bucket_cap_mb)
        self.find_unused_parameters = find_unused_parameters
        self._names = names or {}
        self._lock = threading.Lock()
        self._bucket_of: dict[int, int] = {}
        for k, b in enumerate(self.buckets):
            for i in b.trainable:
                self._bucket_of[i] = k
        self._params: dict[int, torch.nn.Parameter] = {}
        self._hooks: list[Any] = []
        for g in flat.groups:
            for p, i, train in zip(g.params, g.param_order, g.trainable):
                self._params[i] = p
                if train:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(i)))
        #: positions of the parameters that received a gradient since the last :meth:`finish`
        self.used: set[int] = set()
        self._launch: Launch | None = None
        self.key: Any = None
        self._pending: list[int] = []
        self._ready: set[int] = set()
        self._handles: list[CommHandle] = []
        self._staged: list[int] = []
        self._next = 0
        #: buckets launched by the hooks, before backward returned, in the last armed step
        self.launched_during_backward = 0
        #: ``time.perf_counter()`` of the last step's first launch and of its last completed wait
        self.first_launch_at: float | None = None
        self.finished_at: float | None = None

    # ------------------------------------------------------------------ per step
    @property
    def armed(self) -> bool:
        return self._launch is not None

    def arm(self, launch: Launch, key: Any = None) -> None:
        """Launch buckets with ``launch`` during the coming backward. ``key`` identifies the collective (the
        communicator and tag): :meth:`finish` callers check they finish the reduction they meant."""
        if self.armed:
            raise RuntimeError("GradBuckets.arm: the previous step's reduction was neither finished nor abandoned")
        with self._lock:
            self._launch = launch
            self.key = key
            self._pending = [len(b.trainable) for b in self.buckets]
            self._ready = set()
            self._handles = []
            self._staged = []
            self._next = 0
            self.launched_during_backward = 0
            self.first_launch_at = None
            self.finished_at = None

    def _hook(self, index: int) -> Callable[[Tensor], None]:
        def hook(_: Tensor) -> None:
            self._on_grad(index)

        return hook

    def _on_grad(self, index: int) -> None:
        with self._lock:
            self.used.add(index)
            if self._launch is None:
                return
            k = self._bucket_of[index]
            if index in self._ready:
                if k < self._next:
                    raise RuntimeError(
                        f"parameter {self._name(index)} received a second gradient in one backward after its bucket's "
                        "all-reduce was launched (e.g. reentrant activation checkpointing, or a parameter used in "
                        "two backward passes of one step). Use torch.utils.checkpoint(..., use_reentrant=False), "
                        "or a strategy without overlap (bucketing is BSP's, OSP's and Sync-Switch's)."
                    )
                return
            self._ready.add(index)
            self._pending[k] -= 1
            self._launch_ready(during_backward=True)

    def _launch_ready(self, during_backward: bool, force: bool = False) -> None:
        """Launch buckets in order while the next one is ready (every bucket left, when ``force``)."""
        assert self._launch is not None
        while self._next < len(self.buckets) and (force or self._pending[self._next] == 0):
            b = self.buckets[self._next]
            if b.carries_buffers:
                self.flat.stage_buffers(b.group)
                self._staged.append(b.group)
            if self.first_launch_at is None:
                self.first_launch_at = time.perf_counter()
            self._handles.append(self._launch(self.flat.groups[b.group].grads[b.start : b.stop]))
            self._next += 1
            if during_backward:
                self.launched_during_backward += 1

    def finish(self, comm: Communicator | None = None) -> list[Tensor]:
        """After backward: launch what is left (buckets of unused parameters), wait for every bucket, put the
        averaged buffers back. With ``find_unused_parameters`` (``comm`` then required), parameters no rank used
        since the last finish get ``.grad = None``. Returns the averaged gradient buffers."""
        if not self.armed:
            raise RuntimeError("GradBuckets.finish without arm()")
        with self._lock:
            self._launch_ready(during_backward=False, force=True)
            handles = self._handles
            used = self.used
        try:
            exchange = self._exchange_used(comm, used) if self.find_unused_parameters else None
            for h in handles:
                h.wait()
            for gi in self._staged:
                self.flat.unstage_buffers(gi)
            if exchange is not None:
                handle, trainable, flags = exchange
                handle.wait()
                for i, n in zip(trainable, flags.tolist()):
                    if n == 0:  # no rank used it: no gradient at all, the optimizer skips it (as with DDP)
                        self._params[i].grad = None
        finally:
            self.finished_at = time.perf_counter()
            self._reset()
        return self.flat.grad_tensors()

    def _exchange_used(self, comm: Communicator | None, used: set[int]) -> tuple[CommHandle, list[int], Tensor]:
        """Launch the all-reduce of one int32 used-flag per trainable parameter (DDP's ``local_used_map``)."""
        if comm is None:
            raise RuntimeError("GradBuckets.finish needs the communicator when find_unused_parameters is on")
        trainable = sorted(self._bucket_of)
        device = self.flat.groups[0].grads.device if comm.backend == "nccl" else torch.device("cpu")
        flags = torch.tensor([1 if i in used else 0 for i in trainable], dtype=torch.int32).to(device)
        return comm.all_reduce(flags, op="sum", tag="unused", async_op=True), trainable, flags

    def abandon(self) -> None:
        """Forget the step in flight without waiting (on an error: a peer may be gone)."""
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        self._launch = None
        self.key = None
        self._handles = []
        self._staged = []
        self.used = set()

    def remove(self) -> None:
        """Remove the hooks (teardown)."""
        self.abandon()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _name(self, index: int) -> str:
        name = self._names.get(index)
        return f"{name!r} (parameter {index})" if name else f"{index} of module.parameters()"
