"""What a rank says when a peer fails: failure reports through the rendezvous store, and :class:`PeerFailure`.

* A rank whose run fails with an exception posts ``rank r failed: <type>: <message>`` to the rendezvous store (the
  default process group's store) before its process exits: the strategies call :func:`report_failure` from
  ``on_exception``, which Lightning runs before tearing down.
* A rank whose collective, point-to-point operation or store request then fails because a peer is gone (gloo: the
  connection closed; any backend: the operation reached the process-group timeout) raises :class:`PeerFailure`
  instead of the backend's error (kept as ``__cause__``). Its message names the failed rank(s), read back from
  the store: a peer that posted a report is quoted (``Rank 1 failed: RuntimeError: ...``); a peer that posted
  nothing within a short grace period, while every survivor marks itself as such, ``stopped without reporting an
  error`` (killed, crashed or hung); a store that cannot be reached means the process hosting it is gone (rank 0
  under ``MASTER_ADDR``/``MASTER_PORT`` rendezvous). An operation over a subgroup names only silent members of that
  group (a rank outside it may be blocked on this one, e.g. on a replica group's leader, and cannot notice before
  this rank goes); a survivor whose group's members all reported takes over the diagnosis one of them posted.

**At exit.** A rank that reported a failure or raised :class:`PeerFailure` lingers when its interpreter exits (an
``atexit`` hook, at most :data:`LINGER_S`): it destroys its gloo process groups, so peers blocked in a collective
with it fail now rather than when the process is gone, then waits until every other rank not known to be gone has
posted its report or survivor mark (so a store hosted by this rank, rank 0 under Lightning's launchers, SLURM or a
plain ``env://`` start, stays up until they have read it) and for the threads registered with
:func:`wait_at_exit` (the parameter server's watch threads: a daemon thread woken inside a blocking
``torch.distributed`` wait while the interpreter shuts down aborts the process). A rank that was killed cannot
linger: the survivors then say that its store is unreachable (rank 0) or that it stopped without a report.
Without a failure, the same ``atexit`` hook destroys the process groups of a process whose strategy called
:func:`destroy_groups_at_exit` (every strategy does at setup): a gloo group alive at exit aborts the process about
half the time.

Everything here is best effort and bounded: reading and writing reports never raises (a failure to do so is said in
the message) and the grace period is at most :data:`MAX_GRACE_S`.
"""

from __future__ import annotations

import atexit
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

#: longest wait, after noticing a failure, for the other ranks' reports
MAX_GRACE_S = 5.0
#: longest wait at exit, after a failure, for the other ranks to read this rank's report (see the module docstring)
LINGER_S = 10.0
_KEY = "lightning_sync/fault/{}"
_PRIMARY, _SECONDARY, _DIAGNOSED = "primary", "secondary", "diagnosed"
# lower-case fragments of the errors gloo, NCCL and the TCPStore raise when a peer is gone or an operation timed out
_SIGNS = (
    "connection closed",
    "connection reset",
    "connection refused",
    "closed by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "failed to recv",
    "failed to send",
    "socket",
    "aborted",
    "remote worker",
)
_MAX_CAUSE = 240
_SOURCE = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\]\s*")  # gloo's "[.../pair.cc:561] " source locations

# this process's diagnosis (what happened, failed ranks, reports), reused by later failures of the same run
_last: tuple[str, list[int], dict[int, str]] | None = None
# after a failure: the ranks known to be gone (not waited for at exit); None while no failure is pending
_stopping: set[int] | None = None
_exit_threads: list[threading.Thread] = []
_hook_registered = False
_destroy_at_exit = False


class PeerFailure(RuntimeError):
    """A peer rank failed or disappeared, so this rank cannot go on.

    Attributes:
        rank: this rank.
        failed_ranks: the ranks found to have failed (reported an error) or gone (reported nothing in time);
            empty when the store could not be reached.
        reports: what each failed rank reported, by rank.
    """

    def __init__(self, message: str, rank: int, failed_ranks: list[int], reports: dict[int, str]) -> None:
        super().__init__(message)
        self.rank = rank
        self.failed_ranks = failed_ranks
        self.reports = reports

    def __reduce__(self) -> Any:
        return (type(self), (self.args[0], self.rank, self.failed_ranks, self.reports))


class PeerGone(RuntimeError):
    """Inside the comm layer: a peer said that it stopped, or its connection closed (becomes a :class:`PeerFailure`)."""


def is_comm_failure(err: BaseException) -> bool:
    """Whether ``err``, raised by a ``torch.distributed`` operation or store request, says a peer or the
    connection to it is gone or an operation timed out (rather than, say, a wrong tensor argument)."""
    if isinstance(err, PeerFailure):
        return False
    if isinstance(err, (dist.DistError, PeerGone)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(sign in text for sign in _SIGNS)


def _short(err: BaseException) -> str:
    text = _SOURCE.sub("", " ".join(str(err).split()))
    if len(text) > _MAX_CAUSE:
        text = text[: _MAX_CAUSE - 3] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _sentence(text: str) -> str:
    return text if text.endswith((".", "?", "!")) else text + "."


def _store() -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a group initialised without a store
        return None


def default_timeout() -> timedelta | None:
    """The default process group's timeout (the rendezvous store gets the same one), or ``None``."""
    store = _store()
    try:
        return store.timeout if store is not None else None
    except Exception:  # noqa: BLE001
        return None


def _grace(store: Any) -> float:
    try:
        seconds = store.timeout.total_seconds()
    except Exception:  # noqa: BLE001
        seconds = MAX_GRACE_S * 4
    return min(MAX_GRACE_S, max(0.5, seconds / 4))


def _post(store: Any, rank: int, kind: str, text: str) -> None:
    store.set(_KEY.format(rank), f"{kind}\n{text}")


def _read(store: Any, rank: int, world_size: int) -> dict[int, tuple[str, str]]:
    reports = {}
    for r in range(world_size):
        key = _KEY.format(r)
        if r != rank and store.check([key]):
            kind, _, text = bytes(store.get(key)).decode().partition("\n")
            reports[r] = (kind, text)
    return reports


def _arm(gone: Iterable[int] = ()) -> None:
    """A failure is pending on this rank: linger at exit (see the module docstring)."""
    global _stopping
    _stopping = set(gone) if _stopping is None else _stopping | set(gone)
    _register_exit_hook()


def _register_exit_hook() -> None:
    global _hook_registered
    if not _hook_registered:
        atexit.register(_at_exit)
        _hook_registered = True


def destroy_groups_at_exit() -> None:
    """Destroy this process's process groups when its interpreter exits (after the failure linger, if one is
    pending). A process whose gloo group is still alive at exit aborts (SIGABRT) about half the time, whatever
    launched it (measured: 17 of 30 two-process ``env://`` runs with torch's plain gloo; 0 of 30 with the groups
    destroyed in an ``atexit`` hook). Lightning's launchers keep the group after ``fit`` (``test`` may follow), so
    the strategies call this from ``setup_environment``: the group lives as long as the script does."""
    global _destroy_at_exit
    _destroy_at_exit = True
    _register_exit_hook()


def _at_exit() -> None:
    _linger()
    if _destroy_at_exit and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the interpreter is exiting: nothing left to tell
            pass


def wait_at_exit(thread: threading.Thread) -> None:
    """After a failure: let ``thread`` end (bounded by :data:`LINGER_S`) before the interpreter shuts down."""
    _exit_threads.append(thread)


def _linger() -> None:
    global _stopping
    gone, _stopping = _stopping, None
    if gone is None:
        return
    deadline = time.monotonic() + LINGER_S
    store = _store()
    if store is not None:
        try:
            rank, world_size, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
            store.set_timeout(timedelta(seconds=LINGER_S))
            if backend == "gloo":  # the store object stays alive with this reference
                dist.destroy_process_group()  # every group: peers waiting on this rank fail now
            waited = [r for r in range(world_size) if r != rank and r not in gone]
            while time.monotonic() < deadline:
                reports = _read(store, rank, world_size)
                if all(r in reports for r in waited):
                    break
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - best effort, bounded
            pass
    for thread in _exit_threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    _exit_threads.clear()


def reset() -> None:
    """A run starts on this rank: forget the last failure (diagnosis, pending exit wait) and withdraw this rank's
    report of an earlier run."""
    global _last, _stopping
    _last = None
    _stopping = None
    _exit_threads.clear()
    store = _store()
    if store is None:
        return
    try:
        store.delete_key(_KEY.format(dist.get_rank()))
    except Exception:  # noqa: BLE001 - best effort
        pass


def report_failure(exception: BaseException) -> None:
    """Post ``rank r failed: <exception>`` for the other ranks (nothing for a :class:`PeerFailure`: this rank is a
    survivor, and said so when it diagnosed it). Never raises."""
    if isinstance(exception, PeerFailure):
        return
    store = _store()
    if store is None:
        return
    _arm()
    try:
        _post(store, dist.get_rank(), _PRIMARY, _short(exception))
    except Exception:  # noqa: BLE001 - the store may be gone too
        pass


def peer_failure(what: str, err: BaseException, among: Sequence[int] | None = None) -> PeerFailure:
    """The :class:`PeerFailure` to raise on this rank because ``what`` failed with ``err`` (a comm failure).

    Reads the other ranks' reports, marks this rank as a survivor in the store, then reads again until one
    reported an error, every other rank marked itself a survivor, or the grace period (a quarter of the timeout, at
    most :data:`MAX_GRACE_S`) is over; ranks that said nothing by then are named as gone. ``among``: the global ranks
    of the failed operation's group (default: every rank): only they are waited for and can be named as gone; when
    all of them reported, the diagnosis one of them posted (the rank this one was blocked on) is taken over.
    """
    global _last
    if not (dist.is_available() and dist.is_initialized()):
        return PeerFailure(f"{what} failed with {_short(err)} (no process group left to ask)", -1, [], {})
    rank, world_size = dist.get_rank(), dist.get_world_size()
    peers = [r for r in (sorted(set(among)) if among is not None else range(world_size)) if r != rank]
    noticed = f"Rank {rank} stops: {what} failed with {_short(err)}"
    if _last is not None:
        head, failed_ranks, known = _last
        return PeerFailure(f"{head} {noticed}", rank, failed_ranks, known)
    store = _store()
    reports: dict[int, tuple[str, str]] = {}
    unreachable: BaseException | None = None
    if store is None:
        unreachable = RuntimeError("no rendezvous store")
    else:
        try:
            grace = _grace(store)
            deadline = time.monotonic() + grace
            store.set_timeout(timedelta(seconds=grace + 1.0))  # a hung store host must not hold this rank
            reports = _read(store, rank, world_size)  # before the mark: a failed rank lingers until it is seen
            _post(store, rank, _SECONDARY, noticed)
            while not (any(kind == _PRIMARY for kind, _ in reports.values()) or all(r in reports for r in peers)):
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
                reports = _read(store, rank, world_size)
        except Exception as store_err:  # noqa: BLE001
            unreachable = store_err
    failed = {r: text for r, (kind, text) in reports.items() if kind == _PRIMARY}
    if unreachable is not None:
        why = _sentence(_short(unreachable))
        head = (
            "The rendezvous store cannot be reached, so the process that hosts it (rank 0 under MASTER_ADDR/"
            f"MASTER_PORT rendezvous) is most likely gone (killed or crashed; see its log): {why}"
        )
        failed_ranks = [0] if store is not None else []
    elif failed:
        head = " ".join(f"Rank {r} failed: {_sentence(text)}" for r, text in sorted(failed.items()))
        failed_ranks = sorted(failed)
    else:
        silent = [r for r in peers if r not in reports]
        diagnosed = [text.partition("\n") for r, (kind, text) in sorted(reports.items()) if kind == _DIAGNOSED]
        if not silent and diagnosed and diagnosed[0][0]:  # blocked on a survivor: its diagnosis is the cause
            named, _, head = diagnosed[0]
            silent = [int(r) for r in named.split(",")]
        elif silent:
            names = ", ".join(str(r) for r in silent)
            head = (
                f"Rank{'s' if len(silent) > 1 else ''} {names} stopped without reporting an error (killed, crashed "
                f"or hung; see {'their logs' if len(silent) > 1 else 'its log'})."
            )
        else:
            head = (
                "No rank reported an error; every other rank also saw an operation fail ("
                + "; ".join(
                    text.partition("\n")[2] if kind == _DIAGNOSED else text
                    for kind, text in (reports[r] for r in sorted(reports))
                )
                + ")."
            )
        failed_ranks = silent
    known = {r: failed.get(r, "no report") for r in failed_ranks}
    failure = PeerFailure(f"{head} {noticed}", rank, failed_ranks, known)
    if unreachable is None and store is not None:
        try:  # the diagnosis, for a rank blocked on this one (it notices only when this one is gone)
            named = ",".join(str(r) for r in failed_ranks) if not failed else ""
            _post(store, rank, _DIAGNOSED, f"{named}\n{failure}")
        except Exception:  # noqa: BLE001
            pass
    _last = (head, failed_ranks, known)
    _arm([] if unreachable is not None else [r for r in failed_ranks if r not in reports])
    return failure


@contextmanager
def failures(what: str, among: Sequence[int] | None = None) -> Iterator[None]:
    """Turn a comm failure raised inside the block into a :class:`PeerFailure` (other errors pass through);
    ``among``: the global ranks of the operation's group (default: every rank)."""
    try:
        yield
    except RuntimeError as err:
        if not is_comm_failure(err):
            raise
        raise peer_failure(what, err, among) from err
