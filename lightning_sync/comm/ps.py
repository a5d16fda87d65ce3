"""A sharded parameter server co-located with the workers, over ``torch.distributed`` gloo point-to-point.

Every rank is a worker and serves the shards a :class:`~lightning_sync.core.ps.ShardPlan` gives it. Per rank:

* the **server receiver** thread takes workers' messages (``recv`` from any source on the *push* group) and
  applies them to this rank's :class:`~lightning_sync.core.ps.ShardServer`;
* the **server sender** thread sends the replies the server decided on (global parameters, acknowledgements)
  on the *pull* group, in order, so a slow receiver never stalls the receiver thread;
* the **mailbox** thread receives this rank's replies (``recv`` from any source on the pull group) into one
  inbox per server, which the training thread reads without blocking (ALADDIN) or waits on (ASP/SSP).

One group per direction, so a worker's sends and a server's replies never queue behind each other; the training
thread's collectives use the default group. Messages are byte tensors: a 32-byte header (kind, epoch, flag, α as
float64) and, for parameter payloads, the packed shards (the kinds and who answers what:
:mod:`~lightning_sync.comm.ps_protocol`). gloo sends complete when the receiver has taken them.
A worker's messages to its own rank's server are applied in-process (nothing is sent). All tensors are CPU
tensors (gloo), also when training on GPU.

Shutdown: at fit end every worker flushes, all ranks meet, then every worker sends STOP to every other rank's
server, which answers CLOSE and exits after the last STOP; a mailbox exits after the last CLOSE, and all threads
are joined. On an exception nothing is waited for: the threads are daemons and never keep the process alive.

Failures: ranks never meet during an epoch, and a receive from any source is not woken when one peer's
connection closes, so one **watch** thread per peer waits on a receive from that peer alone, which only the peer's
goodbye completes: "closing" at shutdown, "stopping" when its run fails (:meth:`ParameterServer.abandon`); gloo
fails it as soon as the peer's connection closes (killed). Any thread's error, and a "stopping" goodbye, is
recorded and raised in the training thread at its next push, flush or wait, as a
:class:`~lightning_sync.comm.fault.PeerFailure` naming the failed rank when the error says a peer is gone; so is a
failed send, acknowledgement or work-counter request (:mod:`~lightning_sync.comm.work`, whose store lives on rank
0). A rank that stops lets its watch threads end before its interpreter shuts down
(:func:`~lightning_sync.comm.fault.wait_at_exit`, bounded): a daemon thread woken inside a blocking
``torch.distributed`` wait during shutdown aborts the process (SIGABRT, measured with 3 ranks).

**Compression** (``compressor``, :mod:`lightning_sync.comm.compression`): a push's payload is the worker's delta
in the wire format — the integer formats with error feedback per server (the residual of each remote server's
shards, a stream of the compressor, so it is checkpointed with the strategy) — and the server decodes it into fp32
and adds it to its fp32 shards, which stay the master copy. A pull's payload is the server's parameters in the wire
format, without error feedback (a pull replaces the replica, nothing accumulates to feed back): the worker's replica
then holds the global parameters **rounded to the wire format** — nearest bf16/fp16, or int8/int4/int2 with one
scale per 256 elements (error at most half a step, ``max|x| / 254``, ``/ 14`` or ``/ 2`` of its block) — while the
servers keep them exact. What a rank exchanges with its own server is not sent and stays exact, and so does the
all-gather of the global model at meeting points (validation, checkpoints, fit end).

**Link emulation** (``link``): a message costs ``latency + bytes / bandwidth`` on its receiver's side, before it
is applied or delivered, and every message a rank receives — workers' pushes into its server, its servers'
replies into its mailbox — goes through that rank's one incoming link, a
:class:`~lightning_sync.comm.link.LinkClock` shared by the two receiving threads: concurrent messages share the
bandwidth, as on one network interface. (Before, each thread slept for its own messages on its own, so a rank
received pushes and replies at twice the bandwidth — which DDP's emulation, one link per rank, never gets.)

Accounting goes to the rank's :class:`~lightning_sync.comm.accounting.CommStats`: ``push`` (worker → server
payloads), ``pull`` (server → worker payloads, counted on the server's rank), ``ps_control`` (header-only
messages) and ``work`` (work-assignment claims). Bytes are the message sizes actually sent; seconds blocked are
the training thread's waits.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sync.comm.accounting import CommStats
from lightning_sync.comm.communicator import Communicator
from lightning_sync.comm.compression import Compressor, decode, encode
from lightning_sync.comm.fault import PeerGone, failures, is_comm_failure, peer_failure, wait_at_exit
from lightning_sync.comm.forksafe import GATE, start_thread
from lightning_sync.comm.link import LinkClock, LinkModel
from lightning_sync.comm.ps_protocol import (
    ACK,
    BYE_CLOSE,
    BYE_STOP,
    CLOSE,
    DONE,
    FLUSH,
    HEADER_BYTES,
    PARAMS,
    PUSH,
    STOP,
    WATCH_TAG,
    read_header,
    write_header,
)
from lightning_sync.comm.work import WorkCounter
from lightning_sync.core.ps import Reply, ShardPlan, ShardServer

__all__ = ["HEADER_BYTES", "ParameterServer", "WorkCounter", "check_cpu"]

# the threads' receives wait for messages, never for a deadline: they are woken by STOP/CLOSE
_THREAD_TIMEOUT = timedelta(days=7)


def check_cpu(tensor: Tensor, what: str) -> None:
    """The server groups are gloo on CPU tensors; anything else is an error, not a silent copy."""
    if tensor.device.type != "cpu":
        raise ValueError(
            f"the parameter server moves CPU tensors over gloo point-to-point; {what} is on {tensor.device}. "
            "Stage it on the CPU first (the strategies do: NCCL has no any-source receive for a server to use)."
        )


class ParameterServer:
    """The transport and threads around this rank's :class:`ShardServer`, and the worker side of the protocol.

    Args:
        plan: the sharding, identical on every rank.
        server: this rank's server (its ``params`` are this rank's packed shards).
        stats: the rank's accounting.
        link: optional link emulation: each message this rank receives is delayed by ``latency + bytes/bandwidth``
            on the rank's one incoming link (shared by the server's and the mailbox's receiving threads).
        timeout: how long the training thread waits for a reply or acknowledgement before raising.
        dtype: element type of the parameters (and of the payloads without compression).
        compressor: optional compression of the pushes and pulls (see the module docstring).

    Every rank must construct it at the same point (it creates two process groups).
    """

    def __init__(
        self,
        plan: ShardPlan,
        server: ShardServer,
        stats: CommStats,
        link: LinkModel | None = None,
        timeout: timedelta = timedelta(minutes=30),
        dtype: torch.dtype = torch.float32,
        compressor: Compressor | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ParameterServer needs an initialised torch.distributed default process group")
        check_cpu(server.params, "the server's parameters")
        self.plan = plan
        self.server = server
        self.stats = stats
        self.link = link
        #: this rank's emulated incoming link, shared by the receiving threads (None without emulation)
        self.incoming = LinkClock(link) if link is not None else None
        self.timeout = timeout
        self.dtype = dtype
        self.compressor = compressor
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if plan.world_size != self.world_size:
            raise ValueError(f"plan is for {plan.world_size} ranks, the world has {self.world_size}")
        self.elsize = torch.empty((), dtype=dtype).element_size()
        self.servers = plan.servers()
        self.remote_servers = [s for s in self.servers if s != self.rank]
        self.peers = [r for r in range(self.world_size) if r != self.rank]
        # one group per direction (gloo also when the default group is NCCL)
        self.push_group = dist.new_group(list(range(self.world_size)), backend="gloo", timeout=_THREAD_TIMEOUT)
        self.pull_group = dist.new_group(list(range(self.world_size)), backend="gloo", timeout=_THREAD_TIMEOUT)
        self._server_lock = threading.Lock()
        # worker side: send buffers per remote server, inbox per server
        self._send_bufs = {
            s: torch.empty(HEADER_BYTES + self.payload_bytes(plan.numel(s)), dtype=torch.uint8) for s in self.servers
        }
        # compression: each remote server's shards of a push in fp32 before encoding (persistent, reused)
        self._push_scratch = (
            {s: torch.empty(plan.numel(s), dtype=dtype) for s in self.remote_servers} if compressor is not None else {}
        )
        self._ctrl_bufs = {s: torch.empty(HEADER_BYTES, dtype=torch.uint8) for s in self.peers}
        self._pending_sends: list[tuple[Any, str, int]] = []
        self._local_buf = torch.empty(plan.numel(self.rank), dtype=dtype)  # this rank's shards of a push
        self._inbox = {s: torch.empty(plan.numel(s), dtype=dtype) for s in self.servers}
        self._inbox_alpha: dict[int, float | None] = {}
        self._inbox_new: set[int] = set()
        self._acks = 0
        self._closes = 0
        self._mail = threading.Condition()
        self.params_received = {s: 0 for s in self.servers}
        self.pushes = 0
        # server side
        self._outbox: queue.Queue[tuple[int, int, Tensor | None, float | None] | None] = queue.Queue()
        self._stops = 0
        self._error: BaseException | None = None
        self._error_thread = ""
        self._closed = False
        # started for this fit, joined at its end (close); their work runs inside the fork gate, their waits
        # outside it (lightning_sync.comm.forksafe): a DataLoader forking its workers meanwhile copies no lock of theirs
        self._threads = [
            start_thread(self._guard(self._serve), f"ps-server-{self.rank}"),
            start_thread(self._guard(self._send_replies), f"ps-sender-{self.rank}"),
            start_thread(self._guard(self._receive_mail), f"ps-mailbox-{self.rank}"),
        ]
        self._threads += [
            start_thread(self._guard(self._watch, peer), f"ps-watch-{self.rank}-{peer}") for peer in self.peers
        ]

    def payload_bytes(self, numel: int) -> int:
        """Bytes of a parameter payload of ``numel`` elements on the wire (compressed when compressing)."""
        if self.compressor is None:
            return numel * self.elsize
        return self.compressor.fmt.record_bytes(numel)

    # ------------------------------------------------------------------ threads
    def _guard(self, fn: Any, *args: Any) -> Any:
        def run() -> None:
            try:
                fn(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the training thread
                with GATE.busy():
                    if not self._closed and self._error is None:
                        self._error = err
                        self._error_thread = threading.current_thread().name
                    with self._mail:
                        self._mail.notify_all()

        return run

    def _watch(self, peer: int) -> None:
        """Wait for ``peer``'s goodbye; gloo fails the receive when the peer's connection closes first."""
        with GATE.busy():
            buf = torch.zeros(1, dtype=torch.uint8)
            work = dist.irecv(buf, src=peer, group=self.push_group, tag=WATCH_TAG)
            try:
                with GATE.idle():
                    work.wait()
            except RuntimeError as err:
                if is_comm_failure(err):
                    raise PeerGone(f"the connection to rank {peer} closed or failed: {err}") from err
                raise
            if int(buf.item()) == BYE_STOP:
                raise PeerGone(f"rank {peer} stopped: its run failed")

    def _delay(self, nbytes: int) -> None:
        """Hold a received message until its transfer on this rank's incoming link completes."""
        if self.incoming is not None:
            self.incoming.sleep_until_complete(self.incoming.start(nbytes, time.perf_counter()))

    def _serve(self) -> None:
        with GATE.busy():
            numel = self.plan.numel(self.rank)
            size = HEADER_BYTES + self.payload_bytes(numel)
            buf = torch.empty(max(size, HEADER_BYTES), dtype=torch.uint8)
            if self.compressor is None:
                payload = buf[HEADER_BYTES:size].view(self.dtype)
            else:
                payload = torch.empty(numel, dtype=self.dtype)  # the decoded delta
            while self._stops < len(self.peers):
                work = dist.irecv(buf, src=None, group=self.push_group)
                with GATE.idle():
                    work.wait()
                src = work.source_rank()
                kind, epoch, flag, _ = read_header(buf)
                self._delay(size if kind == PUSH else HEADER_BYTES)
                if kind == PUSH:
                    if self.compressor is not None:
                        decode(self.compressor.fmt, buf[HEADER_BYTES:size], payload)
                    with self._server_lock:
                        replies = self.server.push(src, payload, epoch, want_reply=bool(flag))
                        self._dispatch(replies)
                elif kind == DONE:
                    with self._server_lock:
                        self._dispatch(self.server.finish_epoch(src, epoch))
                elif kind == FLUSH:
                    self._outbox.put((src, ACK, None, None))
                elif kind == STOP:
                    self._stops += 1
                    self._outbox.put((src, CLOSE, None, None))
                else:
                    raise RuntimeError(f"parameter server on rank {self.rank}: unknown message kind {kind} from {src}")
            self._outbox.put(None)

    def _dispatch(self, replies: list[Reply]) -> None:
        """Called with the server lock held: hand each reply a snapshot of the global parameters."""
        for reply in replies:
            if reply.worker == self.rank:
                with self._mail:
                    self.server.view(out=self._inbox[self.rank])
                    self._deliver(self.rank, reply.alpha)
            else:
                self._outbox.put((reply.worker, PARAMS, self.server.view(), reply.alpha))

    def _send_replies(self) -> None:
        with GATE.busy():
            numel = self.plan.numel(self.rank)
            buf = torch.empty(HEADER_BYTES + self.payload_bytes(numel), dtype=torch.uint8)
            payload = buf[HEADER_BYTES:].view(self.dtype) if self.compressor is None else buf[HEADER_BYTES:]
            scratch = torch.empty(numel if self.compressor is not None else 0, dtype=self.dtype)  # their encoding
            while True:
                with GATE.idle():
                    item = self._outbox.get()
                if item is None:
                    return
                worker, kind, params, alpha = item
                write_header(buf, kind, alpha=alpha)
                if kind == PARAMS:
                    assert params is not None
                    if self.compressor is None:
                        payload.copy_(params)
                    else:
                        encode(self.compressor.fmt, params, payload, scratch=scratch, what="the pulled parameters")
                    msg, tag = buf, "pull"
                else:
                    msg, tag = buf[:HEADER_BYTES], "ps_control"
                self.stats.record_launch(tag, msg.numel(), blocking=False)
                work = dist.isend(msg, dst=worker, group=self.pull_group)
                with GATE.idle():
                    work.wait()

    def _receive_mail(self) -> None:
        with GATE.busy():
            largest = max([self.payload_bytes(self.plan.numel(s)) for s in self.remote_servers], default=0)
            buf = torch.empty(HEADER_BYTES + largest, dtype=torch.uint8)
            while self._closes < len(self.peers):
                work = dist.irecv(buf, src=None, group=self.pull_group)
                with GATE.idle():
                    work.wait()
                src = work.source_rank()
                kind, _, _, alpha = read_header(buf)
                if kind == PARAMS:
                    numel = self.plan.numel(src)
                    nbytes = self.payload_bytes(numel)
                    self._delay(HEADER_BYTES + nbytes)
                    with self._mail:
                        payload = buf[HEADER_BYTES : HEADER_BYTES + nbytes]
                        if self.compressor is None:
                            self._inbox[src].copy_(payload.view(self.dtype))
                        else:
                            decode(self.compressor.fmt, payload, self._inbox[src])
                        self._deliver(src, alpha)
                    continue
                self._delay(HEADER_BYTES)
                with self._mail:
                    if kind == ACK:
                        self._acks += 1
                    elif kind == CLOSE:
                        self._closes += 1
                    else:
                        raise RuntimeError(f"worker on rank {self.rank}: unknown message kind {kind} from {src}")
                    self._mail.notify_all()

    def _deliver(self, server: int, alpha: float | None) -> None:
        """With ``_mail`` held: the inbox of ``server`` holds new global parameters."""
        self._inbox_alpha[server] = alpha
        self._inbox_new.add(server)
        self.params_received[server] += 1
        self._mail.notify_all()

    # ------------------------------------------------------------------ worker side (training thread)
    def _check(self) -> None:
        err = self._error
        if err is not None:
            if is_comm_failure(err):
                raise peer_failure(f"parameter-server thread {self._error_thread}", err) from err
            raise RuntimeError(f"parameter server thread {self._error_thread} failed: {err!r}") from err
        bad = [t.name for t in self._threads if not t.is_alive()]
        if bad and self.peers and not self._closed:
            raise RuntimeError(f"parameter server threads {bad} on rank {self.rank} stopped unexpectedly")

    def _wait_sends(self) -> None:
        if not self._pending_sends:
            return
        start = time.perf_counter()
        for work, tag, dst in self._pending_sends:
            with failures(f"a {tag} send to rank {dst}"):
                work.wait(self.timeout)
        self.stats.record_blocked(self._pending_sends[0][1], time.perf_counter() - start)
        self._pending_sends.clear()

    def push(self, delta: Tensor, epoch: int, want_reply: bool, wait: bool) -> None:
        """Send this worker's ``delta`` (the whole flat vector, CPU) to every server; with ``want_reply`` each
        server answers with its global parameters (see :meth:`wait_params`). ``wait=False`` returns with the sends
        in flight (ALADDIN): they are completed before the next message reuses the buffers."""
        check_cpu(delta, "the pushed delta")
        self._check()
        self._wait_sends()
        self.pushes += 1
        for s in self.remote_servers:
            buf = self._send_bufs[s]
            write_header(buf, PUSH, epoch, int(want_reply))
            if self.compressor is None:
                self.plan.gather(delta, s, out=buf[HEADER_BYTES:].view(self.dtype))
            else:
                shards = self.plan.gather(delta, s, out=self._push_scratch[s])
                feedback = self.compressor.feedback(f"push/{s}", shards.numel(), shards.dtype, shards.device)
                residual = None if feedback is None else feedback.worker
                # the gathered shards serve as the encoding's scratch once the residual holds delta + residual
                encode(self.compressor.fmt, shards, buf[HEADER_BYTES:], residual, scratch=shards, what="the delta")
            self.stats.record_launch("push", buf.numel(), blocking=wait)
            self._pending_sends.append((dist.isend(buf, dst=s, group=self.push_group), "push", s))
        if self.rank in self.servers:
            local = self.plan.gather(delta, self.rank, out=self._local_buf)
            with self._server_lock:
                self._dispatch(self.server.push(self.rank, local, epoch, want_reply))
        if wait:
            self._wait_sends()

    def wait_params(self) -> None:
        """Block until every server's reply to the last push has arrived (ASP, SSP)."""
        self._wait_mail(lambda: len(self._inbox_new) == len(self.servers), "pull", "global parameters")

    def _wait_mail(self, ready: Any, tag: str, what: str) -> None:
        start = time.perf_counter()
        deadline = start + self.timeout.total_seconds()
        with self._mail:
            while not ready():
                self._check()
                if time.perf_counter() > deadline:
                    late = TimeoutError(
                        f"rank {self.rank} waited {self.timeout} for {what} from the parameter servers "
                        f"(received from {sorted(self._inbox_new)} of {self.servers})"
                    )
                    raise peer_failure(f"waiting for {what}", late) from late
                self._mail.wait(timeout=1.0)
        self.stats.record_blocked(tag, time.perf_counter() - start)

    def has_params(self) -> bool:
        """Whether any server's global parameters arrived and were not taken yet (never blocks)."""
        with self._mail:
            return bool(self._inbox_new)

    def take_params(self, flat: Tensor, alpha: float | None = None) -> list[tuple[int, float | None]]:
        """Apply every server reply that has arrived to ``flat`` (CPU) and return ``(server, α)`` for each: replace
        the shards (α ``None`` in the reply and no ``alpha`` given) or mix them in, x ← (1−α)x + αx̃, with the
        reply's α or, when given, ``alpha``. Never blocks."""
        check_cpu(flat, "the worker's parameters")
        applied: list[tuple[int, float | None]] = []
        with self._mail:
            for s in sorted(self._inbox_new):
                a = alpha if alpha is not None else self._inbox_alpha.get(s)
                shards = self._inbox[s]
                offset = 0
                for start, end in self.plan.owned(s):
                    target = flat[start:end]
                    part = shards[offset : offset + end - start]
                    if a is None:
                        target.copy_(part)
                    else:
                        target.mul_(1.0 - a).add_(part, alpha=a)
                    offset += end - start
                applied.append((s, a))
            self._inbox_new.clear()
        return applied

    def reset_params(self, flat: Tensor) -> None:
        """Load this rank's shards from ``flat`` (CPU), e.g. from identical replicas when asynchronous training
        (re)starts. Call it on every rank at a meeting point with no push in flight, then meet again before
        anyone pushes."""
        check_cpu(flat, "the parameters to serve")
        if self.plan.numel(self.rank):
            with self._server_lock:
                self.plan.gather(flat, self.rank, out=self.server.params)
        with self._mail:
            self._inbox_new.clear()

    def finish_epoch(self, epoch: int) -> None:
        """This worker found the epoch's data consumed (SSP stops counting it as training for that epoch)."""
        self._check()
        self._wait_sends()
        for s in self.remote_servers:
            self._control(s, DONE, epoch)
        if self.rank in self.servers:
            with self._server_lock:
                self._dispatch(self.server.finish_epoch(self.rank, epoch))

    def _control(self, dst: int, kind: int, epoch: int = 0) -> None:
        buf = self._ctrl_bufs[dst]
        write_header(buf, kind, epoch)
        self.stats.record_launch("ps_control", HEADER_BYTES, blocking=True)
        with failures(f"a control message to rank {dst}"):
            dist.isend(buf, dst=dst, group=self.push_group).wait(self.timeout)

    def flush(self) -> None:
        """Return once every server has applied every message this worker sent (replies sent before are in the
        inbox). Collective-free; call it on all ranks and then meet (barrier) for a consistent global state."""
        self._check()
        self._wait_sends()
        with self._mail:
            expected = self._acks + len(self.remote_servers)
        for s in self.remote_servers:
            self._control(s, FLUSH)
        self._wait_mail(lambda: self._acks >= expected, "ps_control", "flush acknowledgements")

    def global_params(self, comm: Communicator, out: Tensor, tag: str) -> Tensor:
        """All-gather every rank's shards (including accumulated, not yet applied updates) into ``out`` (CPU).
        A collective: call it on every rank after :meth:`flush` and a barrier."""
        check_cpu(out, "the gathered parameters")
        largest = max(self.plan.numel(r) for r in range(self.world_size))
        mine = torch.zeros(max(largest, 1), dtype=self.dtype)
        numel = self.plan.numel(self.rank)
        if numel:
            with self._server_lock:
                self.server.view(out=mine[:numel])
        gathered = comm.all_gather(mine, tag=tag)
        for r in self.servers:
            self.plan.scatter(gathered[r, : self.plan.numel(r)], r, out)
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        with self._server_lock:
            state = self.server.state_dict()
        state["pushes"] = self.pushes
        state["params_received"] = dict(self.params_received)
        with self._mail:  # global parameters that arrived and are not applied yet (ALADDIN)
            state["inbox"] = {s: (self._inbox[s].clone(), self._inbox_alpha.get(s)) for s in self._inbox_new}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._server_lock:
            self.server.load_state_dict(state)
        self.pushes = state.get("pushes", 0)
        self.params_received.update(state.get("params_received", {}))
        with self._mail:
            for s, (params, alpha) in state.get("inbox", {}).items():
                self._inbox[s].copy_(params)
                self._inbox_alpha[s] = alpha
                self._inbox_new.add(s)

    # ------------------------------------------------------------------ shutdown
    def close(self, comm: Communicator, join_timeout: float = 30.0) -> None:
        """Clean shutdown, on every rank together: flush, meet, STOP every peer's server, join the threads,
        destroy the two groups."""
        if self._closed:
            return
        self.flush()
        comm.barrier(tag="ps_control")
        for peer in self.peers:
            self._control(peer, STOP)
        if not self.peers:
            self._outbox.put(None)
        # release every peer's watch thread for this rank (monitoring, not counted in the accounting)
        bye = torch.full((1,), BYE_CLOSE, dtype=torch.uint8)
        sends = [(p, dist.isend(bye, dst=p, group=self.push_group, tag=WATCH_TAG)) for p in self.peers]
        for peer, work in sends:
            with failures(f"the goodbye to rank {peer}"):
                work.wait(self.timeout)
        self._closed = True
        deadline = time.monotonic() + join_timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise RuntimeError(
                f"parameter server threads {alive} on rank {self.rank} did not stop within {join_timeout} s"
            )
        comm.barrier(tag="ps_control")  # every peer has stopped using the groups
        dist.destroy_process_group(self.push_group)
        dist.destroy_process_group(self.pull_group)

    def abandon(self) -> None:
        """After an exception: tell every peer that this rank stops (their watch threads raise, so they stop at their
        next step with a :class:`~lightning_sync.comm.fault.PeerFailure`). Nothing is waited for now; this rank's
        watch threads, which end when their peers stop too or are gone, are waited for (bounded) at exit. The threads
        are daemons and never keep the process alive."""
        if self._closed:
            return
        self._closed = True
        self._stop_bye = torch.full((1,), BYE_STOP, dtype=torch.uint8)
        self._stop_sends = []  # kept alive with their buffer; completed by the peers' watch threads, never waited
        for peer in self.peers:
            with contextlib.suppress(RuntimeError):  # best effort: that peer's connection may be gone already
                self._stop_sends.append(dist.isend(self._stop_bye, dst=peer, group=self.push_group, tag=WATCH_TAG))
        for t in self._threads:
            if t.name.startswith("ps-watch-"):
                wait_at_exit(t)

    @property
    def threads_alive(self) -> list[str]:
        return [t.name for t in self._threads if t.is_alive()]
