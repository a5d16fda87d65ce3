"""``SyncSwitch``: decides when :class:`~lightning_sync.strategies.SyncSwitchStrategy` trains with BSP or ASP.

The strategy adds it when the user passed none, so it lives beside the strategy, below it: it steers any strategy
that can switch (:class:`Switchable`) and imports none. Users import it from :mod:`lightning_sync.callbacks`.
"""

from __future__ import annotations

import logging
from collections import deque
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_sync.core.switch import (
    ElasticPolicy,
    GreedyPolicy,
    StragglerDetector,
    SwitchSchedule,
    ThroughputWindow,
)
from lightning_sync.core.validation import MAX_INT64, check_int, check_real

log = logging.getLogger(__name__)

__all__ = ["SyncSwitch", "Switchable"]


@runtime_checkable
class Switchable(Protocol):
    """What :class:`SyncSwitch` steers: :class:`~lightning_sync.strategies.SyncSwitchStrategy`'s switching surface."""

    protocol: str

    def switch_to_asp(self) -> None: ...
    def set_next_epoch_protocol(self, protocol: str) -> None: ...
    def gather_throughputs(self, mine: float) -> Any: ...
    def exclude(self, excluded: Any) -> None: ...
    def restore_now(self) -> None: ...


_POLICIES = (None, "greedy", "elastic")


class SyncSwitch(Callback):
    """When to switch (Sync-Switch §IV-A/B): a schedule of workload fractions, optionally with an online policy.

    * **Schedule** (offline policy, §IV-B1): ``schedule=[("bsp", 0.25), ("asp", 1.0)]`` trains BSP for the first
      25% of the workload (``max_epochs`` passes over the data, counted in batch positions), then ASP. Any form
      :meth:`~lightning_sync.core.switch.SwitchSchedule.parse` reads is accepted, including the path of the YAML
      snippet ``lightning-sync search-switch`` writes and the compact ``"bsp:0.25,asp:1.0"``. BSP → ASP happens at
      the first step at or past the boundary; ASP → BSP at the next epoch start (ranks running ASP only meet there).
    * **Online policies** (§IV-B2), ``policy="greedy"`` or ``"elastic"``: the BSP quota is the schedule's BSP
      fraction. Every ``window`` BSP steps each rank's compute throughput (steps per second of wall time minus time
      blocked in communication, so waiting for a straggler does not count against the waiting rank) is all-gathered
      (8 bytes per rank) and fed to the S − σ detector (``consecutive`` windows, ``margin``;
      :class:`~lightning_sync.core.switch.StragglerDetector`). *Greedy* switches to ASP while a straggler exists and
      back to BSP (at the next epoch start, from the throughputs each rank measured in its last ASP window) when the
      cluster is clear, until the quota is done; *elastic* excludes stragglers from the BSP group until the quota is
      done, then restores the full cluster for ASP (and at each epoch end: see the strategy). The detector needs at
      least 3 ranks (with 2 the slower one is always exactly S − σ), so a policy with fewer raises at setup.

    Decisions are made on every rank from the same numbers, so ranks agree without a leader. Every decision is an
    entry of :attr:`events` (``{"step", "event", "ranks", "protocol", ...}``) and an info log line on rank 0; the
    strategy's ``switches`` lists the switches it carried out with their cost in seconds.

    Args:
        schedule: the protocol schedule (default BSP for 25%, then ASP).
        policy: ``None`` (the schedule alone), ``"greedy"`` or ``"elastic"``.
        window: detection window, in BSP steps (an integer in [1, 2**63 - 1]).
        consecutive: windows in a row a rank must be slow to be flagged (>= 1).
        margin: a flagged rank is also below ``(1 - margin)`` × the mean, in [0, 1).
        min_participants: the elastic policy never shrinks the BSP group below this many ranks (>= 1).
    """

    def __init__(
        self,
        schedule: Any = (("bsp", 0.25), ("asp", 1.0)),
        policy: Literal["greedy", "elastic"] | None = None,
        window: int = 10,
        consecutive: int = 3,
        margin: float = 0.2,
        min_participants: int = 2,
    ) -> None:
        if isinstance(schedule, Path):
            schedule = str(schedule)
        self.schedule = SwitchSchedule.parse(schedule)
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
        self.policy_name = policy
        self.window = check_int("window", window, 1, MAX_INT64)
        self.consecutive = check_int("consecutive", consecutive, 1)
        self.margin = check_real("margin", margin, 0.0, 1.0, high_open=True)
        self.min_participants = check_int("min_participants", min_participants, 1)
        self.events: list[dict[str, Any]] = []
        self._meter = ThroughputWindow(self.window)
        self._detector: StragglerDetector | None = None
        self._policy: GreedyPolicy | ElasticPolicy | None = None
        self._recent: deque[float] = deque(maxlen=self.window)
        self._policy_seen = 0  # policy events already copied into `events`

    @property
    def state_key(self) -> str:
        return self._generate_state_key(schedule=self.schedule.as_list(), policy=self.policy_name)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not isinstance(trainer.strategy, Switchable):
            raise ValueError(
                f"SyncSwitch steers SyncSwitchStrategy, but the strategy is {type(trainer.strategy).__name__}. "
                "Use Trainer(strategy='sync_switch') or strategy=SyncSwitchStrategy(...)."
            )
        world = trainer.world_size
        if self.policy_name is not None and world < 3:
            raise ValueError(
                f"SyncSwitch(policy={self.policy_name!r}) needs at least 3 ranks, this run has {world}: with 2 the "
                "slower rank's throughput is exactly the mean minus the standard deviation, so the S - sigma detector "
                "can never flag it. Use 3 or more devices, or a schedule without a policy."
            )
        quota = self.schedule.bsp_fraction
        self._detector = StragglerDetector(world, self.consecutive, self.margin)
        if self.policy_name == "greedy":
            self._policy = GreedyPolicy(quota)
        elif self.policy_name == "elastic":
            self._policy = ElasticPolicy(quota, world, self.min_participants)
        self._meter.reset()
        self._recent = deque(maxlen=self.window)
        self._policy_seen = 0

    # ------------------------------------------------------------------ decisions
    def _event(self, trainer: pl.Trainer, event: str, ranks: Any = (), protocol: str = "", **extra: Any) -> None:
        entry = {"step": trainer.global_step, "event": event, "ranks": sorted(ranks), "protocol": protocol, **extra}
        self.events.append(entry)
        rank_zero_info(f"SyncSwitch: {entry}")

    def _sync_policy_events(self, trainer: pl.Trainer) -> None:
        """Copy the policy's new events into :attr:`events` (and log them)."""
        if self._policy is None:
            return
        for entry in self._policy.events[self._policy_seen :]:
            self.events.append({**entry, "source": "policy"})
            rank_zero_info(f"SyncSwitch: {entry}")
        self._policy_seen = len(self._policy.events)

    def _total(self, strategy: Any, trainer: pl.Trainer) -> int:
        return max(1, strategy.num_batches * int(trainer.max_epochs or 1))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._meter.reset()  # windows stay aligned across ranks (a parked rank missed the group's steps)
        self._recent.clear()
        self._rejoin(trainer)

    def _rejoin(self, trainer: pl.Trainer) -> None:
        """After an exclusion ended with the epoch: the cluster is restored (the group leader's replica and
        counters) and every rank continues from the group's decision state — parked ranks missed its detection
        windows. Done at the epoch end, before a checkpoint there, or at the next epoch start."""
        strategy = trainer.strategy
        leader = strategy.rejoin_leader
        if leader is None:
            return
        if self._detector is not None:
            state = strategy.broadcast(self._decision_state(), src=leader)
            self._load_decision_state(state)
        strategy.restore_now()

    def _decision_state(self) -> dict[str, Any]:
        assert self._detector is not None
        return {
            "detector": self._detector.state_dict(),
            "policy": self._policy.state_dict() if self._policy is not None else None,
        }

    def _load_decision_state(self, state: dict[str, Any]) -> None:
        assert self._detector is not None
        self._detector.load_state_dict(state["detector"])
        if self._policy is not None and state["policy"] is not None:
            self._policy.load_state_dict(state["policy"])

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = trainer.strategy
        seconds = strategy.last_step_compute_s
        throughput = self._meter.record(1, seconds) if seconds is not None else None
        if strategy.protocol == "asp":
            if seconds is not None:  # the last `window` ASP steps, gathered at the epoch end (greedy's return)
                self._recent.append(seconds)
            return
        bsp_progress = strategy.bsp_batches / self._total(strategy, trainer)
        if self._policy is None:
            if self.schedule.protocol_at(strategy.progress()) == "asp":
                strategy.switch_to_asp()
                self._event(trainer, "switch_to_asp", protocol="asp", progress=round(strategy.progress(), 4))
            return
        step = trainer.global_step
        flagged: set[int] = set()
        if throughput is not None and not self._policy.quota_done(bsp_progress):
            assert self._detector is not None
            flagged = self._detector.update(strategy.gather_throughputs(throughput))
        elif not self._policy.quota_done(bsp_progress):
            return
        if isinstance(self._policy, GreedyPolicy):
            if self._policy.decide(step, "bsp", bsp_progress, flagged) == "asp":
                strategy.switch_to_asp()
        else:
            protocol, excluded = self._policy.decide(step, bsp_progress, flagged)
            if protocol == "asp":
                strategy.switch_to_asp()
            elif excluded != strategy.excluded:
                strategy.exclude(excluded)  # an excluded rank returns from here when the group releases it
                if strategy.protocol == "asp":  # released because the group's quota is done
                    self._policy.decide(step, 1.0, set())
        self._sync_policy_events(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if isinstance(self._policy, ElasticPolicy) and self._policy.excluded:
            self._policy.release(trainer.global_step, "epoch_end")  # the strategy restores the cluster there
        self._rejoin(trainer)  # a checkpoint at this epoch end (ModelCheckpoint runs after) sees the whole cluster
        if strategy.protocol != "asp" or strategy._next_protocol is not None:
            self._sync_policy_events(trainer)
            return
        if self._policy is None:
            upcoming = (trainer.current_epoch + 1) / max(1, int(trainer.max_epochs or 1))
            if upcoming < 1.0 and self.schedule.protocol_at(upcoming) == "bsp":
                strategy.set_next_epoch_protocol("bsp")
                self._event(trainer, "switch_to_bsp_next_epoch", protocol="bsp")
            return
        if isinstance(self._policy, GreedyPolicy):
            bsp_progress = strategy.bsp_batches / self._total(strategy, trainer)
            if not self._policy.quota_done(bsp_progress):
                # ASP ranks meet here: one window per rank, measured in its last ASP steps
                assert self._detector is not None
                recent = sum(self._recent)
                mine = len(self._recent) / recent if self._recent and recent > 0 else None
                throughputs = strategy.gather_throughputs(mine)
                if sum(t is not None for t in throughputs) < 2:
                    return  # no ASP step was timed this epoch (it switched at its last step): decide next epoch
                flagged = self._detector.update(throughputs)
                target = self._policy.decide(trainer.global_step, "asp", bsp_progress, flagged)
                strategy.set_next_epoch_protocol(target)
        self._sync_policy_events(trainer)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "events": list(self.events),
            "detector": self._detector.state_dict() if self._detector is not None else None,
            "policy": self._policy.state_dict() if self._policy is not None else None,
            "meter": self._meter.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = list(state_dict.get("events", []))
        self._meter.load_state_dict(state_dict["meter"])
        if self._detector is not None and state_dict.get("detector") is not None:
            self._detector.load_state_dict(state_dict["detector"])
        if self._policy is not None and state_dict.get("policy") is not None:
            self._policy.load_state_dict(state_dict["policy"])
            self._policy_seen = len(self._policy.events)  # those are already in `events`
