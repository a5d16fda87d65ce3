"""The pack's threads and ``fork``: no thread of the pack does work while its process forks.

Lightning users run DataLoaders with workers, and a DataLoader forks its workers whenever an iterator is created
(every ``validate``, ``test`` and ``predict``, the sanity check, and each epoch without persistent workers). A fork
copies one thread — the one that forks — and every lock as it was at that instant: a lock another thread held (the
allocator's, the interpreter's I/O buffers', logging's, a library's own) stays held forever in the child, which
hangs the first time it needs it (issue 61: a DataLoader worker stuck inside ``os.fork()``). Two rules keep the
pack's threads out of that:

1. **A span.** Every thread the pack starts is started for the work of one ``fit`` and joined when it ends (the
   parameter server's threads at ``on_train_end``, a communicator's driver and the DDP link emulation at
   ``teardown``); :func:`live_threads` lists the ones alive, so a test can check that none outlives its fit.
2. **A gate at the fork** (:class:`ForkGate`, one per process, registered with :func:`os.register_at_fork`). A
   pack thread runs everything between two waits — what takes locks, allocates, runs torch's ops or records the
   accounting — inside :meth:`ForkGate.busy`; its waits (a gloo receive, send or collective, a queue, a sleep of
   the link emulation) are outside it, or inside :meth:`ForkGate.idle` when they are reached from inside a busy
   stretch. A fork first waits until no pack thread is busy and holds every pack thread that wakes meanwhile at
   the gate's door until the child exists; the parent's threads then go on. At the instant of the fork every pack
   thread is therefore blocked in a wait that holds no lock, or parked at the gate.

Why a gate and not a process: the parameter server's threads and a communicator's driver share the training
process's tensors (the flat parameters, the inbox, the residuals of error feedback) without a copy; a server
process would need the parameters in shared memory and its own process groups. The gate costs a fork a wait for the
longest busy stretch in progress (a decode and apply of one push, a compressed average's computation — short,
never a network wait) and costs the threads two uncontended lock operations a stretch.

Deadlock-free by construction: a busy stretch never waits on the network or on the training thread, so a fork's
wait ends; a thread held at the door holds nothing. The wait is bounded all the same (``timeout`` of
:class:`ForkGate`, 60 s): past it the fork goes on and a warning names the threads still busy.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["ForkGate", "GATE", "live_threads", "start_thread"]


class ForkGate:
    """Work sections of the pack's threads on one side, ``fork`` on the other (a readers-writer lock in which a
    fork is the writer and takes precedence).

    Args:
        timeout: the longest a fork waits for busy threads before it goes on with a warning (seconds).
    """

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._cond = threading.Condition(threading.Lock())
        self._busy: dict[int, int] = {}  # thread id -> depth of nested busy sections
        self._forking = 0
        self._local = threading.local()
        #: forks that waited for a busy thread, and the longest such wait (seconds): what the gate costs
        self.forks_waited = 0
        self.longest_wait_s = 0.0

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    @contextmanager
    def busy(self) -> Iterator[None]:
        """A stretch of work between two waits: a fork waits for it to end, and it does not start during a fork.
        Nested sections of one thread count once."""
        depth = self._depth()
        if depth == 0:
            self._enter()
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                self._leave()

    @contextmanager
    def idle(self) -> Iterator[None]:
        """A wait reached from inside a busy stretch (a gloo wait, a sleep): the thread is not busy while it waits,
        and goes back to busy (after any fork in progress) when it returns. A no-op outside busy stretches."""
        depth = self._depth()
        if depth == 0:
            yield
            return
        self._local.depth = 0
        self._leave()
        try:
            yield
        finally:
            self._enter()
            self._local.depth = depth

    def _enter(self) -> None:
        me = threading.get_ident()
        with self._cond:
            while self._forking:
                self._cond.wait()
            self._busy[me] = self._busy.get(me, 0) + 1

    def _leave(self) -> None:
        me = threading.get_ident()
        with self._cond:
            left = self._busy.get(me, 0) - 1
            if left > 0:
                self._busy[me] = left
            else:
                self._busy.pop(me, None)
            if not self._busy:
                self._cond.notify_all()

    def busy_threads(self) -> list[str]:
        """Names of the threads inside a busy stretch now."""
        with self._cond:
            idents = set(self._busy)
        return sorted(t.name for t in threading.enumerate() if t.ident in idents)

    # ------------------------------------------------------------------ the fork's side
    def before_fork(self) -> None:
        """In the forking thread, before ``fork``: wait (bounded) until no other pack thread is busy; from now on
        none starts a busy stretch until :meth:`after_fork_in_parent`."""
        me = threading.get_ident()
        start = time.monotonic()
        deadline = start + self.timeout
        with self._cond:
            self._forking += 1
            waited = False
            while any(t != me for t in self._busy):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                waited = True
                self._cond.wait(remaining)
            late = [t for t in self._busy if t != me]
        if waited:
            self.forks_waited += 1
            self.longest_wait_s = max(self.longest_wait_s, time.monotonic() - start)
        if late:
            names = sorted(t.name for t in threading.enumerate() if t.ident in late)
            warnings.warn(
                f"lightning-sync: a fork (a DataLoader starting its workers?) waited {self.timeout:.0f} s for the "
                f"pack's threads {names} to finish their work and goes on without them: the child may hang on a lock "
                "one of them holds. Report this with the strategy and its arguments.",
                RuntimeWarning,
                stacklevel=2,
            )

    def after_fork_in_parent(self) -> None:
        with self._cond:
            self._forking = max(0, self._forking - 1)
            self._cond.notify_all()

    def after_fork_in_child(self) -> None:
        """The child has only the forking thread: a fresh gate (the parent's threads and their sections are gone)."""
        self._cond = threading.Condition(threading.Lock())
        self._busy = {}
        self._forking = 0
        self._local = threading.local()


#: the process's gate, registered with ``os.register_at_fork`` when this module is imported
GATE = ForkGate()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=lambda: GATE.before_fork(),
        after_in_parent=lambda: GATE.after_fork_in_parent(),
        after_in_child=lambda: GATE.after_fork_in_child(),
    )

_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def start_thread(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """Start one of the pack's threads (a daemon, listed by :func:`live_threads`). ``target`` must run its work
    inside :meth:`ForkGate.busy` of :data:`GATE` and wait outside it."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    _THREADS.add(thread)
    thread.start()
    return thread


def live_threads() -> list[str]:
    """Names of the pack's threads alive now (started with :func:`start_thread`)."""
    return sorted(t.name for t in list(_THREADS) if t.is_alive())
