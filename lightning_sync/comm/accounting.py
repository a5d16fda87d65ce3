"""The one accounting path: every collective a strategy issues is recorded here by :class:`Communicator`."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

#: Tags that are not training communication: the initial broadcast and checkpoint-state gathering.
BOOKKEEPING_TAGS = frozenset({"setup", "checkpoint", "verify"})
#: The level of the traffic inside a replica group (``SyncStrategy(replica_size=...)``): recorded as
#: ``"intra/<tag>"`` by the intra-replica communicator; every other tag is traffic between replicas
INTRA = "intra"


def is_bookkeeping(tag: str) -> bool:
    """Whether ``tag`` (``"<tag>"`` or ``"<level>/<tag>"``) is bookkeeping rather than training traffic."""
    return tag.rpartition("/")[2] in BOOKKEEPING_TAGS


def is_intra(tag: str) -> bool:
    """Whether ``tag`` was recorded by an intra-replica communicator (``"intra/<tag>"``)."""
    return tag.startswith(INTRA + "/")


class CommStats:
    """Per-rank communication totals, broken down by tag (``"params"``, ``"grads"``, ``"vote"``, ...).

    For every operation: ``bytes_sent`` (what this rank put on the wire, :mod:`lightning_sync.comm.cost`),
    ``ops`` (collectives issued), ``blocking`` (those the training thread waited on at the call) and
    ``blocked_seconds`` (wall time the training thread spent inside blocking calls and ``wait()`` on
    asynchronous handles, emulated link delay included). Lives next to its ``state_dict`` so totals survive a
    resume. Thread-safe: a parameter server's threads record their sends here too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.ops: dict[str, int] = defaultdict(int)
        self.blocking: dict[str, int] = defaultdict(int)
        self.blocked_seconds: dict[str, float] = defaultdict(float)

    def __getstate__(self) -> dict[str, Any]:  # spawn pickles the strategy, and its stats, to every worker
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def record_launch(self, tag: str, nbytes: int, blocking: bool) -> None:
        with self._lock:
            self.bytes_sent[tag] += nbytes
            self.ops[tag] += 1
            if blocking:
                self.blocking[tag] += 1

    def record_blocked(self, tag: str, seconds: float) -> None:
        with self._lock:
            self.blocked_seconds[tag] += seconds

    def level(self, name: str) -> LevelStats:
        """A view that records into these totals under ``"<name>/<tag>"`` (a communicator of another network
        level: :data:`INTRA`, the ranks of one replica group)."""
        return LevelStats(self, name)

    def total_bytes(self, include_bookkeeping: bool = False) -> int:
        return sum(v for k, v in self.bytes_sent.items() if include_bookkeeping or not is_bookkeeping(k))

    def total_ops(self, include_bookkeeping: bool = False) -> int:
        return sum(v for k, v in self.ops.items() if include_bookkeeping or not is_bookkeeping(k))

    def total_blocking(self, include_bookkeeping: bool = False) -> int:
        return sum(v for k, v in self.blocking.items() if include_bookkeeping or not is_bookkeeping(k))

    def total_blocked_seconds(self, include_bookkeeping: bool = False) -> float:
        return sum(v for k, v in self.blocked_seconds.items() if include_bookkeeping or not is_bookkeeping(k))

    @property
    def has_levels(self) -> bool:
        """Whether any traffic was recorded inside a replica group (``"intra/<tag>"``)."""
        with self._lock:
            return any(is_intra(k) for k in self.ops)

    def summary(self) -> dict[str, float]:
        """Flat metrics: training totals plus per-tag bytes (``bytes_<tag>``). With replica groups also the training
        totals per level: ``bytes_intra`` / ``blocked_intra_s`` (inside the replica, tags ``intra/<tag>``) and
        ``bytes_inter`` / ``blocked_inter_s`` (every other tag: between replicas)."""
        out: dict[str, float] = {
            "bytes_sent": float(self.total_bytes()),
            "collectives": float(self.total_ops()),
            "blocking_collectives": float(self.total_blocking()),
            "blocked_s": self.total_blocked_seconds(),
        }
        if self.has_levels:
            with self._lock:
                sent, blocked = dict(self.bytes_sent), dict(self.blocked_seconds)
            for name, inside in (("intra", True), ("inter", False)):
                out[f"bytes_{name}"] = float(
                    sum(v for k, v in sent.items() if is_intra(k) == inside and not is_bookkeeping(k))
                )
                out[f"blocked_{name}_s"] = sum(
                    v for k, v in blocked.items() if is_intra(k) == inside and not is_bookkeeping(k)
                )
        for tag, value in sorted(self.bytes_sent.items()):
            out[f"bytes_{tag}"] = float(value)
        return out

    def state_dict(self, pending: tuple[tuple[str, int, bool], ...] = ()) -> dict[str, Any]:
        """The totals so far, plus ``pending`` launches ``(tag, bytes, blocking)`` that are certain to be issued
        right after this snapshot and belong in it. A checkpoint part is written before the barrier that orders
        the main file after every part; the part counts that barrier ahead, so a run resumed from it continues
        from exactly the totals the uninterrupted run had when the save ended (its blocked time is not known ahead
        and is left out: a wall-clock measurement, not a count)."""
        with self._lock:
            state = {
                "bytes_sent": dict(self.bytes_sent),
                "ops": dict(self.ops),
                "blocking": dict(self.blocking),
                "blocked_seconds": dict(self.blocked_seconds),
            }
        for tag, nbytes, blocking in pending:
            state["bytes_sent"][tag] = state["bytes_sent"].get(tag, 0) + nbytes
            state["ops"][tag] = state["ops"].get(tag, 0) + 1
            if blocking:
                state["blocking"][tag] = state["blocking"].get(tag, 0) + 1
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bytes_sent = defaultdict(int, state["bytes_sent"])
        self.ops = defaultdict(int, state["ops"])
        self.blocking = defaultdict(int, state["blocking"])
        self.blocked_seconds = defaultdict(float, state["blocked_seconds"])


class LevelStats:
    """What a communicator of another network level records into: the same :class:`CommStats`, every tag as
    ``"<level>/<tag>"`` (:meth:`CommStats.level`)."""

    def __init__(self, stats: CommStats, level: str) -> None:
        self.stats = stats
        self.prefix = f"{level}/"

    def record_launch(self, tag: str, nbytes: int, blocking: bool) -> None:
        self.stats.record_launch(self.prefix + tag, nbytes, blocking)

    def record_blocked(self, tag: str, seconds: float) -> None:
        self.stats.record_blocked(self.prefix + tag, seconds)

    def level(self, name: str) -> LevelStats:
        return LevelStats(self.stats, name)
