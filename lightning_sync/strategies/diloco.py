"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105) and Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512):
local SGD whose averaging goes through an outer optimizer, optionally in staggered, overlapped fragments."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_sync.core.outer import OuterSGD, auto_outer_optimizer, parse_outer_optimizer
from lightning_sync.core.streaming import FragmentSchedule, fragment_ranges
from lightning_sync.core.validation import check_real
from lightning_sync.strategies.outer import inner_lr
from lightning_sync.strategies.periodic import PeriodicAveraging
from lightning_sync.strategies.topology import InFlight

#: default H (inner steps per outer step): see DiLoCoStrategy's docstring for why not the paper's 500
DEFAULT_SYNC_EVERY = 16


@dataclass(frozen=True)
class _Part:
    """One flat buffer group's share of a fragment: ``state[start:end]``, of which ``state[start:param_end]`` are
    parameters (the outer step's) and the rest floating buffers (plain mean)."""

    group: int
    start: int
    param_end: int
    end: int


@dataclass
class _Pending:
    """A fragment whose all-reduce was launched after step ``step`` and is applied ``delay`` steps later."""

    fragment: int
    step: int
    buffers: list[Tensor]
    #: the average in flight (``None``: blocking, done at the launch, or restored from a checkpoint complete)
    flight: InFlight | None = None
    #: whether the sync committed (fault-tolerant: otherwise the buffers hold this replica's own values, not applied)
    committed: bool = True

    @property
    def handles(self) -> list[Any]:
        return self.flight.handles if self.flight is not None else []


class DiLoCoStrategy(PeriodicAveraging):
    r"""DiLoCo: every rank takes inner steps with the user's optimizer (the *inner* optimizer: their configured
    optimizer and learning rate, as for DDP); every ``sync_every`` (:math:`H`) steps the replicas' mean gives the
    outer gradient :math:`\Delta = \theta_{global} - \text{mean}` and an outer optimizer steps
    :math:`\theta_{global}`, which every rank takes (Algorithm 1; the math in
    :class:`~lightning_sync.core.outer.OuterOptimizer`).

    **Default outer optimizer** (``outer_optimizer="auto"``), chosen at setup from the inner optimizer(s) the
    LightningModule configures (:func:`~lightning_sync.core.outer.auto_outer_optimizer`): over adaptive ones (AdamW,
    Adam, ...) the paper's SGD with Nesterov momentum 0.9, lr 0.7 (its momentum following the inner learning rate,
    ``inner_lr_scaling``); over SGD (and anything else) plain averaging — an outer momentum over an inner SGD with
    momentum cost points on an ordinary model and collapsed it at a constant rate (issue 51, measured there;
    SlowMo's ``{"name": "sgd", "lr": 1.0, "momentum": 0.5}``, the previous choice, stays a spec away). The choice
    is logged at setup and kept in :attr:`outer_config` (None: plain averaging) and :attr:`outer_reason`; give a
    spec or None to fix it. One all-reduce per sync, as local SGD; floating buffers (BatchNorm statistics) are
    averaged plainly. ``outer_optimizer=None`` is local SGD with this schedule, and ``{"name": "sgd", "lr": 1.0}``
    too (lr 1 without momentum is plain averaging, tested).

    **Gradient clipping**: every inner step is local, so ``gradient_clip_val`` :math:`c` clips a rank's own
    gradient, whose norm exceeds the ranks' average's (what DDP clips) by up to :math:`\sqrt N`: with
    ``local_clipping="scaled"`` (default) it is clipped at :math:`c\sqrt N`
    (:class:`~lightning_sync.strategies.clipping.LocalClipping`; measured in issue 51), ``"as_given"`` at :math:`c`.

    **Schedule.** Syncs happen after :math:`H` inner steps (0-based steps :math:`H-1, 2H-1, \dots`), as in
    Algorithm 1 — unlike :class:`~lightning_sync.strategies.LocalSGDStrategy`, which follows CPSGD and averages after
    step 0 too.

    **Default** :math:`H` **= 16, not the paper's 500.** 500 inner steps suit runs of tens of thousands of steps; an
    ordinary run of a few hundred steps would sync once or never. On the embedded digits workload (4 ranks, batch 32,
    20 epochs of 10 steps, DDP's SGD as the inner optimizer) 16 came closest to DDP's test accuracy of the values
    tried — mean of 3 seeds 0.980 against DDP's 0.987; 8: 0.974, 32: 0.975; 4 did not train (0.88, one seed); 500
    never synced inside the run (``python benchmarks/diloco.py --sweep``, README). The paper's 500 stays a
    ``sync_every=500`` away.

    **Streaming** (``fragments`` :math:`K > 1` and/or ``delay`` :math:`\tau > 0`, Streaming DiLoCo): the
    flat parameter buffer is cut into :math:`K` contiguous ranges of (nearly) equal size, the same on every rank
    (:func:`~lightning_sync.core.streaming.fragment_ranges`; they may cut through a tensor); fragment :math:`f` is
    synchronised every :math:`H` steps, after steps :math:`(f+1)H/K - 1 + mH` (staggered: one fragment every
    :math:`H/K` steps, :class:`~lightning_sync.core.streaming.FragmentSchedule`; the floating buffers travel with the
    last fragment, once per :math:`H`). At its step the fragment is copied to a send buffer and its all-reduce
    launched **asynchronously** on a second process group (so it is really in flight while the next inner steps
    compute, and Lightning's blocking collectives do not queue behind it); :math:`\tau` steps later it is waited on,
    the outer optimizer steps that fragment of :math:`\theta_{global}` from the mean, and the local fragment becomes
    :math:`\theta_{global} + \alpha(\theta_{local} - \theta_{global})` — ``alpha`` :math:`\alpha = 0` takes the
    global values and drops the fragment's last :math:`\tau` local steps (torchft's ``fragment_update_alpha``
    default); :math:`\alpha > 0` keeps a share of them. :math:`K = 1`, :math:`\tau = 0`, :math:`\alpha = 0` is
    plain DiLoCo: the fragment is then the whole buffer, all-reduced in place (tested equal to the plain path of the
    periodic strategies).

    **End of training** (``average_at_end``, default): the fragment in flight is applied, then one all-reduce of
    every parameter and buffer (tag ``"final"``) and, per fragment, the outer step on the inner steps taken since its
    last sync (a fragment synced at the last step takes :math:`\theta_{global}`): the model handed back is the global
    model one more sync would give, identical on every rank. Nothing happens when the last step synced everything.

    **Compression** (``compression="bf16" | "fp16" | "int8" | "int4" | "int2"``, plain DiLoCo only): each sync
    sends every rank's change since the last global model in the wire format (the periodic strategies' compressed
    averaging, fp32 sums, the integer formats with error feedback), the outer step runs on the exact mean of those,
    and the new :math:`\theta_{global}` becomes the reference of the next sync; the final sync is compressed too.
    Streaming's overlapped fragment all-reduces are not compressed: ``fragments > 1``, ``delay > 0`` or
    ``alpha > 0`` with a compression raise at construction.

    **Replica groups** (``replica_size``): the ranks of a replica average their gradients every step and stay
    identical; each sync (and each fragment) is averaged over the replicas' first ranks and broadcast inside the
    replica — the streaming fragments' asynchronous all-reduces on a second group of those ranks, the broadcast when
    the fragment is applied — and every rank applies the same outer step to the same mean.

    **Sharded replicas** (``sharded=True``; :mod:`~lightning_sync.strategies.sharded_topology`): each rank runs the
    method on its packed local shard (its flat buffer holds the local shards with FSDP2's padding, the same length on
    every rank), :math:`\theta_{global}` and the outer momentum are the shard's, and every average is over the ranks
    of its shard index. Streaming's fragment :math:`f` is the :math:`f`-th of :math:`K` contiguous ranges of *each
    rank's local shard* (not of the whole model's flat buffer, as without sharding): the model's fragment :math:`f`
    is the union of those ranges over the replica's shards, every rank sends :math:`1/K` of its shard per fragment
    sync (an even load on each rank's link, which a cut of the whole model would not give the shards' ranks), and the
    schedule is the same on every rank; the fragments in flight run on a second group over each shard index's ranks.
    So sharded streaming DiLoCo with :math:`K > 1` synchronises other element sets per fragment than grouped
    streaming DiLoCo (tested by its invariants: each fragment identical across the replicas after its sync, the
    bytes of a half shard); with :math:`K = 1` (``delay``, ``alpha``) it equals it (tested).

    **Checkpoints** hold :math:`\theta_{global}`, the outer momentum, the step (hence the fragment schedule) and the
    fragment in flight: saving waits for its all-reduce to *complete* and stores the result, which the resumed run
    applies at the step it was due — the same trajectory as without the checkpoint (resume is bit-identical,
    ``tests/test_resume.py``). SIGTERM is checked at sync steps only
    (:class:`~lightning_sync.strategies.periodic.PeriodicAveraging`).

    Logged: ``sync/period`` (:math:`H`); ``in_flight_at_step_start`` (attribute: whether the fragment launched at an
    earlier step was still in flight when this step's training began), ``last_launched``/``last_applied``
    (fragment launched/applied after the last step, or None) and ``fragment_syncs`` (per-fragment counts) are
    attributes for callbacks.

    Args:
        sync_every: :math:`H`, inner steps per outer step of each fragment (>= 1).
        outer_optimizer: ``"auto"`` (default, above), an outer optimizer spec such as the paper's ``{"name": "sgd",
            "lr": 0.7, "momentum": 0.9, "nesterov": True}``, or None for plain averaging; see
            :func:`~lightning_sync.core.outer.parse_outer_optimizer`.
        fragments: :math:`K`, an integer in [1, ``sync_every``] that divides ``sync_every``.
        delay: :math:`\tau`, inner steps between a fragment's all-reduce launch and its application, an integer in
            [0, ``sync_every // fragments`` - 1] (so at most one fragment is in flight).
        alpha: :math:`\alpha` in [0, 1], the share of the local fragment kept when the global one is applied.
        average_at_end: the final sync above (a bool).
        evaluate: the periodic family's, see :class:`~lightning_sync.strategies.periodic.PeriodicAveraging`.
    """

    strategy_name = "diloco"
    strategy_description = "DiLoCo: local steps, an outer Nesterov step on the averaged pseudo-gradient every H steps"
    sharded_refusal = None  # plain and streaming (fragments of each rank's local shard)
    #: sharded replica groups run fault-tolerant: a torchft Manager per rank, each shard averaged over its quorum
    sharded_fault_tolerance_refusal = None
    ft_config_fields = ("sync_every", "fragments", "delay", "alpha")

    def __init__(
        self,
        sync_every: int = DEFAULT_SYNC_EVERY,
        outer_optimizer: Mapping[str, Any] | str | None = "auto",
        fragments: int = 1,
        delay: int = 0,
        alpha: float = 0.0,
        average_at_end: bool = True,
        evaluate: Literal["average", "last_sync"] = "average",
        **kwargs: Any,
    ) -> None:
        self.schedule = FragmentSchedule(sync_every, fragments, delay)
        self.sync_every, self.fragments, self.delay = (
            self.schedule.sync_every,
            self.schedule.fragments,
            self.schedule.delay,
        )
        self.alpha = check_real("alpha", alpha, 0.0, 1.0)
        if kwargs.get("compression") is not None and (self.fragments > 1 or self.delay > 0 or self.alpha != 0.0):
            raise ValueError(
                f"compression={kwargs['compression']!r} needs plain DiLoCo (fragments=1, delay=0, alpha=0), got "
                f"fragments={self.fragments}, delay={self.delay}, alpha={self.alpha}: the streaming fragments' "
                "overlapped all-reduces are not compressed. Use plain DiLoCo with compression, or streaming without it."
            )
        super().__init__(average_at_end=average_at_end, evaluate=evaluate, outer_optimizer=outer_optimizer, **kwargs)
        self.outer_averaging.chosen = not self.outer_auto  # "auto": chosen once, at the first setup with optimizers
        #: plain DiLoCo: all-reduce each fragment in place and apply it at once (no send buffer)
        self._in_place = delay == 0 and self.alpha == 0.0
        self._step = 0
        self._parts: list[list[_Part]] = []
        self._send: list[Tensor] = []
        self._pending: _Pending | None = None
        self._restored_pending: dict[str, Any] | None = None
        self.fragment_syncs = [0] * self.fragments
        self.last_launched: int | None = None
        self.last_applied: int | None = None
        self.in_flight_at_step_start: bool | None = None

    def _parse_outer_optimizer(self, spec: Any) -> OuterSGD | None:
        """``outer_optimizer="auto"``: resolved in :meth:`setup_optimizers` from the inner optimizer(s)."""
        if isinstance(spec, str) and spec != "auto":
            raise ValueError(
                "outer_optimizer must be 'auto' (chosen from the inner optimizer), None (plain averaging) or a mapping "
                f"such as {{'name': 'sgd', 'lr': 0.7, 'momentum': 0.9, 'nesterov': True}}, got {spec!r}"
            )
        self.outer_auto = spec == "auto"
        #: why the outer optimizer is what it is (``"auto"``: the inner optimizer it was chosen for)
        self.outer_reason = "auto: chosen at setup" if self.outer_auto else "given"
        return None if self.outer_auto else parse_outer_optimizer(spec)

    # ------------------------------------------------------------------ setup
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """After Lightning builds the inner optimizer(s): ``outer_optimizer="auto"`` chooses the outer optimizer for
        them, builds it over the (identical or restored) replicas and loads a checkpoint's outer state."""
        super().setup_optimizers(trainer)
        if not self.outer_averaging.chosen and self.optimizers:
            self.outer_config, why = auto_outer_optimizer(self.optimizers)
            self.outer_reason = f"auto: {why}"
            spec = None if self.outer_config is None else self.outer_config.spec()
            rank_zero_info(f"DiLoCoStrategy: outer optimizer {spec}, {why}")
            self.outer_averaging.choose(self.outer_config, self.flat)

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.delay > 0:  # the overlapped all-reduces get their own group (fault-tolerant: torchft's)
            self.topology.open_side_channel()

    def _on_flat_ready(self) -> None:
        groups = self.flat.groups
        if self.fragments == 1:
            self._parts = [[_Part(i, 0, g.param_numel, g.state.numel()) for i, g in enumerate(groups)]]
        else:
            if len(groups) != 1:
                raise ValueError(
                    f"DiLoCoStrategy(fragments={self.fragments}) needs all parameters and buffers in one dtype on one "
                    "device (fragments are ranges of one flat buffer); convert the model to a single dtype or use "
                    "fragments=1."
                )
            g = groups[0]
            if g.param_numel < self.fragments:
                raise ValueError(
                    f"fragments must be <= the model's {g.param_numel} parameter elements, got {self.fragments}"
                )
            ranges = fragment_ranges(g.param_numel, self.fragments)
            last = self.fragments - 1
            self._parts = [
                [_Part(0, lo, hi, g.state.numel() if f == last else hi)] for f, (lo, hi) in enumerate(ranges)
            ]
        if not self._in_place:
            sizes = [0] * len(groups)
            for parts in self._parts:
                for p in parts:
                    sizes[p.group] = max(sizes[p.group], p.end - p.start)
            self._send = [torch.empty(n, dtype=g.state.dtype, device=g.state.device) for n, g in zip(sizes, groups)]
        self._restore_pending()

    # ------------------------------------------------------------------ per step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        pending = self._pending
        self.in_flight_at_step_start = (
            not all(h.is_completed() for h in pending.handles) if pending is not None and pending.handles else None
        )
        return super().training_step(*args, **kwargs)

    def _sync_if_due(self, optimizer: Optimizer) -> bool:
        step = self._step
        self._step += 1
        self.last_launched = self.schedule.launched_after(step)
        if self.last_launched is not None:
            self._launch(self.last_launched, step)
        self.last_applied = self.schedule.applied_after(step)
        if self.last_applied is not None:
            self._apply()
        return self.last_launched is not None

    def _region(self, part: _Part, params_only: bool = False) -> Tensor:
        return self.flat.groups[part.group].state[part.start : part.param_end if params_only else part.end]

    def _launch(self, fragment: int, step: int) -> None:
        """Take the fragment's values (in place, or a copy that local steps will not touch) and all-reduce them:
        blocking with no delay, asynchronously on the second group otherwise."""
        buffers = []
        for part in self._parts[fragment]:
            region = self._region(part)
            if self._in_place:
                buffers.append(region)
            else:
                buffers.append(self._send[part.group][: region.numel()].copy_(region))
        if self.delay == 0:  # blocking (compressed: plain DiLoCo, the buffers are the whole state)
            sent = [b for b in buffers if b.numel()] if self.compressor else buffers
            committed = self.topology.average(sent, "params")
            self._pending = _Pending(fragment, step, buffers, committed=committed)
        else:  # in flight during the next delay steps, on the topology's second group
            self._pending = _Pending(fragment, step, buffers, self.topology.launch(buffers, "params"))
        self.fragment_syncs[fragment] += 1

    def _apply(self) -> None:
        """Wait for the fragment in flight; the outer step turns its mean into the new global parameters; the local
        fragment takes them (mixed with ``alpha``); buffers take the plain mean."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("DiLoCoStrategy: a fragment is due but none is in flight (schedule out of step)")
        if pending.flight is not None:  # in flight since the launch: wait (fault-tolerant: and commit, or not)
            pending.committed = pending.flight.finish()
        if self.verify_sync:
            self.topology.verify(pending.buffers, f"the mean of fragment {pending.fragment}", pending.committed)
        if not pending.committed:
            return  # fault-tolerant sync that failed: the local fragment stays as it is, the next sync tries again
        parts = self._parts[pending.fragment]
        lr = inner_lr(self.optimizers)
        with torch.no_grad():
            for part, buf in zip(parts, pending.buffers):
                n = part.param_end - part.start
                if self.outer is not None and n:
                    self.outer.step(buf[:n], part.group, part.start, inner_lr=lr)
            # compressed: the next changes are taken from the new global model
            self.codec.take_reference([b for b in pending.buffers if b.numel()])
            for part, buf in zip(parts, pending.buffers):  # evaluate="last_sync": before any mixing with alpha
                self._record_synced_region(part.group, part.start, buf)
            if not self._in_place:
                for part, buf in zip(parts, pending.buffers):
                    region = self._region(part)
                    if self.alpha:
                        buf.lerp_(region, self.alpha)
                    region.copy_(buf)
        if self.fragments == 1 and self.alpha == 0.0:
            self._mark_in_sync()  # the whole model, taken as is: every rank holds the global model

    def _drain(self) -> None:
        """Apply the fragment in flight now (the end of training)."""
        if self._pending is not None:
            self._apply()

    # ------------------------------------------------------------------ end of training
    def on_train_end(self) -> None:
        self._drain()
        super().on_train_end()

    def _average_at_end(self) -> None:
        last = self._step - 1
        since = []
        for f in range(self.fragments):
            launched = self.schedule.last_launch(f, last)
            since.append(self._step if launched is None else last - launched)
        if not any(since) and (self.delay == 0 or self.alpha == 0.0):
            self._mark_in_sync()
            return  # every fragment synced at the last step and was taken as is: the replicas hold the global model
        tensors = self.flat.state_tensors()
        committed = self.topology.average(tensors, "final")
        if self.verify_sync:
            self.topology.verify(tensors, "parameters and buffers after the final sync", committed)
        if not committed:
            return  # fault-tolerant: the final sync failed, every replica group keeps its own model
        if self.outer is not None:
            lr = inner_lr(self.optimizers)
            with torch.no_grad():
                for f, steps in enumerate(since):
                    for part in self._parts[f]:
                        params = self._region(part, params_only=True)
                        if steps:
                            self.outer.step(params, part.group, part.start, inner_lr=lr)
                        else:  # synced at the last step: its mean holds nothing the global model lacks
                            params.copy_(self.outer.global_params[part.group][part.start : part.param_end])
        self._record_synced()
        self._mark_in_sync()

    # ------------------------------------------------------------------ failures and teardown
    def on_exception(self, exception: BaseException) -> None:
        self._pending = None  # never wait for an all-reduce in flight on the way out: a peer may be gone
        super().on_exception(exception)

    def teardown(self) -> None:
        if self._pending is not None and self._comm is not None:
            for handle in self._pending.handles:
                handle.wait()
        self._pending = None
        super().teardown()

    # ------------------------------------------------------------------ metrics and state
    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        metrics["period"] = float(self.sync_every)
        return metrics

    def _ft_next_step_syncs(self) -> bool:
        return self.schedule.launched_after(self._step) is not None

    def _config(self) -> dict[str, int]:
        return {"sync_every": self.sync_every, "fragments": self.fragments, "delay": self.delay}

    def strategy_state(self) -> dict[str, Any]:
        # real work: the fragment in flight is waited for and saved (put back into the send buffers on restore), and
        # the schedule is checked against this run's on restore
        state = super().strategy_state()
        pending = None
        if self._pending is not None:
            for handle in self._pending.handles:  # complete, not applied: applied at its step after a resume too
                handle.wait()
            p = self._pending
            pending = {
                "fragment": p.fragment,
                "step": p.step,
                "buffers": [b.detach().to("cpu", copy=True) for b in p.buffers],
            }
        state["diloco"] = {
            **self._config(),
            "step": self._step,
            "fragment_syncs": list(self.fragment_syncs),
            "pending": pending,
        }
        return state

    def load_strategy_state(self, state: dict[str, Any]) -> None:
        super().load_strategy_state(state)
        saved = state["diloco"]
        config = {k: saved[k] for k in self._config()}
        if config != self._config():
            raise ValueError(
                f"the checkpoint's DiLoCo schedule is {config}; this run uses {self._config()}: resume with the same "
                "sync_every, fragments and delay"
            )
        self._step = int(saved["step"])
        self.fragment_syncs = [int(n) for n in saved["fragment_syncs"]]
        self._restored_pending = saved["pending"]
        if self._parts:  # restored after setup
            self._restore_pending()

    def _restore_pending(self) -> None:
        """A checkpoint's fragment in flight: its (completed) mean goes back into the send buffers, applied at its
        step."""
        saved, self._restored_pending = self._restored_pending, None
        if saved is None:
            return
        fragment = int(saved["fragment"])
        buffers = []
        for part, values in zip(self._parts[fragment], saved["buffers"], strict=True):
            buffers.append(self._send[part.group][: values.numel()].copy_(values))
        # its all-reduce completed before the checkpoint; with replica groups the leader's result still goes to the
        # replica's other ranks when it is applied
        self._pending = _Pending(fragment, int(saved["step"]), buffers, self.topology.completed(buffers, "params"))
