"""Lightning's own ``DistributedDataParallel`` under the pack's accounting and link emulation: a DDP communication
hook (``DistributedDataParallel.register_comm_hook``) and the accounting of DDP's buffer broadcasts.

:func:`allreduce_hook` does what PyTorch's default hook does
(``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``: divide the bucket by the world size,
all-reduce it asynchronously, hand the bucket back through a future), and in addition

* records each bucket's bytes (gloo's ring count, :func:`~lightning_sync.comm.cost.allreduce_bytes`) and one
  collective in a :class:`~lightning_sync.comm.accounting.CommStats` under the tag ``"grads"``;
* with a :class:`~lightning_sync.comm.link.LinkModel`, starts the bucket's emulated transfer on this rank's
  :class:`~lightning_sync.comm.link.LinkClock` when the hook is called, and returns a future that completes no
  earlier than that transfer **and** the real all-reduce. The hook itself returns at once: DDP's overlap of bucket
  all-reduces with the rest of backward stays real (later buckets' gradients are computed while earlier buckets are
  "on the wire"), and concurrent buckets share the one emulated link as real transfers would (fair share, see
  :class:`~lightning_sync.comm.link.LinkClock`). The futures are completed by one daemon thread
  (:class:`_Completer`), never by sleeping in gloo's worker thread, so the real collectives are not held back;
* records the time the training thread is blocked on them: DDP waits for every bucket's future at the end of
  backward (``Reducer::finalize_backward``), right after the last bucket was launched (all gradients are computed
  by then), so the blocked time of an iteration is ``max(0, last bucket completed - last bucket launched)``.

DDP also broadcasts rank 0's buffers before every forward (``forward_sync_buffers``, on by default; BatchNorm
statistics): :class:`BufferBroadcastAccounting` is a forward pre-hook on the DDP module that counts those
broadcasts as DDP issues them (one per dtype group, gloo's binomial tree count) and charges them on the same link,
blocking, as the real broadcast is.

Not charged: Lightning's own per-step 4-byte SIGTERM broadcast and the validation's ``sync_dist`` reductions
(Lightning issues them outside DDP, straight through ``torch.distributed``). Each costs at most one emulated latency
on a real network, so the DDP row is at most that optimistic.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sync.comm.accounting import CommStats
from lightning_sync.comm.cost import allreduce_bytes, broadcast_bytes
from lightning_sync.comm.forksafe import GATE, start_thread
from lightning_sync.comm.link import LinkClock, LinkModel

__all__ = [
    "BucketRecord",
    "BufferBroadcastAccounting",
    "DDPHookState",
    "allreduce_hook",
    "charge_broadcast",
    "emulated_allreduce",
]

#: DDP's ``broadcast_bucket_size`` default (``int(250 * 1024 * 1024)``), the coalescing limit of its broadcasts
DDP_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


@dataclass(frozen=True)
class BucketRecord:
    """One bucket all-reduce the hook carried: which iteration, DDP's bucket index, its size and the bytes sent."""

    iteration: int
    index: int
    numel: int
    element_size: int
    bytes_sent: int


class _Completer:
    """One daemon thread that completes result futures when both the real all-reduce has completed and the emulated
    transfer on the clock has (re-checking: a transfer started later can push an earlier one back)."""

    def __init__(self, clock: LinkClock) -> None:
        self.clock = clock
        self._cond = threading.Condition()
        self._items: list[_Pending] = []
        self._closed = False
        self._changes = 0  # counts submissions and notifications, so a wait never misses one made just before it
        self._thread = start_thread(self._run, "lightning-sync-ddp-link")

    def submit(self, item: _Pending) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the DDP link emulation was closed (the strategy was torn down)")
            self._items.append(item)
            self._changes += 1
            self._cond.notify()

    def notify(self) -> None:
        with self._cond:
            self._changes += 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._changes += 1
            self._cond.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        # the scan and the completions (DDP's callbacks) run inside the fork gate, the wait outside it
        # (lightning_sync.comm.forksafe)
        while True:
            with GATE.busy():
                with self._cond:
                    if self._closed and not self._items:
                        return
                    seen = self._changes
                    now = time.perf_counter()
                    due: list[_Pending] = []
                    wake = None
                    for item in self._items:
                        if not item.real.done():
                            continue
                        ready = self.clock.completion(item.key, now)
                        if now >= ready:
                            due.append(item)
                        else:
                            wake = ready if wake is None else min(wake, ready)
                    for item in due:
                        self._items.remove(item)
                for item in due:  # outside the lock: completing runs DDP's callbacks
                    self.clock.forget(item.key)
                    item.finish()
            if due:
                continue
            with self._cond:
                if self._changes == seen:
                    self._cond.wait(timeout=None if wake is None else max(0.0, wake - time.perf_counter()))


class _Pending:
    """A bucket in flight: its real all-reduce's future, its transfer on the clock and the future DDP waits on."""

    def __init__(
        self, real: torch.futures.Future, key: int, finish: Callable[[_Pending], None], device: torch.device
    ) -> None:
        self.real = real
        self.key = key
        # a future holding a CUDA tensor records its stream on completion, so DDP's wait synchronises with it
        self.result: torch.futures.Future = torch.futures.Future(devices=[device] if device.type == "cuda" else None)
        self._finish = finish

    def finish(self) -> None:
        self._finish(self)


class DDPHookState:
    """Per-rank state of :func:`allreduce_hook`: the accounting, the emulated link and what was carried.

    Args:
        stats: where bytes, collectives and blocked seconds are recorded.
        link: the emulated link (``None``: none; the real all-reduce only, still counted).
        group: the process group DDP reduces over (``None``: the default group).
        record_buckets: keep a :class:`BucketRecord` per bucket all-reduce in :attr:`buckets` (tests, diagnostics).
        tag: the accounting tag of the gradient all-reduces.

    Create it after the process group exists (``setup_environment``). :meth:`close` stops the completer thread.
    """

    def __init__(
        self,
        stats: CommStats,
        link: LinkModel | None = None,
        group: Any = None,
        record_buckets: bool = False,
        tag: str = "grads",
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DDPHookState needs an initialised torch.distributed default process group")
        if link is not None and not isinstance(link, LinkModel):
            raise ValueError(f"link must be a LinkModel or None, got {link!r}")
        self.stats = stats
        self.link = link
        self.group = group
        self.tag = tag
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.clock: LinkClock | None = LinkClock(link) if link is not None else None
        self.record_buckets = record_buckets
        #: every bucket all-reduce carried, when ``record_buckets``
        self.buckets: list[BucketRecord] = []
        #: iterations whose gradients were all-reduced (one per DDP backward that synchronised)
        self.iterations = 0
        #: seconds DDP communicated, summed over iterations: from an iteration's first bucket launch to its last
        #: bucket's completion (overlapped with backward, then blocked)
        self.comm_seconds = 0.0
        self._lock = threading.Lock()
        self._launched_first: float | None = None  # when this iteration's first bucket was launched
        self._launched_last: float | None = None  # when this iteration's last bucket was launched
        self._in_flight = 0  # this iteration's buckets not yet complete
        self._latest_done = 0.0  # latest completion among this iteration's buckets
        self._completer = _Completer(self.clock) if self.clock is not None else None

    def close(self) -> None:
        """Stop the completer thread (after the last backward)."""
        if self._completer is not None:
            self._completer.close()
            self._completer = None

    # -- bookkeeping of one iteration's buckets --------------------------------------------------------------
    def _launched(self, index: int, numel: int, element_size: int, nbytes: int, is_last: bool, now: float) -> None:
        with self._lock:
            if self.record_buckets:
                self.buckets.append(BucketRecord(self.iterations, index, numel, element_size, nbytes))
            self._in_flight += 1
            if self._launched_first is None:
                self._launched_first = now
            if is_last:
                self._launched_last = now
                self.iterations += 1
            self._settle()

    def _completed(self, now: float) -> None:
        with self._lock:
            self._in_flight -= 1
            self._latest_done = max(self._latest_done, now)
            self._settle()

    def _settle(self) -> None:
        """When the iteration's last bucket is launched and every bucket completed: charge the blocked time."""
        if self._launched_last is None or self._in_flight > 0:
            return
        self.stats.record_blocked(self.tag, max(0.0, self._latest_done - self._launched_last))
        assert self._launched_first is not None
        self.comm_seconds += max(0.0, self._latest_done - self._launched_first)
        self._launched_first = self._launched_last = None
        self._latest_done = 0.0


def emulated_allreduce(
    state: DDPHookState, tensor: Tensor, index: int = 0, is_last: bool = True
) -> torch.futures.Future:
    """Average ``tensor`` over the group in place (divide by the world size, then all-reduce SUM), asynchronously;
    returns a future holding ``tensor`` that completes no earlier than the real all-reduce and, under link
    emulation, the transfer's emulated completion. ``index`` and ``is_last`` say which of DDP's buckets this is."""
    nbytes = allreduce_bytes(tensor.numel(), tensor.element_size(), state.world_size, state.rank, state.backend)
    state.stats.record_launch(state.tag, nbytes, blocking=False)
    start = time.perf_counter()
    tensor.div_(state.world_size)  # as the default hook: divide first (no overflow in low precision)
    real = dist.all_reduce(tensor, group=state.group, async_op=True).get_future()
    state._launched(index, tensor.numel(), tensor.element_size(), nbytes, is_last, start)

    def done(value_of: torch.futures.Future) -> Tensor:
        state._completed(time.perf_counter())
        return value_of.value()[0]

    if state._completer is None or state.clock is None:
        return real.then(done)
    key = state.clock.start(nbytes, start)

    def finish(item: _Pending) -> None:
        try:
            value = item.real.value()[0]
        except Exception as err:  # the real all-reduce failed: DDP's wait raises it
            state._completed(time.perf_counter())
            item.result.set_exception(err)
            return
        state._completed(time.perf_counter())
        item.result.set_result(value)

    item = _Pending(real, key, finish, tensor.device)
    state._completer.submit(item)
    completer = state._completer
    real.add_done_callback(lambda _: completer.notify())
    return item.result


def allreduce_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """The DDP communication hook: :func:`emulated_allreduce` of the bucket's flat buffer (PyTorch's
    ``allreduce_hook`` semantics plus accounting and link emulation). Register with
    ``ddp_module.register_comm_hook(DDPHookState(...), allreduce_hook)`` before the first backward."""
    return emulated_allreduce(state, bucket.buffer(), bucket.index(), bucket.is_last())


# DDP checks the hook's annotations against the objects themselves; under postponed evaluation they are strings
allreduce_hook.__annotations__.update(
    {"state": DDPHookState, "bucket": dist.GradBucket, "return": torch.futures.Future[Tensor]}
)


def _dtype_groups(tensors: Sequence[Tensor], limit: int) -> list[int]:
    """Payload bytes of each flat tensor ``torch.distributed._broadcast_coalesced`` sends for ``tensors``: c10d's
    ``compute_bucket_assignment_by_size`` keeps one open bucket per dtype (one device here), adds each tensor to its
    dtype's bucket and closes the bucket once it holds ``limit`` bytes or more; each bucket is flattened and broadcast
    once."""
    open_groups: dict[torch.dtype, int] = {}
    sizes: list[int] = []
    for t in tensors:
        open_groups[t.dtype] = open_groups.get(t.dtype, 0) + t.numel() * t.element_size()
        if open_groups[t.dtype] >= limit:
            sizes.append(open_groups.pop(t.dtype))
    return sizes + [size for size in open_groups.values() if size > 0]


class BufferBroadcastAccounting:
    """A forward pre-hook on a ``DistributedDataParallel`` module: before DDP's own pre-forward broadcasts rank 0's
    buffers (``forward_sync_buffers``), record those broadcasts (tag ``"buffers"``) and charge them on the link.

    It makes the decision DDP makes (``will_sync_module_buffers()``, no custom buffer hook) and counts what
    ``_broadcast_coalesced`` sends: one broadcast per dtype group of the module's buffers (``modules_buffers``),
    gloo's binomial-tree bytes for this rank; each is charged its payload on the link (every rank receives or sends
    it at least once), blocking, as DDP's broadcast blocks.
    """

    def __init__(self, state: DDPHookState, tag: str = "buffers") -> None:
        self.state = state
        self.tag = tag

    def __call__(self, module: Any, args: Any) -> None:
        if not module.will_sync_module_buffers() or hasattr(module, "buffer_hook"):
            return
        limit = getattr(module, "broadcast_bucket_size", DDP_BROADCAST_BUCKET_BYTES)
        _charge_broadcasts(self.state, _dtype_groups(module.modules_buffers, limit), self.tag)


def charge_broadcast(state: DDPHookState, tensors: Sequence[Tensor], tag: str = "setup") -> None:
    """Record and charge a coalesced broadcast from rank 0 that already happened (DDP's construction broadcasts rank
    0's parameters and buffers, ``_sync_module_states``, before a hook can be registered)."""
    _charge_broadcasts(state, _dtype_groups(tensors, DDP_BROADCAST_BUCKET_BYTES), tag)


def _charge_broadcasts(state: DDPHookState, payloads: Sequence[int], tag: str) -> None:
    """Record one blocking broadcast from rank 0 per payload (gloo's tree bytes for this rank) and, under emulation,
    wait for each payload's transfer on the link; the time is charged as blocked."""
    start = time.perf_counter()
    for payload in payloads:
        state.stats.record_launch(tag, broadcast_bytes(payload, state.world_size, state.rank, 0), blocking=True)
        if state.clock is not None and state.world_size > 1:
            state.clock.sleep_until_complete(state.clock.start(payload, time.perf_counter()))
    state.stats.record_blocked(tag, time.perf_counter() - start)
