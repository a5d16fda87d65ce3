"""SelSync: selective synchronization (Tyagi & Swany, §III, Alg. 1, Eq. 2 and 4)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.optim import Optimizer

from lightning_sync.comm import CommHandle
from lightning_sync.core import DeviceGradientChangeTracker, GradientChangeTracker
from lightning_sync.core.calibration import CALIBRATION_WARMUP, CALIBRATION_WINDOW, DeltaCalibrator
from lightning_sync.core.outer import parse_outer_optimizer
from lightning_sync.core.validation import MAX_INT64, check_bool, check_int, check_real
from lightning_sync.strategies.base import SyncStrategy
from lightning_sync.strategies.evaluation import check_evaluate

Aggregation = Literal["parameters", "gradients"]

#: ``sync_fraction`` when ``delta="auto"`` and none is given: the fraction of steps that synchronise. Chosen from
#: measurements (README, "SelSync's threshold"; ``benchmarks/dropin.py --selsync-sweep``).
DEFAULT_SYNC_FRACTION = 0.25


class SelSyncStrategy(SyncStrategy):
    r"""Synchronise only the steps whose gradients changed significantly; apply the others locally.

    Per step (Alg. 1), on every rank:

    1. after backward, the squared norm of the local gradient (one fused dot product over the flat gradient
       buffer) feeds a :class:`~lightning_sync.core.GradientChangeTracker`: EWMA over ``window`` steps with
       factor ``smoothing``, relative change :math:`\Delta(g_i)` of Eq. 2;
    2. the rank votes :math:`\Delta(g_i) \ge \delta` (lines 10-11) and one small all-reduce sums the votes
       (line 12 — the paper all-gathers an N-bit array; a sum carries the same "any" plus the voter count). The
       same all-reduce carries Lightning's per-step SIGTERM flag (8 bytes in all; with ``delta="auto"`` also every
       rank's Δ: 4(N+2) bytes), so a local step costs one round trip;
    3. ``aggregation="parameters"`` (default, lines 9 and 13-15): the optimizer applies the local update, then, if
       any rank voted, parameters and buffers are averaged (one all-reduce). The vote's all-reduce is launched
       asynchronously before the update and waited on after it, so its latency overlaps the optimizer step.
       ``aggregation="gradients"``: if any rank voted, gradients (and buffers) are averaged before the update.

    **The training thread never waits for the decision before the update is queued.** With the gradients on a CUDA
    device, the squared norm is computed there and copied, without blocking, into pinned host memory behind a CUDA
    event; the decision — the host :class:`~lightning_sync.core.GradientChangeTracker` (EWMA window, Eq. 2's
    :math:`\Delta`), the vote, the SIGTERM flag — and the vote's all-reduce run on the communicator's host driver
    thread (:meth:`~lightning_sync.comm.Communicator.all_reduce_from_host`, a gloo group of its own), which waits
    for the event, while the training thread goes on queuing the optimizer step. With parameter aggregation the
    vote (with the SIGTERM flags and whether this rank's norm was finite) is read once, after the local update —
    the first point where the host needs the answer, to decide whether to average. Measured on an H100
    (``benchmarks/overhead.py --accelerator gpu``, README "Hot-path overhead"): the same arithmetic as ~20 small
    float64 tensor operations on the device (:class:`~lightning_sync.core.DeviceGradientChangeTracker`, bit for
    bit the host tracker's; still selectable, ``_decide_on_host = False``) costs the training thread ~0.36 ms
    of kernel launches per step (``benchmarks/vote_cost.py``), more than the host read it avoids. When the
    gradients are on the CPU the host *is* the device: the host tracker runs inline. Gradient aggregation needs the
    answer *before* the update, so it costs what the order of Alg. 1 implies: the norm needs the whole backward,
    the vote a round trip and a host read of it, and only then can the gradients (one all-reduce, not overlapped
    with backward) go; a local step still pays the vote's round trip before its update.

    ``delta="auto"`` (default) sets δ online (:class:`~lightning_sync.core.calibration.DeltaCalibrator`): each
    step's vote all-reduce also carries every rank's Δ (one float per rank in its own slot, so the sum delivers all of
    them), every rank feeds the same maximum to the calibrator, and δ for the next step is the quantile of the last
    100 maxima that lets ``sync_fraction`` of them through — the same δ on every rank with no further message. The
    first 10 steps sync while the window fills. The paper's fixed threshold is ``delta=0.3, smoothing=None``
    (calibrated for 16 workers: with 2-4 ranks its N/100 smoothing keeps Δ below 0.3 and SelSync almost never syncs).

    :math:`\delta=0` syncs every step: with parameter aggregation and identical replicas this is BSP (for SGD
    with momentum and weight decay exactly, because the update is linear in the gradient: the mean of the
    ranks' momentum buffers follows BSP's momentum recursion; not with ``gradient_clip_val``, which clips each rank's
    local gradient before its update, where BSP clips the average). The first step has no previous smoothed norm, so
    no measured change: :math:`\Delta(g_1)=0` (it syncs only when :math:`\delta=0`). A :math:`\delta` above
    every :math:`\Delta` therefore sends no parameters at all: LSSR is exactly 1 and only the 8-byte votes travel.

    With ``average_at_end`` (default) the replicas are averaged once more when training ends (tag ``"final"``, one
    all-reduce), so the model Lightning hands back and later evaluates is the global model, not rank 0's replica
    (local steps leave the replicas different under either aggregation).

    Args:
        delta: ``"auto"`` (default: set online to meet ``sync_fraction``) or a fixed threshold :math:`\delta \ge 0` on
            the relative gradient change (``float('inf')`` allowed; the paper: 0.3).
        window: EWMA window in steps (paper: 25), an integer in [1, 2**63 - 1].
        smoothing: EWMA factor in (0, 1]; ``None`` uses the paper's :math:`N/100` for world size N (capped at 1).
        aggregation: ``"parameters"`` (the paper's recommendation) or ``"gradients"``.
        outer_optimizer: ``None`` (plain averaging) or, with ``aggregation="parameters"``, an outer optimizer spec
            such as ``{"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}`` (DiLoCo's): each sync's mean
            of the replicas gives the pseudo-gradient, the outer optimizer steps the global parameters and every rank
            takes them (see :meth:`~lightning_sync.strategies.base.SyncStrategy.average_state`).
        sync_fraction: with ``delta="auto"``, the target fraction of synchronised steps, in (0, 1] (LSSR, the
            fraction of local steps, ≈ 1 − f); ``None`` = 0.25. Must be ``None`` with a fixed ``delta``.
        calibration_warmup: with ``delta="auto"``, the first steps that synchronise unconditionally while the
            calibrator's window fills (an integer >= 0); ``None`` = 10. Each costs a full exchange: on a slow link
            with a small ``sync_fraction`` they can be most of the run's communication. Must be ``None`` with a
            fixed ``delta``.
        average_at_end: average the replicas once more when training ends (a bool).
        evaluate: what validation during fit and the main checkpoint file hold: ``"average"`` (default: the
            replicas' exact average, one all-reduce of the model per validation) or ``"last_sync"`` (the global model
            of the last sync, kept on every rank: no communication, one model-sized copy per rank; see
            :mod:`~lightning_sync.strategies.evaluation`).
        **kwargs: :class:`~lightning_sync.strategies.base.SyncStrategy` arguments (``link``, ``verify_sync``...).
    """

    strategy_name = "selsync"
    strategy_description = "SelSync: sync when any rank's relative gradient change >= delta, else a local step"
    carries_sigterm = True  # the vote all-reduce carries Lightning's per-step SIGTERM flag: one round trip per step

    def __init__(
        self,
        delta: float | Literal["auto"] = "auto",
        window: int = 25,
        smoothing: float | None = None,
        aggregation: Aggregation = "parameters",
        outer_optimizer: Mapping[str, Any] | None = None,
        sync_fraction: float | None = None,
        average_at_end: bool = True,
        evaluate: Literal["average", "last_sync"] = "average",
        calibration_warmup: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not (isinstance(delta, str) and delta == "auto"):
            try:
                check_real("delta", delta, 0.0, allow_inf=True)
            except ValueError:
                raise ValueError(
                    f"delta must be 'auto' or a number in [0.0, inf] (inf allowed), got {delta!r}"
                ) from None
            if sync_fraction is not None:
                raise ValueError(
                    f"sync_fraction applies to delta='auto' only; with a fixed delta={delta!r} it must be None "
                    f"(got {sync_fraction!r}). Pass delta='auto' to target a fraction of synchronised steps."
                )
            if calibration_warmup is not None:
                raise ValueError(
                    f"calibration_warmup applies to delta='auto' only; with a fixed delta={delta!r} it must be None "
                    f"(got {calibration_warmup!r}). Pass delta='auto' to calibrate delta online."
                )
        else:
            if sync_fraction is not None:
                check_real("sync_fraction", sync_fraction, 0.0, 1.0, low_open=True)
            if calibration_warmup is not None:
                check_int("calibration_warmup", calibration_warmup, 0, MAX_INT64)
        check_bool("average_at_end", average_at_end)
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
        if check_evaluate(evaluate) == "last_sync" and aggregation == "gradients":
            raise ValueError(
                "evaluate='last_sync' needs aggregation='parameters': it evaluates the model every rank holds right "
                "after a sync, and with aggregation='gradients' a sync averages gradients, so the replicas still "
                "differ after it. Use aggregation='parameters', or evaluate='average'."
            )
        super().__init__(**kwargs)
        self.delta: float | Literal["auto"] = "auto" if delta == "auto" else float(delta)
        self.sync_fraction: float | None = (
            float(sync_fraction if sync_fraction is not None else DEFAULT_SYNC_FRACTION) if self.auto else None
        )
        self.calibration_warmup: int | None = (
            int(calibration_warmup if calibration_warmup is not None else CALIBRATION_WARMUP) if self.auto else None
        )
        self.average_at_end = average_at_end
        self.evaluate = evaluate
        self.calibrator: DeltaCalibrator | None = None
        #: the threshold of the last vote (``delta`` itself when fixed)
        self.threshold = 0.0 if self.auto else float(delta)
        self.window = window
        self.smoothing = smoothing
        self.aggregation: Aggregation = aggregation
        self.tracker: DeviceGradientChangeTracker | GradientChangeTracker | None = None
        self.last_voters = 0
        self._vote: torch.Tensor | None = None  # see _on_flat_ready
        self._sigterm_votes = 0.0
        self._pending_vote: CommHandle | None = None
        self._sq_host: torch.Tensor | None = None  # pinned copy of the squared norm (CUDA gradients, host decision)
        self._sq_ready: torch.cuda.Event | None = None

    def _averages_state(self) -> bool:
        return self.aggregation == "parameters"

    @property
    def auto(self) -> bool:
        """Whether δ is set online (``delta="auto"``)."""
        return self.delta == "auto"

    @property
    def effective_smoothing(self) -> float:
        if self.smoothing is not None:
            return float(self.smoothing)
        return min(1.0, self.world_size / 100.0)

    @property
    def last_delta(self) -> float:
        """This rank's last :math:`\\Delta(g_i)` (read from the device when asked: metrics, checkpoints)."""
        return self.tracker.last_delta if self.tracker is not None else 0.0

    #: where the decision is computed: ``None`` = on the host (inline for CPU gradients, on the communicator's
    #: driver thread for CUDA gradients; other accelerators: on the device); ``False`` forces the device tracker
    #: (tests exercise its no-host-read path on the CPU)
    _decide_on_host: bool | None = None
    #: whether the host decision runs on the driver thread: ``None`` = for CUDA gradients; ``True`` forces it with
    #: CPU gradients too (tests exercise the thread's path on the CPU)
    _decide_off_thread: bool | None = None

    def _grads_device(self) -> torch.device:
        """Where the gradients are (the squared norm's device)."""
        return next((g.grads.device for g in self.flat.groups if g.param_numel), self.root_device)

    def _new_tracker(self) -> DeviceGradientChangeTracker | GradientChangeTracker:
        device = self._grads_device()
        on_host = device.type in ("cpu", "cuda") if self._decide_on_host is None else self._decide_on_host
        if on_host:
            return GradientChangeTracker(window=self.window, smoothing=self.effective_smoothing)
        return DeviceGradientChangeTracker(window=self.window, smoothing=self.effective_smoothing, device=device)

    def _on_flat_ready(self) -> None:
        if self.tracker is None:  # else restored from a checkpoint by load_strategy_state
            self.tracker = self._new_tracker()
        if self.auto and self.calibrator is None:  # else restored
            self.calibrator = self._new_calibrator()
        # [votes, SIGTERM flags, (delta="auto": each rank's delta in its own slot, so the sum delivers them all),
        #  whether this rank's norm was finite (local: read with the vote, not sent)]
        device = self.tracker.device if isinstance(self.tracker, DeviceGradientChangeTracker) else torch.device("cpu")
        self._vote = torch.zeros(self._vote_slots() + 1, dtype=torch.float32, device=device)
        self._sq_host = self._sq_ready = None
        cuda = self._grads_device().type == "cuda"
        off_thread = cuda if self._decide_off_thread is None else self._decide_off_thread
        if isinstance(self.tracker, GradientChangeTracker) and off_thread:
            # the norm crosses to the host behind an event; the driver thread decides (see the class docstring)
            self._sq_host = torch.zeros((), dtype=torch.float64, pin_memory=cuda)
            self._sq_ready = torch.cuda.Event() if cuda else None

    def _vote_slots(self) -> int:
        """How many floats the vote all-reduce sends."""
        return 2 + (self.world_size if self.auto else 0)

    def _new_calibrator(self) -> DeltaCalibrator:
        assert self.sync_fraction is not None
        assert self.calibration_warmup is not None
        return DeltaCalibrator(self.sync_fraction, window=CALIBRATION_WINDOW, warmup=self.calibration_warmup)

    # ------------------------------------------------------------------ Alg. 1
    def _after_backward(self, optimizer: Optimizer) -> None:
        handle = self._launch_vote()
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

    def _launch_vote(self) -> CommHandle:
        """Lines 8-12 of Alg. 1 in flight: the vote all-reduce, launched without blocking the training thread."""
        if self._sq_host is None:
            return self.comm.all_reduce(self._cast_vote(), op="sum", tag="vote", async_op=True)
        assert self._vote is not None
        self._sq_host.copy_(self.flat.grad_sq_norm(), non_blocking=True)
        sq_host, ready, sigterm = self._sq_host, self._sq_ready, self._sigterm_flag()
        if ready is not None:
            ready.record()

        def decide() -> None:  # on the communicator's driver thread
            if ready is not None:
                ready.synchronize()
            self._write_vote(float(sq_host), sigterm)

        return self.comm.all_reduce_from_host(self._vote[: self._vote_slots()], decide, op="sum", tag="vote")

    def _cast_vote(self) -> torch.Tensor:
        """This rank's vote (Alg. 1 lines 8-11) and SIGTERM flag, all computed on the device (no host read): the
        two floats the vote all-reduce sums."""
        assert self.tracker is not None and self._vote is not None
        if isinstance(self.tracker, GradientChangeTracker):
            return self._cast_vote_on_host(self.tracker)
        delta, finite = self.tracker.update(self.flat.grad_sq_norm())
        vote = self._vote
        if self.calibrator is not None:  # delta for this step from the maxima observed so far (host floats)
            self.threshold = self.calibrator.threshold()
            vote[2:-1].zero_()
            vote[2 + self.global_rank].copy_(delta)  # inf for a non-finite norm: the calibrator counts it as a sync
        vote[0].copy_(delta >= self.threshold)  # core.wants_sync
        vote[1].fill_(self._sigterm_flag())
        vote[-1].copy_(finite)  # local, read with the vote (the tracker's bookkeeping); not sent
        return vote[: self._vote_slots()]

    def _cast_vote_on_host(self, tracker: GradientChangeTracker) -> torch.Tensor:
        """:meth:`_cast_vote` with the host tracker (gradients on the CPU): the same values, written from floats."""
        assert self._vote is not None
        self._write_vote(float(self.flat.grad_sq_norm()), self._sigterm_flag())
        return self._vote[: self._vote_slots()]

    def _write_vote(self, sq_norm: float, sigterm: float) -> None:
        """The host tracker's step (Alg. 1 lines 8-11) on this step's squared norm, written into the vote tensor."""
        assert self._vote is not None and isinstance(self.tracker, GradientChangeTracker)
        delta = self.tracker.update(sq_norm)
        if self.calibrator is not None:
            self.threshold = self.calibrator.threshold()
        values = [1.0 if delta >= self.threshold else 0.0, sigterm]
        if self.calibrator is not None:
            slots = [0.0] * self.world_size
            slots[self.global_rank] = delta
            values += slots
        values.append(1.0 if math.isfinite(sq_norm) else 0.0)
        self._vote.copy_(torch.tensor(values, dtype=torch.float32))

    def _stop_if_sigterm(self) -> None:
        if self._sigterm_votes > 0:  # some rank received SIGTERM before this step's vote: all stop here
            raise SIGTERMException()

    def _resolve_vote(self, handle: CommHandle) -> bool:
        handle.wait()
        assert self._vote is not None and self.tracker is not None
        values = self._vote.tolist()  # the step's one host read
        votes, self._sigterm_votes, finite = values[0], values[1], values[-1]
        if isinstance(self.tracker, DeviceGradientChangeTracker):
            self.tracker.commit(finite > 0)  # (the host tracker settled it in update)
        self.last_voters = int(votes)
        if self.calibrator is not None:  # every rank holds every rank's delta: the same maximum everywhere
            self.calibrator.observe(max(values[2:-1]))
        return self.last_voters > 0

    # ------------------------------------------------------------------ metrics and state
    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        metrics["delta"] = self.last_delta
        metrics["voters"] = float(self.last_voters)
        metrics["threshold"] = self.threshold
        return metrics

    def strategy_state(self) -> dict[str, Any]:
        state = super().strategy_state()
        state["tracker"] = self.tracker.state_dict() if self.tracker is not None else None
        state["last_delta"] = self.last_delta
        state["calibrator"] = self.calibrator.state_dict() if self.calibrator is not None else None
        state["threshold"] = self.threshold
        return state

    def load_strategy_state(self, state: dict[str, Any]) -> None:
        super().load_strategy_state(state)
        if state.get("tracker") is not None:  # (its "last_delta" is the strategy's too)
            tracker = self._new_tracker()
            tracker.load_state_dict(state["tracker"])
            self.tracker = tracker
        if self.auto:
            if state.get("calibrator") is None:
                raise ValueError(
                    "the checkpoint holds no delta calibration (it was written with a fixed delta); resume it with "
                    "the same delta it was trained with"
                )
            calibrator = self._new_calibrator()
            calibrator.load_state_dict(state["calibrator"])
            self.calibrator = calibrator
            self.threshold = float(state["threshold"])
        elif state.get("calibrator") is not None:
            raise ValueError(
                f"the checkpoint was written with delta='auto'; this run uses delta={self.delta}: resume with "
                "delta='auto' (and the same sync_fraction)"
            )
