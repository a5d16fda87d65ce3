"""A replica group of several processes on torchft: the leader is the group's one member of the quorum, the others
mirror its outcomes over the replica's own communicator (:class:`ReplicaMirror`, :class:`MirroredPending`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from lightning_sync.comm.ft.errors import FaultToleranceError
from lightning_sync.comm.ft.replica_group import PendingAllReduce, QuorumInfo, ReplicaGroupComm

__all__ = ["MirroredPending", "ReplicaMirror"]


class ReplicaMirror:
    """A replica group of several processes (one Lightning job of a node, exact data parallelism inside): its first
    process (the *leader*) is the group's one member of the torchft quorum (a :class:`ReplicaGroupComm`); the others
    follow it over the replica's own communicator ``intra``. The same interface as :class:`ReplicaGroupComm`, called by
    every process at the same points: the leader runs each operation with the other groups, then broadcasts its outcome
    inside the replica (the quorum's answer and a state received from a peer, an all-reduce's result, a commit's
    verdict), so every process of the group decides alike and holds the same values. Bytes inside the replica are the
    replica level's (``"intra/ft"``, ``"intra/<tag>"``); between groups only the leader sends, as with replica groups
    (:mod:`~lightning_sync.strategies.replicas`).

    Args:
        inner: the leader's :class:`ReplicaGroupComm` (built with ``load_state_dict=mirror.capture``, set once built);
            ``None`` on the other processes.
        intra: the communicator over the replica group's processes (leader = its rank 0).
        load_state_dict: how every process loads a state the leader received from a peer.
        leader: whether this process is the leader (the replica group's rank 0).
    """

    def __init__(
        self, inner: ReplicaGroupComm | None, intra: Any, load_state_dict: Callable[[Any], None], leader: bool
    ) -> None:
        self.inner = inner
        #: whether this process is the group's leader (its ``inner`` is set once it joined the quorum)
        self.leader = leader
        self.intra = intra
        self._load = load_state_dict
        self._captured: Any = None
        self._step = 0
        self._state: dict[str, int] = {}
        self._why = "an error in this quorum"

    def capture(self, state: Any) -> None:
        """The leader's ``load_state_dict`` for torchft: kept until the quorum's outcome is shared."""
        self._captured = state

    def _share(self, value: Any) -> Any:
        return self.intra.broadcast_object(value, src=0, tag="ft")

    def agree(self, value: Any) -> Any:
        """The leader's ``value`` on every process of the group."""
        return self._share(value if self.leader else None)

    # ------------------------------------------------------------------ quorum and commit
    def quorum(self, timeout: timedelta | None = None) -> QuorumInfo:
        payload: Any = None
        if self.leader:
            self._captured = None
            try:
                info = self.inner.quorum(timeout)
                payload = ("ok", info, self._captured, self.inner.state_dict())
            except FaultToleranceError as err:
                payload = ("error", str(err))
            self._captured = None
        payload = self._share(payload)
        if payload[0] == "error":
            raise FaultToleranceError(payload[1])
        _, info, received, state = payload
        self._step, self._state = info.step, state
        if received is not None:
            self._load(received)
        return info

    def commit(self) -> bool:
        verdict = (self.inner.commit(), self.inner.state_dict(), self.inner.why()) if self.leader else None
        committed, self._state, self._why = self._share(verdict)
        self._step = int(self._state.get("step", self._step))
        return bool(committed)

    @property
    def step(self) -> int:
        return self.inner.step if self.leader else self._step

    def why(self) -> str:
        return self.inner.why() if self.leader else self._why

    # ------------------------------------------------------------------ collectives over the quorum
    def _spread(self, ok: bool | None, tensors: Sequence[Tensor], tag: str) -> bool:
        """The leader's outcome, then (on success) its result, to every process of the group."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        self.intra.broadcast(flag, src=0, tag="ft")
        if not int(flag.item()):
            return False
        for t in tensors:
            if t.numel():
                self.intra.broadcast(t, src=0, tag=tag)
        return True

    def all_reduce(self, tensors: Sequence[Tensor], op: str = "avg", tag: str = "params") -> bool:
        ok = self.inner.all_reduce(tensors, op=op, tag=tag) if self.leader else None
        return self._spread(ok, tensors, tag)

    def all_reduce_async(self, tensors: Sequence[Tensor], op: str = "avg", tag: str = "params") -> MirroredPending:
        inner = self.inner.all_reduce_async(tensors, op=op, tag=tag) if self.leader else None
        return MirroredPending(self, inner, list(tensors), tag)

    def all_gather_object(self, obj: Any, tag: str = "setup") -> list[Any] | None:
        gathered = self.inner.all_gather_object(obj, tag=tag) if self.leader else None
        return self._share(gathered)

    def gather_groups(self, obj: Any, tag: str = "setup") -> list[Any] | None:
        return self.all_gather_object(obj, tag=tag)  # the leader's gather, shared in the group

    # ------------------------------------------------------------------ state and shutdown
    def state_dict(self) -> dict[str, int]:
        return self.inner.state_dict() if self.leader else dict(self._state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._state = dict(state)
        self._step = int(state.get("step", self._step))
        if self.leader:
            self.inner.load_state_dict(state)

    def shutdown(self) -> None:
        if self.leader:
            self.inner.shutdown()


class MirroredPending:
    """:meth:`ReplicaMirror.all_reduce_async`'s handle: the leader's all-reduce in flight; :meth:`wait` shares its
    outcome and result inside the replica group (every process calls it at the same point)."""

    def __init__(self, mirror: ReplicaMirror, inner: PendingAllReduce | None, tensors: list[Tensor], tag: str) -> None:
        self.mirror = mirror
        self.inner = inner
        self.tensors = tensors
        self.tag = tag
        self.ok: bool | None = None

    def is_completed(self) -> bool:
        return self.ok is not None or (self.inner is not None and self.inner.is_completed())

    def wait(self) -> bool:
        if self.ok is None:
            ok = self.inner.wait() if self.inner is not None else None
            self.ok = self.mirror._spread(ok, self.tensors, self.tag)
        return self.ok
