"""The only code in the pack that calls ``torch.distributed``.

Every operation is recorded by :class:`~lightning_sync.comm.accounting.CommStats` (bytes from
:mod:`lightning_sync.comm.cost`, ops, blocking ops, seconds blocked) and, when a
:class:`~lightning_sync.comm.link.LinkModel` is given, delayed by its emulated transfer time on the thread or
handle that carries it.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sync.comm.accounting import CommStats, LevelStats
from lightning_sync.comm.compression import Compressor, ErrorFeedback, FeedbackView
from lightning_sync.comm.cost import allgather_bytes, allreduce_bytes, broadcast_bytes, reduce_scatter_bytes
from lightning_sync.comm.fault import default_timeout, failures, reset, wait_at_exit
from lightning_sync.comm.forksafe import GATE, start_thread
from lightning_sync.comm.link import LinkClock, LinkModel

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "avg": dist.ReduceOp.SUM,
}


class CommHandle:
    """An asynchronous operation in flight.

    Wraps the ``torch.distributed`` ``Work``; with link emulation it is not complete before its emulated
    transfer on this rank's :class:`~lightning_sync.comm.link.LinkClock` (started at launch) has completed.
    :meth:`wait` charges the time spent waiting to the accounting as blocked time; :meth:`is_completed` never
    blocks. A wait that fails because a peer is gone raises :class:`~lightning_sync.comm.fault.PeerFailure`.
    """

    def __init__(
        self,
        work: Any,
        stats: CommStats,
        tag: str,
        transfer: tuple[LinkClock, int] | None = None,
        on_complete: Callable[[], None] | None = None,
        what: str = "an asynchronous operation",
        ranks: Sequence[int] | None = None,
    ) -> None:
        self._work = work
        self._what = what
        self._ranks = ranks  # the global ranks of the operation's group (None: every rank), for a failure's diagnosis
        self._stats = stats
        self._tag = tag
        self._transfer = transfer  # (clock, transfer id) under link emulation
        self._on_complete = on_complete
        self._done = False
        self.completed_at: float | None = None

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._work is not None and not self._work.is_completed():
            return False
        if self._transfer is None:
            return True
        clock, key = self._transfer
        now = time.perf_counter()
        return now >= clock.completion(key, now)

    def wait(self) -> None:
        if self._done:
            return
        start = time.perf_counter()
        if self._work is not None:
            with failures(self._what, self._ranks), GATE.idle():
                self._work.wait()
        if self._transfer is not None:
            clock, key = self._transfer
            clock.sleep_until_complete(key)
        if self._on_complete is not None:
            self._on_complete()
        self._done = True
        self.completed_at = time.perf_counter()
        self._stats.record_blocked(self._tag, self.completed_at - start)


class _Job:
    """An operation run by a :class:`_Driver`: quacks like a ``torch.distributed`` ``Work`` (``wait``,
    ``is_completed``); ``wait`` re-raises what the operation raised."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._fn()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            self._error = err
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class _Driver:
    """One thread that runs a communicator's asynchronous compressed all-reduces (and host-prepared all-reduces,
    :meth:`Communicator.all_reduce_from_host`), one after another in launch order, on a process group of their own.

    A compressed all-reduce is two collectives with computation between them (decode, sum, encode), so it cannot be
    one backend ``Work``. Run from this thread on a dedicated group, its collectives keep the same order on every
    rank whatever the training thread does meanwhile (its own blocking collectives on the communicator's group), and
    both stages overlap the training thread's compute. Its link emulation shares the rank's
    :class:`~lightning_sync.comm.link.LinkClock`; its waits are not charged as blocked time (the training thread
    is charged when it waits on the handle)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        name = f"comm-driver-{comm.backend}-{comm.rank}"
        self._thread = start_thread(self._run, name)

    def _run(self) -> None:
        # a job's computation runs inside the fork gate (its waits on handles and link sleeps outside it); its
        # blocking collectives meet the peers' drivers, which a fork never holds back (lightning_sync.comm.forksafe)
        while (job := self._jobs.get()) is not None:
            with GATE.busy():
                job.run()

    def submit(self, fn: Callable[[], None]) -> _Job:
        job = _Job(fn)
        self._jobs.put(job)
        return job

    def close(self, timeout: float = 30.0) -> None:
        """Let the queued operations finish, stop the thread and destroy the driver's group. A thread still inside
        a collective after ``timeout`` (a peer failed mid-operation) is left to the exit path's linger, with its
        group (destroying a group under a waiting thread can abort the process)."""
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            wait_at_exit(self._thread)
            return
        self.comm.destroy()


class Communicator:
    """Collectives over one process group, with accounting and optional link emulation.

    Tensors must live where the group's backend expects them (CPU for gloo, CUDA for NCCL). ``op="avg"`` is
    a SUM followed by an in-place division by the world size (gloo has no AVG), done on completion.

    An operation that fails because a peer is gone (connection closed, timeout) raises
    :class:`~lightning_sync.comm.fault.PeerFailure` naming the failed rank and its error (see
    :mod:`lightning_sync.comm.fault`). A communicator over the default group (``group=None``) starts a run: it
    withdraws this rank's failure report of an earlier run. Subgroups get the default group's timeout.
    """

    def __init__(
        self,
        stats: CommStats | LevelStats,
        link: LinkModel | None = None,
        group: Any = None,
        clock: LinkClock | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Communicator needs an initialised torch.distributed default process group")
        self.stats = stats
        self.link = link
        #: this rank's emulated link, shared with the communicators split from this one (one network interface)
        self.clock = clock if clock is not None else (LinkClock(link) if link is not None else None)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        #: the group's global ranks (None: the default group, every rank): who a failed operation can name as gone
        self.ranks: list[int] | None = None if group is None else list(dist.get_process_group_ranks(group))
        self.backend = str(dist.get_backend(group))
        self._cuda = self.backend == "nccl"
        self._drivers: dict[str, _Driver] = {}  # by the backend of the driver's group
        #: whether waits are charged as blocked time (a driver's communicator runs off the training thread: no)
        self._charge_blocked = True
        if group is None:
            reset()

    def split(self, backend: str | None = None) -> Communicator:
        """A second group over the same ranks (same accounting and link), so operations on it run independently
        of this one's: an asynchronous all-reduce in flight there does not hold back blocking collectives here.
        ``backend`` (default: this communicator's) e.g. ``"gloo"`` for host tensors beside an NCCL group.
        Every rank must call this in the same order."""
        comm = self.subgroup(range(dist.get_world_size()), backend=backend)
        assert comm is not None
        return comm

    def subgroup(
        self, ranks: Sequence[int], backend: str | None = None, level: str | None = None, link: LinkModel | None = None
    ) -> Communicator | None:
        """A communicator over ``ranks`` (global ranks, same accounting and link); ``None`` on the other ranks.
        Every rank of the world calls this at the same point with the same ``ranks`` (group creation is collective
        over the world; gloo hangs when only the members create groups in different orders).

        ``level`` (e.g. ``"intra"``: the ranks of one replica group) makes it a communicator of another network
        level: its operations are recorded in the same totals under ``"<level>/<tag>"`` and emulated on ``link``
        with a clock of their own (``None``: not emulated) instead of this communicator's link."""
        members = sorted(set(ranks))
        # new_group's default timeout is torch's (30 min), not the one the default group was given
        group = dist.new_group(ranks=members, backend=backend or self.backend, timeout=default_timeout())
        if dist.get_rank() not in members:
            return None
        if level is None:
            return Communicator(self.stats, self.link, group=group, clock=self.clock)
        return Communicator(self.stats.level(level), link, group=group)

    def destroy(self) -> None:
        """Destroy this communicator's own group (never the default group), and its driver's."""
        self.close()
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
            self.group = None

    def close(self) -> None:
        """Stop the driver threads of asynchronous operations, if any was started (idempotent)."""
        drivers, self._drivers = self._drivers, {}
        for driver in drivers.values():
            driver.close()

    # ------------------------------------------------------------------ internals
    def _src(self, src: int) -> dict[str, int]:
        """A broadcast's source: the global rank over the default group, the rank in the group over a subgroup."""
        return {"src": src} if self.group is None else {"group_src": src}

    def _emulate(self, nbytes: int) -> None:
        """A real collective has returned: wait for the device, then for its emulated transfer (sharing this rank's
        link with any transfer in flight)."""
        if self._cuda:
            torch.cuda.current_stream().synchronize()
        if self.clock is not None:
            self.clock.sleep_until_complete(self.clock.start(nbytes, time.perf_counter()))

    def _finish_blocking(self, tag: str, start: float, nbytes: int) -> None:
        """A blocking operation's real collective has returned: its emulated transfer follows (sharing this rank's
        link with any transfer in flight), then the time since ``start`` is charged as blocked."""
        self._emulate(nbytes)
        if self._charge_blocked:
            self.stats.record_blocked(tag, time.perf_counter() - start)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Tensor, op: str = "sum", tag: str = "other", async_op: bool = False) -> CommHandle:
        """All-reduce ``tensor`` in place. Returns a completed handle when ``async_op=False``."""
        if op not in _OPS:
            raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
        nbytes = allreduce_bytes(tensor.numel(), tensor.element_size(), self.world_size, self.rank, self.backend)
        self.stats.record_launch(tag, nbytes, blocking=not async_op)
        finish = (lambda: tensor.div_(self.world_size)) if op == "avg" and self.world_size > 1 else None
        start = time.perf_counter()
        what = f"all_reduce ({tag})"
        with failures(what, self.ranks):
            work = (
                dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=async_op)
                if self.world_size > 1
                else None
            )
        if async_op:
            transfer = (self.clock, self.clock.start(nbytes, start)) if self.clock is not None else None
            return CommHandle(work, self.stats, tag, transfer, finish, what=f"asynchronous {what}", ranks=self.ranks)
        self._finish_blocking(tag, start, nbytes)
        if finish is not None:
            finish()
        handle = CommHandle(None, self.stats, tag)
        handle._done = True
        return handle

    def all_reduce_many(self, tensors: Sequence[Tensor], op: str = "sum", tag: str = "other") -> None:
        """Blocking all-reduce of several flat tensors: launched back to back, then waited together."""
        if len(tensors) == 1:
            self.all_reduce(tensors[0], op=op, tag=tag)
            return
        handles = [self.all_reduce(t, op=op, tag=tag, async_op=True) for t in tensors]
        for h in handles:
            h.wait()

    def all_reduce_compressed(
        self,
        tensor: Tensor,
        compressor: Compressor,
        op: str = "avg",
        tag: str = "other",
        async_op: bool = False,
        feedback: ErrorFeedback | FeedbackView | None = None,
        divisor: float | None = None,
        contribute: bool = True,
    ) -> CommHandle:
        """All-reduce the flat tensor ``tensor`` in place in ``compressor``'s wire format: an all-to-all of encoded
        chunks, the sum of each chunk at its owner in fp32 (fp64 for float64), an all-gather of the encoded sums
        (:mod:`lightning_sync.comm.compression`). The result is identical on every rank.

        ``op="avg"`` divides the sum by the world size, ``"sum"`` does not; ``divisor`` divides by that instead (in
        the accumulation dtype, before the second encoding). ``feedback`` (the integer formats) is the stream's
        error-feedback state; ``contribute=False`` sends zeros (``tensor``'s values are ignored) and leaves the worker
        residual. Bytes recorded, per collective: :func:`~lightning_sync.comm.cost.compressed_allreduce_bytes`.

        ``async_op=True`` returns a handle at once: the operation runs on this communicator's driver thread, on a
        process group of its own created at the first asynchronous call (every rank must make that call at the
        same point, and the communicator must span the world); ``tensor`` must not be touched until the handle
        is waited on. A contiguous slice of a larger flat buffer is fine (a bucket)."""
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg' for a compressed all-reduce, got {op!r}")
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError("all_reduce_compressed needs a flat (1-D) contiguous tensor (a flat buffer or a slice)")
        div = divisor if divisor is not None else (float(self.world_size) if op == "avg" else None)
        fmt = compressor.fmt
        a2a, ag = fmt.allreduce_bytes(tensor.numel(), self.world_size)
        self.stats.record_launch(tag, a2a, blocking=not async_op)
        self.stats.record_launch(tag, ag, blocking=not async_op)
        what = f"compressed all_reduce ({tag})"
        if self.world_size == 1 or tensor.numel() == 0:
            if not contribute:
                tensor.zero_()
            elif div is not None and div != 1:
                tensor.div_(div)
            handle = CommHandle(None, self.stats, tag)
            handle._done = True
            return handle
        if async_op:
            driver = self._start_driver()
            job = driver.submit(
                lambda: driver.comm._compressed(tensor, compressor, div, feedback, contribute, tag, (a2a, ag))
            )
            return CommHandle(job, self.stats, tag, what=f"asynchronous {what}", ranks=self.ranks)
        with failures(what, self.ranks):
            self._compressed(tensor, compressor, div, feedback, contribute, tag, (a2a, ag))
        handle = CommHandle(None, self.stats, tag)
        handle._done = True
        return handle

    def _compressed(
        self,
        tensor: Tensor,
        compressor: Compressor,
        divisor: float | None,
        feedback: ErrorFeedback | FeedbackView | None,
        contribute: bool,
        tag: str,
        nbytes: tuple[int, int],
    ) -> None:
        """The three stages and two collectives of a compressed all-reduce, blocking, on this group."""
        start = time.perf_counter()
        ws = compressor.acquire(tensor.numel(), tensor.dtype, tensor.device, self.world_size)
        try:
            compressor.stage_encode(ws, tensor, feedback, contribute)
            dist.all_to_all_single(ws.recv, ws.send, group=self.group)
            self._emulate(nbytes[0])
            compressor.stage_reduce(ws, self.rank, divisor, feedback)
            _all_gather_single(ws.recv, ws.mine, group=self.group)
            self._emulate(nbytes[1])
            compressor.stage_decode(ws, tensor)
        finally:
            compressor.release(ws)
        if self._charge_blocked:
            self.stats.record_blocked(tag, time.perf_counter() - start)

    def _start_driver(self, backend: str | None = None) -> _Driver:
        backend = backend or self.backend
        if backend not in self._drivers:
            if self.world_size != dist.get_world_size():
                raise RuntimeError(
                    "an asynchronous compressed or host-prepared all-reduce needs a communicator over all ranks (its "
                    "driver's process group is created by every rank); on a subgroup use a blocking form"
                )
            # collective over the world: every rank reaches its first asynchronous call of this kind here
            comm = self.split(backend=backend)
            comm._charge_blocked = False
            self._drivers[backend] = _Driver(comm)
        return self._drivers[backend]

    def all_reduce_from_host(
        self, tensor: Tensor, prepare: Callable[[], None], op: str = "sum", tag: str = "other"
    ) -> CommHandle:
        """Off the training thread: run ``prepare`` (host work that fills ``tensor``, e.g. wait for a CUDA event,
        read a value the device computed and decide from it), then all-reduce ``tensor`` in place. ``tensor`` is a
        CPU tensor; both run on this communicator's host driver thread, on a gloo group of its own (created at the
        first call: every rank must make it at the same point), so the training thread goes on queuing work at once.
        Returns a handle; the wait on it is charged as blocked time, and re-raises what ``prepare`` raised. Bytes
        recorded at launch, as :meth:`all_reduce`'s."""
        if op not in _OPS:
            raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
        if tensor.device.type != "cpu":
            raise ValueError(f"all_reduce_from_host needs a CPU tensor, got one on {tensor.device}")
        nbytes = allreduce_bytes(tensor.numel(), tensor.element_size(), self.world_size, self.rank, "gloo")
        self.stats.record_launch(tag, nbytes, blocking=False)
        driver = self._start_driver("gloo")
        what = f"all_reduce ({tag}) from the host"

        def run() -> None:
            prepare()
            if self.world_size > 1:
                with failures(what, self.ranks):
                    dist.all_reduce(tensor, op=_OPS[op], group=driver.comm.group)
                driver.comm._emulate(nbytes)
            if op == "avg" and self.world_size > 1:
                tensor.div_(self.world_size)

        return CommHandle(driver.submit(run), self.stats, tag, what=f"asynchronous {what}", ranks=self.ranks)

    def broadcast(self, tensor: Tensor, src: int = 0, tag: str = "other") -> None:
        """Blocking broadcast from ``src``, a rank of this communicator's group (the global rank over the default
        group). Every rank's emulated delay is charged on the payload: each rank receives or sends it at least once,
        whatever its share of the tree's sends."""
        payload = tensor.numel() * tensor.element_size()
        self.stats.record_launch(tag, broadcast_bytes(payload, self.world_size, self.rank, src), blocking=True)
        start = time.perf_counter()
        if self.world_size > 1:
            with failures(f"broadcast ({tag})", self.ranks):
                dist.broadcast(tensor, group=self.group, **self._src(src))
        self._finish_blocking(tag, start, payload if self.world_size > 1 else 0)

    def all_gather(self, tensor: Tensor, tag: str = "other") -> Tensor:
        """Blocking all-gather; returns a new tensor of shape ``(world_size, *tensor.shape)``."""
        out = torch.empty((self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        nbytes = allgather_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        self.stats.record_launch(tag, nbytes, blocking=True)
        start = time.perf_counter()
        if self.world_size > 1:
            with failures(f"all_gather ({tag})", self.ranks):
                dist.all_gather(list(out.unbind(0)), tensor.contiguous(), group=self.group)
        else:
            out[0].copy_(tensor)
        self._finish_blocking(tag, start, nbytes)
        return out

    def all_gather_into(self, output: Tensor, input_: Tensor, tag: str = "other") -> None:
        """Blocking all-gather of every rank's flat ``input_`` into ``output`` (``world_size`` times its elements, in
        rank order): what FSDP2 all-gathers a module's shards with (:mod:`lightning_sync.comm.fsdp_comm`)."""
        nbytes = allgather_bytes(input_.numel() * input_.element_size(), self.world_size)
        self.stats.record_launch(tag, nbytes, blocking=True)
        start = time.perf_counter()
        with failures(f"all_gather ({tag})", self.ranks):
            _all_gather_single(output, input_, group=self.group)
        self._finish_blocking(tag, start, nbytes)

    def reduce_scatter_into(self, output: Tensor, input_: Tensor, reduce_op: Any, tag: str = "other") -> None:
        """Blocking reduce-scatter of the flat ``input_`` (``world_size`` chunks) with ``reduce_op`` (a
        ``torch.distributed.ReduceOp``, as the caller gives it), this rank's chunk into ``output``: FSDP2's reduction
        of a module's gradients. Bytes: :func:`~lightning_sync.comm.cost.reduce_scatter_bytes` (gloo all-reduces the
        whole input)."""
        nbytes = reduce_scatter_bytes(input_.numel(), input_.element_size(), self.world_size, self.rank, self.backend)
        self.stats.record_launch(tag, nbytes, blocking=True)
        start = time.perf_counter()
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        with failures(f"reduce_scatter ({tag})", self.ranks):
            scatter(output, input_, op=reduce_op, group=self.group)
        self._finish_blocking(tag, start, nbytes)

    def all_gather_differentiable(self, tensor: Tensor, tag: str = "other") -> Tensor:
        """All-gather whose backward all-reduces gradients (``torch.distributed.nn``), shape ``(N, *shape)``."""
        from torch.distributed.nn.functional import all_gather as _ag

        nbytes = allgather_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        self.stats.record_launch(tag, nbytes, blocking=True)
        start = time.perf_counter()
        with failures(f"all_gather ({tag})", self.ranks):
            out = torch.stack(_ag(tensor, group=self.group or dist.group.WORLD))
        self._finish_blocking(tag, start, nbytes)
        return out

    def all_gather_object(self, obj: Any, tag: str = "other") -> list[Any]:
        """Pickle-based all-gather of Python objects (checkpoint state, small metadata)."""
        nbytes = allgather_bytes(len(pickle.dumps(obj)), self.world_size)
        self.stats.record_launch(tag, nbytes, blocking=True)
        start = time.perf_counter()
        out: list[Any] = [None] * self.world_size
        if self.world_size > 1:
            with failures(f"all_gather_object ({tag})", self.ranks):
                dist.all_gather_object(out, obj, group=self.group)
        else:
            out[0] = obj
        self._finish_blocking(tag, start, nbytes)
        return out

    def broadcast_object(self, obj: Any, src: int = 0, tag: str = "other") -> Any:
        """Pickle-based broadcast (two broadcasts: the size, then the payload); recorded on completion, when
        every rank knows the payload size."""
        start = time.perf_counter()
        box = [obj]
        if self.world_size > 1:
            with failures(f"broadcast_object ({tag})", self.ranks):
                dist.broadcast_object_list(box, group=self.group, **self._src(src))
        payload = len(pickle.dumps(box[0])) + 8 if self.world_size > 1 else 0
        self.stats.record_launch(tag, broadcast_bytes(payload, self.world_size, self.rank, src), blocking=True)
        self._finish_blocking(tag, start, payload)
        return box[0]

    def barrier(self, tag: str = "other") -> None:
        self.stats.record_launch(tag, 0, blocking=True)
        start = time.perf_counter()
        if self.world_size > 1:
            with failures(f"barrier ({tag})", self.ranks):
                if self._cuda:
                    dist.barrier(group=self.group, device_ids=[torch.cuda.current_device()])
                else:
                    dist.barrier(group=self.group)
        self._finish_blocking(tag, start, 0)


def _all_gather_single(output: Tensor, input_: Tensor, group: Any = None) -> None:
    """``all_gather_single`` (torch >= 2.14) or its older name ``all_gather_into_tensor``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input_, group=group)


def destroy_default_group() -> None:
    """Destroy the default process group if it exists (spawned workers abort at exit otherwise)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
