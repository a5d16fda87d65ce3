"""SelSync: selective synchronization (Tyagi & Swany, §III, Alg. 1, Eq. 2 and 4)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.optim import Optimizer

from lightning_sync.comm import CommHandle
from lightning_sync.core import DeviceGradientChangeTracker
from lightning_sync.core.outer import parse_outer_optimizer
from lightning_sync.core.validation import MAX_INT64, check_int, check_real
from lightning_sync.strategies.base import SyncStrategy

Aggregation = Literal["parameters", "gradients"]


class SelSyncStrategy(SyncStrategy):
    r"""Synchronise only the steps whose gradients changed significantly; apply the others locally.

    Per step (Alg. 1), on every rank:

    1. after backward, the squared norm of the local gradient (one fused dot product over the flat gradient
       buffer) feeds a :class:`~lightning_sync.core.DeviceGradientChangeTracker`: EWMA over ``window`` steps with
       factor ``smoothing``, relative change :math:`\Delta(g_i)` of Eq. 2;
    2. the rank votes :math:`\Delta(g_i) \ge \delta` (lines 10-11) and one 8-byte all-reduce sums the votes
       (line 12 — the paper all-gathers an N-bit array; a sum carries the same "any" plus the voter count). The
       same 8-byte all-reduce carries Lightning's per-step SIGTERM flag, so a local step costs one round trip;
    3. ``aggregation="parameters"`` (default, lines 9 and 13-15): the optimizer applies the local update, then, if
       any rank voted, parameters and buffers are averaged (one all-reduce). The vote's all-reduce is launched
       asynchronously before the update and waited on after it, so its latency overlaps the optimizer step.
       ``aggregation="gradients"``: if any rank voted, gradients (and buffers) are averaged before the update.

    **The decision stays on the device.** The norm, the EWMA window, :math:`\Delta` and the vote are float64
    tensors where the gradients are (the host :class:`~lightning_sync.core.GradientChangeTracker`'s arithmetic,
    bit for bit), and the vote all-reduce takes them from there. With parameter aggregation nothing is read on the
    host before the optimizer step is queued: the vote (with the SIGTERM flags and whether this rank's norm was
    finite) is read once, after the local update — the first point where the host needs the answer, to decide
    whether to average. Gradient aggregation needs the answer *before* the update, so it costs what the order of
    Alg. 1 implies: the norm needs the whole backward, the vote a round trip and a host read of it, and only then
    can the gradients (one all-reduce, not overlapped with backward) go; a local step still pays the vote's round
    trip before its update.

    :math:`\delta=0` syncs every step: with parameter aggregation and identical replicas this is BSP (for SGD
    with momentum and weight decay exactly, because the update is linear in the gradient: the mean of the
    ranks' momentum buffers follows BSP's momentum recursion; not with ``gradient_clip_val``, which clips each rank's
    local gradient before its update, where BSP clips the average). The first step has no previous smoothed norm, so
    no measured change: :math:`\Delta(g_1)=0` (it syncs only when :math:`\delta=0`). A :math:`\delta` above
    every :math:`\Delta` therefore sends no parameters at all: LSSR is exactly 1 and only the 8-byte votes travel.

    Args:
        delta: threshold :math:`\delta \ge 0` on the relative gradient change (``float('inf')`` allowed).
        window: EWMA window in steps (paper: 25), an integer in [1, 2**63 - 1].
        smoothing: EWMA factor in (0, 1]; ``None`` uses the paper's :math:`N/100` for world size N (capped at 1).
        aggregation: ``"parameters"`` (the paper's recommendation) or ``"gradients"``.
        outer_optimizer: ``None`` (plain averaging) or, with ``aggregation="parameters"``, an outer optimizer spec
            such as ``{"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}`` (DiLoCo's): each sync's mean
            of the replicas gives the pseudo-gradient, the outer optimizer steps the global parameters and every rank
            takes them (see :meth:`~lightning_sync.strategies.base.SyncStrategy.average_state`).
        **kwargs: :class:`~lightning_sync.strategies.base.SyncStrategy` arguments (``link``, ``verify_sync``...).
    """

    strategy_name = "selsync"
    strategy_description = "SelSync: sync when any rank's relative gradient change >= delta, else a local step"
    carries_sigterm = True  # the vote all-reduce carries Lightning's per-step SIGTERM flag: one round trip per step

    def __init__(
        self,
        delta: float = 0.3,
        window: int = 25,
        smoothing: float | None = None,
        aggregation: Aggregation = "parameters",
        outer_optimizer: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        check_real("delta", delta, 0.0, allow_inf=True)
        check_int("window", window, 1, MAX_INT64)
        if smoothing is not None:
            check_real("smoothing", smoothing, 0.0, 1.0, low_open=True)
        if aggregation not in ("parameters", "gradients"):
            raise ValueError(f"aggregation must be 'parameters' or 'gradients', got {aggregation!r}")
        self.outer_config = parse_outer_optimizer(outer_optimizer)
        if self.outer_config is not None and aggregation == "gradients":
            raise ValueError(
                "outer_optimizer must be None with aggregation='gradients': the outer optimizer steps on the "
                "pseudo-gradient of a parameter averaging (the global parameters minus the replicas' mean), and "
                "gradient aggregation averages gradients before the update and never averages parameters. Use "
                "aggregation='parameters' with an outer optimizer."
            )
        super().__init__(**kwargs)
        self.delta = float(delta)
        self.window = window
        self.smoothing = smoothing
        self.aggregation: Aggregation = aggregation
        self.tracker: DeviceGradientChangeTracker | None = None
        self.last_voters = 0
        self._vote: torch.Tensor | None = None  # [votes, SIGTERM flags | this rank's norm was finite]
        self._sigterm_votes = 0.0
        self._pending_vote: CommHandle | None = None

    def _averages_state(self) -> bool:
        return self.aggregation == "parameters"

    @property
    def effective_smoothing(self) -> float:
        if self.smoothing is not None:
            return float(self.smoothing)
        return min(1.0, self.world_size / 100.0)

    @property
    def last_delta(self) -> float:
        """This rank's last :math:`\\Delta(g_i)` (read from the device when asked: metrics, checkpoints)."""
        return self.tracker.last_delta if self.tracker is not None else 0.0

    def _new_tracker(self) -> DeviceGradientChangeTracker:
        # where the gradients are (the squared norm's device): nothing crosses to the host per step
        device = next((g.grads.device for g in self.flat.groups if g.param_numel), self.root_device)
        return DeviceGradientChangeTracker(window=self.window, smoothing=self.effective_smoothing, device=device)

    def _on_flat_ready(self) -> None:
        if self.tracker is None:  # else restored from a checkpoint by load_strategy_state
            self.tracker = self._new_tracker()
        self._vote = torch.zeros(3, dtype=torch.float32, device=self.tracker.device)

    # ------------------------------------------------------------------ Alg. 1
    def _after_backward(self, optimizer: Optimizer) -> None:
        handle = self.comm.all_reduce(self._cast_vote(), op="sum", tag="vote", async_op=True)
        if self.aggregation == "gradients":
            synced = self._resolve_vote(handle)
            if synced:
                self.average_grads(tag="grads")
            self.step_counter.record(synced)
            self._stop_if_sigterm()
        else:
            self._pending_vote = handle

    def _after_update(self, optimizer: Optimizer) -> None:
        if self.aggregation != "parameters":
            return
        handle, self._pending_vote = self._pending_vote, None
        if handle is None:  # the optimizer skipped the closure (e.g. a skipped step): nothing to decide
            return
        synced = self._resolve_vote(handle)
        if synced:
            self.average_state(tag="params")
        self.step_counter.record(synced)
        self._stop_if_sigterm()

    def _cast_vote(self) -> torch.Tensor:
        """This rank's vote (Alg. 1 lines 8-11) and SIGTERM flag, all computed on the device (no host read): the
        two floats the vote all-reduce sums."""
        assert self.tracker is not None and self._vote is not None
        delta, finite = self.tracker.update(self.flat.grad_sq_norm())
        vote = self._vote
        vote[0].copy_(delta >= self.delta)  # core.wants_sync
        vote[1].fill_(self._sigterm_flag())
        vote[2].copy_(finite)  # local, read with the vote (the tracker's bookkeeping); not sent
        return vote[:2]

    def _stop_if_sigterm(self) -> None:
        if self._sigterm_votes > 0:  # some rank received SIGTERM before this step's vote: all stop here
            raise SIGTERMException()

    def _resolve_vote(self, handle: CommHandle) -> bool:
        handle.wait()
        assert self._vote is not None and self.tracker is not None
        votes, self._sigterm_votes, finite = self._vote.tolist()  # the step's one host read
        self.tracker.commit(finite > 0)
        self.last_voters = int(votes)
        return self.last_voters > 0

    # ------------------------------------------------------------------ metrics and state
    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        metrics["delta"] = self.last_delta
        metrics["voters"] = float(self.last_voters)
        return metrics

    def strategy_state(self) -> dict[str, Any]:
        state = super().strategy_state()
        state["tracker"] = self.tracker.state_dict() if self.tracker is not None else None
        state["last_delta"] = self.last_delta
        return state

    def load_strategy_state(self, state: dict[str, Any]) -> None:
        super().load_strategy_state(state)
        if state.get("tracker") is not None:  # (its "last_delta" is the strategy's too)
            tracker = self._new_tracker()
            tracker.load_state_dict(state["tracker"])
            self.tracker = tracker
