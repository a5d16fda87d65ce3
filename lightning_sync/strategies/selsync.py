"""SelSync: selective synchronization (Tyagi & Swany, §III, Alg. 1, Eq. 2 and 4)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.trainer.states import TrainerFn
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
Vote = Literal["exact", "overlapped"]


@dataclass
class _Vote:
    """A vote all-reduce: in flight (``handle``, summing into ``buffer``), or what it delivered (``values``: settled
    before a checkpoint, or restored from one)."""

    handle: CommHandle | None
    buffer: torch.Tensor | None
    values: list[float] | None = None
    #: this rank's Δ of the vote (a float, or a 0-d float64 device tensor from the device tracker; exact, not sent)
    delta: float | torch.Tensor = 0.0
    #: the device tracker's update count when the vote was cast (whether a later update already settled it)
    update: int = 0


#: ``sync_fraction`` when ``delta="auto"`` and none is given: the fraction of steps that synchronise. Chosen from
#: measurements (README, "SelSync's threshold"; ``benchmarks/dropin.py --selsync-sweep``).
DEFAULT_SYNC_FRACTION = 0.25
#: ``vote`` with parameter aggregation when none is given (gradient aggregation is always ``"exact"``)
DEFAULT_VOTE: Vote = "overlapped"


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

    **The vote off the critical path** (``vote="overlapped"``, the default with parameter aggregation): step
    :math:`k`'s vote is launched after its backward as above but read after step :math:`k+1`'s update, so its round
    trip (the link's latency, twice) runs during step :math:`k+1`'s forward and backward instead of between the
    update and the next step; a step that does not sync waits for nothing. Alg. 1's rule is unchanged — any rank's
    :math:`\Delta \ge \delta` makes a sync, Δ and δ computed as above — but the average it decides is taken one
    step later, of the replicas as they are then (after step :math:`k+1`'s update), and the first step never syncs.
    ``vote="exact"`` keeps Alg. 1's order (the average right after the step that voted), at one round trip per step;
    it is the paper's algorithm. A fixed :math:`\delta = 0` is BSP in either order (below, "Known outcome").
    A vote still in flight is waited for at a checkpoint (its result is saved and decides the first step after a
    resume, so a resumed run follows the uninterrupted one) and at the end of training (dropped: its step never
    comes). The SIGTERM flag it carries stops every rank one step later, together.

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

    **Known outcome** (:attr:`decided_without_vote`). With a fixed :math:`\delta = 0` every vote asks for a sync
    before it is cast (every :math:`\Delta` the tracker reports is :math:`\ge 0`, :math:`+\infty` included; a NaN,
    possible only once the smoothed norm overflows float64, syncs too), so each step takes Alg. 1's decision at once:
    the parameters are averaged right after its update (the gradients before it), in either vote order — BSP, and
    Lightning's DDP, from the first step; with ``vote="overlapped"`` the first step syncs too and no average is a step
    late. The vote all-reduce still runs every step, launched after backward as above, but nothing waits for it
    before the sync: it is read after the sync (``"exact"``) or after the next step's update (``"overlapped"``) only
    for what else it carries — the SIGTERM flags (without them a rank that received SIGTERM would leave the loop
    alone and the others hang in the next all-reduce; a separate flag all-reduce would cost the same round trip), the
    voter count, and each rank's :math:`\Delta` for the log (``sync/delta``: ``benchmarks/tune.py`` measures Δ's
    quantiles with a :math:`\delta = 0` run). A SIGTERM therefore stops every rank when it would without the known
    outcome (one step later with ``"overlapped"``), and checkpoints hold the same state (a vote in flight included).
    Not known: :math:`\delta = \infty`, because :math:`\Delta = +\infty` happens (a non-finite norm, or the
    smoothed norm leaving exactly 0) and :math:`\infty \ge \infty` asks for a sync; ``delta="auto"``, whose
    threshold comes from the votes (its warm-up's threshold is 0: those steps keep the vote's order).

    With ``average_at_end`` (default) the replicas are averaged once more when training ends (tag ``"final"``, one
    all-reduce), so the model Lightning hands back and later evaluates is the global model, not rank 0's replica
    (local steps leave the replicas different under either aggregation).

    **Replica groups** (``replica_size``): the vote is among replicas on each replica's averaged gradient. The
    gradient is averaged inside the replica before Δ is computed, so every rank of a replica holds the same gradient,
    the same tracker state and casts the same vote; the vote stays one all-reduce over all ranks per step (one
    collective, as flat; a leaders' all-reduce plus a broadcast of the decision in the replica would be two), and
    ``voters`` counts replicas. :math:`N` in the default smoothing is the number of replicas.

    **Sharded replicas** (``sharded=True``; :mod:`~lightning_sync.strategies.sharded_topology`): the vote is on the
    replica's whole gradient, FSDP2's reduce-scattered one, of which each rank holds a shard: its squared norm is each
    rank's local shard's summed over the replica's ranks (one 8-byte all-reduce inside the replica per step, tag
    ``"intra/vote"``, blocking, before the vote is cast), so every rank of a replica holds the same Δ and casts the
    same vote, as with replica groups. A parameter sync averages each rank's shard over the ranks of its shard index;
    a gradient sync (``aggregation="gradients"``) is sharded BSP's gradient average
    (:class:`~lightning_sync.strategies.BSPStrategy`). Tested: δ = 0 equals FSDP over all ranks, and with gradient
    aggregation sharded BSP bit for bit; a fixed δ takes grouped SelSync's votes and parameters.

    **Gradient clipping.** ``gradient_clip_val`` :math:`c` acts on the gradient the update uses: with parameter
    aggregation every step's is the rank's own, whose norm exceeds the ranks' average's (what DDP clips) by up to
    :math:`\sqrt N`; with ``local_clipping="scaled"`` (default) a local gradient is clipped at :math:`c\sqrt N` and
    an averaged one (a sync with ``aggregation="gradients"``) at :math:`c`
    (:class:`~lightning_sync.strategies.clipping.LocalClipping`). Clipping the local gradient at :math:`c` was the
    cause of SelSync's gap under clipping on an ordinary model (issue 51: 2.0-2.5 points below DDP over 10 seeds,
    1.6 when syncing every step; 0.2-0.9 scaled); ``"as_given"`` keeps it.

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
        vote: ``"overlapped"`` (a step's vote decides after the next step's update: no round trip on a local
            step), ``"exact"`` (Alg. 1's order: decided right after the step's own update) or ``None``: overlapped
            with ``aggregation="parameters"``, exact with ``"gradients"`` (which needs the decision before the update;
            ``"overlapped"`` is refused there).
        **kwargs: :class:`~lightning_sync.strategies.base.SyncStrategy` arguments (``link``, ``verify_sync``...).
    """

    strategy_name = "selsync"
    strategy_description = "SelSync: sync when any rank's relative gradient change >= delta, else a local step"
    sharded_refusal = None  # the vote on the replica's gradient norm, summed over its shards (grad_sq_norm)
    carries_sigterm = True  # the vote all-reduce carries Lightning's per-step SIGTERM flag: one round trip per step
    state_fields = ("tracker",)
    fault_tolerance_refusal = (
        "its sync decision is a vote of all replicas at every step (an all-reduce of their Δ >= δ flags): under fault "
        "tolerance every vote would need a torchft quorum first — the per-step coordination this mode exists to avoid "
        "— and a vote among members that may change between steps decides no schedule the groups can share. Use "
        "local SGD or DiLoCo (their syncs are periodic: a quorum at each sync only)"
    )

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
        vote: Vote | None = None,
        **kwargs: Any,
    ) -> None:
        if vote is not None and vote not in ("exact", "overlapped"):
            raise ValueError(f"vote must be 'exact', 'overlapped' or None, got {vote!r}")
        if vote == "overlapped" and aggregation == "gradients":
            raise ValueError(
                "vote='overlapped' needs aggregation='parameters': gradient aggregation averages the gradients "
                "before the update, so it needs the step's decision before it (vote='exact'). Use "
                "aggregation='parameters' with vote='overlapped', or vote='exact' (the default with gradients)."
            )
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
        #: when a step's vote is read: ``"exact"`` (Alg. 1's order, after this step's update) or ``"overlapped"``
        #: (after the next step's update: the vote's round trip runs during that step's forward and backward)
        self.vote: Vote = vote if vote is not None else ("exact" if aggregation == "gradients" else DEFAULT_VOTE)
        self.calibrator: DeltaCalibrator | None = None
        #: the threshold of the last vote (``delta`` itself when fixed)
        self.threshold = 0.0 if self.auto else float(delta)
        self.window = window
        self.smoothing = smoothing
        self.aggregation: Aggregation = aggregation
        self.tracker: DeviceGradientChangeTracker | GradientChangeTracker | None = None
        self.last_voters = 0
        self._decided_delta: float | torch.Tensor = 0.0  # this rank's delta of the last vote read
        self._votes: list[torch.Tensor] = []  # two vote buffers, used in turn (see _on_flat_ready)
        self._next_buffer = 0
        self._sigterm_votes = 0.0
        self._launched: _Vote | None = None  # this step's vote, launched after backward
        self._grads_averaged = False  # aggregation="gradients": whether this step's gradients are the ranks' mean
        self._in_flight: _Vote | None = None  # vote="overlapped": the previous step's, read after this update
        # pinned copies of the squared norm (CUDA gradients, host decision), one a vote buffer: with
        # vote="overlapped" the driver thread may read a step's copy after the next step has made its own
        self._sq_host: list[torch.Tensor] | None = None
        self._sq_ready: list[torch.cuda.Event | None] = []

    def _averages_state(self) -> bool:
        return self.aggregation == "parameters"

    @property
    def auto(self) -> bool:
        """Whether δ is set online (``delta="auto"``)."""
        return self.delta == "auto"

    @property
    def effective_smoothing(self) -> float:
        """The EWMA factor: ``smoothing``, or the paper's N/100 for N workers (replicas, with replica groups)."""
        if self.smoothing is not None:
            return float(self.smoothing)
        return min(1.0, self.num_replicas / 100.0)

    @property
    def last_delta(self) -> float:
        """This rank's :math:`\\Delta(g_i)` of the last vote read (with ``vote="overlapped"`` the previous step's:
        the tracker may be deciding the current step's on the driver thread)."""
        return float(self._decided_delta)

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
        # two buffers: with vote="overlapped" a step's vote is cast while the previous one is still in flight
        self._votes = [torch.zeros(self._vote_slots() + 1, dtype=torch.float32, device=device) for _ in range(2)]
        self._next_buffer = 0
        self._sq_host, self._sq_ready = None, []
        cuda = self._grads_device().type == "cuda"
        off_thread = cuda if self._decide_off_thread is None else self._decide_off_thread
        if isinstance(self.tracker, GradientChangeTracker) and off_thread:
            # the norm crosses to the host behind an event; the driver thread decides (see the class docstring)
            self._sq_host = [torch.zeros((), dtype=torch.float64, pin_memory=cuda) for _ in self._votes]
            self._sq_ready = [torch.cuda.Event() if cuda else None for _ in self._votes]

    def _vote_slots(self) -> int:
        """How many floats the vote all-reduce sends."""
        return 2 + (self.world_size if self.auto else 0)

    def _new_calibrator(self) -> DeltaCalibrator:
        assert self.sync_fraction is not None
        assert self.calibration_warmup is not None
        return DeltaCalibrator(self.sync_fraction, window=CALIBRATION_WINDOW, warmup=self.calibration_warmup)

    # ------------------------------------------------------------------ Alg. 1
    @property
    def decided_without_vote(self) -> bool:
        r"""Whether every vote's outcome is known before it is cast, so each step takes Alg. 1's decision at once
        (a sync) instead of waiting for the vote, in either vote order: a fixed :math:`\delta = 0`, which every
        :math:`\Delta` reaches (the class docstring, "Known outcome")."""
        return self.delta == 0.0

    def _after_backward(self, optimizer: Optimizer) -> None:
        vote = self._launch_vote()
        if self.aggregation == "gradients":
            if self.decided_without_vote:  # the gradients go at once; the vote is read after them (SIGTERM, Δ)
                self.average_grads(tag="grads")
                self._resolve_vote(vote)
                synced = True
            else:
                synced = self._resolve_vote(vote)
                if synced:
                    self.average_grads(tag="grads")
            self._grads_averaged = synced
            self.step_counter.record(synced)
            self._stop_if_sigterm()
        else:
            self._launched = vote

    def _after_update(self, optimizer: Optimizer) -> None:
        if self.aggregation != "parameters":
            return
        launched, self._launched = self._launched, None
        if launched is None:  # the optimizer skipped the closure (e.g. a skipped step): nothing to decide
            return
        if self.vote == "exact":
            decided: _Vote | None = launched
        else:  # the previous step's vote, in flight during this step's forward and backward; this one's next step
            decided, self._in_flight = self._in_flight, launched
        if self.decided_without_vote:  # this step syncs now; a vote read here carries only SIGTERM and Δ
            synced = self.average_state(tag="params")
            if decided is not None:
                self._resolve_vote(decided)
        else:
            synced = self._resolve_vote(decided) if decided is not None else False
            if synced:
                self.average_state(tag="params")
        self.step_counter.record(synced)
        self._stop_if_sigterm()
        if self.vote == "overlapped":
            self.sigterm.defer()  # its flag reaches the others with the vote read one step later: all stop then

    def _gradient_is_local(self) -> bool:
        """For :class:`~lightning_sync.strategies.clipping.LocalClipping`: a gradient sync's gradient is the mean."""
        return not (self.aggregation == "gradients" and self._grads_averaged)

    def _settle_in_flight(self) -> None:
        """Wait for the vote still in flight (``vote="overlapped"``) and keep what it delivered, so nothing is in
        flight at a checkpoint or when training ends (every rank does this at the same step)."""
        if self._in_flight is not None and self._in_flight.values is None:
            self._in_flight.handle.wait()  # type: ignore[union-attr]
            self._in_flight.values = self._in_flight.buffer.tolist()

    def on_validation_start(self) -> None:
        self._settle_before_validation()
        super().on_validation_start()

    def _settle_before_validation(self) -> None:
        """``vote="overlapped"``: validation during fit is a step boundary every rank reaches together, so the vote in
        flight (the last step's) is read there and, if it asks for a sync, the replicas are averaged before validation
        — as Alg. 1's order averages them after that step — instead of after the next step. Validation then sees the
        model right after the sync (no averaging for evaluation when it synced) and the last step counts as synced.
        A SIGTERM it carries stops every rank after the next step's update."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.vote != "overlapped" or self._in_flight is None or trainer is None:
            return
        if trainer.state.fn != TrainerFn.FITTING:
            return
        vote, self._in_flight = self._in_flight, None
        if self._resolve_vote(vote) and not self.decided_without_vote and not self._in_sync:
            self.average_state(tag="params")
            self.step_counter.local_steps -= 1  # the last step, recorded local at its update, synced after all
            self.step_counter.sync_steps += 1

    def on_train_end(self) -> None:
        # the last step's vote would decide a step that never comes: wait for it (nothing left in flight), drop it
        self._settle_in_flight()
        self._in_flight = None
        self.sigterm.release()  # a SIGTERM in the last step: Lightning's flag as it would have been
        super().on_train_end()

    def _buffer(self) -> int:
        """The index of the next vote buffer (and its host copy of the norm): the two are used in turn."""
        index = self._next_buffer
        self._next_buffer = 1 - self._next_buffer
        return index

    def _launch_vote(self) -> _Vote:
        """Lines 8-12 of Alg. 1 in flight: the vote all-reduce, launched without blocking the training thread. The
        threshold is read here, on the training thread (``delta="auto"``: from the maxima observed so far)."""
        index = self._buffer()
        vote = _Vote(None, self._votes[index])
        buffer = vote.buffer
        assert buffer is not None
        if self.calibrator is not None:
            self.threshold = self.calibrator.threshold()
        threshold = self.threshold
        if self._sq_host is None:
            vote.handle = self.comm.all_reduce(self._cast_vote(vote), op="sum", tag="vote", async_op=True)
            return vote
        # this buffer's copy: the one before was the previous step's, which the driver may not have read yet
        sq_host, ready, sigterm = self._sq_host[index], self._sq_ready[index], self.sigterm.flag()
        sq_host.copy_(self.topology.grad_sq_norm(), non_blocking=True)
        if ready is not None:
            ready.record()

        def decide() -> None:  # on the communicator's driver thread (the handle's wait happens after it)
            if ready is not None:
                ready.synchronize()
            vote.delta = self._write_vote(buffer, float(sq_host), sigterm, threshold)

        vote.handle = self.comm.all_reduce_from_host(buffer[: self._vote_slots()], decide, op="sum", tag="vote")
        return vote

    def _cast_vote(self, vote: _Vote) -> torch.Tensor:
        """This rank's vote (Alg. 1 lines 8-11) and SIGTERM flag into ``vote.buffer`` — with the device tracker all
        computed on the device (no host read) — and its Δ into ``vote.delta``: the floats the vote all-reduce sums."""
        assert self.tracker is not None and vote.buffer is not None
        buffer = vote.buffer
        if isinstance(self.tracker, GradientChangeTracker):
            sq = float(self.topology.grad_sq_norm())
            vote.delta = self._write_vote(buffer, sq, self.sigterm.flag(), self.threshold)
            return buffer[: self._vote_slots()]
        delta, finite = self.tracker.update(self.topology.grad_sq_norm())
        vote.delta, vote.update = delta, self.tracker.steps  # Δ read on the host only when asked (last_delta)
        if self.calibrator is not None:  # every rank's delta in its own slot
            buffer[2:-1].zero_()
            buffer[2 + self.global_rank].copy_(delta)  # inf for a non-finite norm: the calibrator counts it as a sync
        buffer[0].copy_(delta >= self.threshold)  # core.wants_sync
        buffer[1].fill_(self.sigterm.flag())
        buffer[-1].copy_(finite)  # local, read with the vote (the tracker's bookkeeping); not sent
        return buffer[: self._vote_slots()]

    def _write_vote(self, buffer: torch.Tensor, sq_norm: float, sigterm: float, threshold: float) -> float:
        """The host tracker's step (Alg. 1 lines 8-11) on this step's squared norm, written into ``buffer``; returns
        this rank's Δ."""
        assert isinstance(self.tracker, GradientChangeTracker)
        delta = self.tracker.update(sq_norm)
        values = [1.0 if delta >= threshold else 0.0, sigterm]
        if self.calibrator is not None:
            slots = [0.0] * self.world_size
            slots[self.global_rank] = delta
            values += slots
        values.append(1.0 if math.isfinite(sq_norm) else 0.0)
        buffer.copy_(torch.tensor(values, dtype=torch.float32))
        return delta

    def _stop_if_sigterm(self) -> None:
        if self._sigterm_votes > 0:  # some rank received SIGTERM before this step's vote: all stop here
            self.sigterm.release()
            raise SIGTERMException()

    def _resolve_vote(self, vote: _Vote) -> bool:
        if vote.values is None:
            vote.handle.wait()  # type: ignore[union-attr]
            values = vote.buffer.tolist()  # the step's one host read
        else:
            values = vote.values  # settled before a checkpoint, or restored from one
        assert self.tracker is not None
        votes, self._sigterm_votes, finite = values[0], values[1], values[-1]
        self._decided_delta = vote.delta
        if isinstance(self.tracker, DeviceGradientChangeTracker) and self.tracker.steps == vote.update:
            # (the host tracker settled it in update; so did the device tracker's next update if there was one,
            # reading the flag itself: vote="overlapped" casts the next vote before this one is read)
            self.tracker.commit(finite > 0)
        # with replica groups every rank of a voting replica voted (same averaged gradient, same Δ): count replicas
        self.last_voters = int(votes) // self.ranks_per_replica
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
        # real work: the vote in flight is settled first; the calibration and the vote are checked against this run's
        # delta and vote on restore (the tracker: state_fields)
        self._settle_in_flight()  # the previous step's vote (vote="overlapped"): its decision, and the tracker, settled
        state = super().strategy_state()
        state["last_delta"] = self.last_delta
        state["calibrator"] = self.calibrator.state_dict() if self.calibrator is not None else None
        state["threshold"] = self.threshold
        pending = self._in_flight
        state["vote_in_flight"] = None if pending is None else [*(pending.values or []), float(pending.delta)]
        return state

    def load_strategy_state(self, state: dict[str, Any]) -> None:
        super().load_strategy_state(state)
        self._decided_delta = float(state.get("last_delta", 0.0))
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
        pending = state.get("vote_in_flight")
        if pending is not None and self.vote != "overlapped":
            raise ValueError(
                "the checkpoint was written with vote='overlapped' (a step's vote decides after the next step): "
                "resume it with vote='overlapped'"
            )
        self._in_flight = None if pending is None else _Vote(None, None, list(pending[:-1]), float(pending[-1]))
