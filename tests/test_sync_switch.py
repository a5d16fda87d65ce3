"""Sync-Switch trained with Lightning on CPU processes (gloo).

Two process sets: 2 ranks run the scheduled switch (with an LR scheduler, to check the configuration policy), and
3 ranks run the online policies with an injected straggler (the S - sigma detector needs >= 3 ranks) and without
one. Every rank writes what it observed; the tests assert on it. Setup rejections and YAML are at the end.

The online policies' decisions are asserted exactly, so their detector is fed a step clock instead of the wall
clock (:class:`_StepClockSyncSwitch`): with 3 ranks on 2 cores, scheduling alone puts a rank's measured throughput
at two thirds of the mean or below (measured). One smoke test (``smoke``) runs the wall clock with a real straggler
and asserts only that it is the one flagged.
"""

from __future__ import annotations

import json
import random
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from launch import run_external

from lightning_sync import SyncSwitchStrategy
from lightning_sync.callbacks import StragglerInjection, SyncSwitch
from lightning_sync.core.ps import update_scale_for
from lightning_sync.data import DigitsDataModule
from lightning_sync.launch import quiet_trainer_kwargs
from lightning_sync.models import DigitsCNN

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
TIMEOUT = timedelta(seconds=60)
EPOCHS = 4
SCHEDULED_EPOCHS = 3
LR, GAMMA = 0.05, 0.5


# ----------------------------------------------------------------------------------------------- worker side
def _checksum(model: torch.nn.Module) -> list[float]:
    flat = torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values() if t.is_floating_point()])
    return [float(flat.sum()), float((flat * torch.arange(flat.numel(), dtype=torch.float64)).sum())]


class _StepClockStraggler(StragglerInjection):
    """Which batches are slowed, as :class:`StragglerInjection` (the rank's own batch count), without sleeping:
    :class:`_StepClockSyncSwitch` reads the slowdown from here."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pass

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.slowed_steps += self.slowed(trainer.global_rank)
        self.batches_seen += 1

    def slowed(self, rank: int) -> bool:
        """Whether this rank's current batch (not yet counted) is slowed."""
        return self.is_straggler(rank) and self._in_window(self.batches_seen)


#: step-clock noise: every step's compute time is 1 unit times a factor in [1 - NOISE, 1 + NOISE], so a 3-step
#: window's throughput is in [0.91, 1.11] (in steps per unit). Without a straggler no rank is ever below
#: (1 - margin) = 0.5 x the mean (the clean run cannot flag anyone), while S - sigma alone (margin 0) flags such
#: +-10% outliers: the noise checks that the margin is applied. A window of 3 steps slowed x4 is at most 0.28,
#: against a threshold of at least 0.34 (min(S - sigma, 0.5 S) with the others at >= 0.91): always below.
NOISE = 0.1


class _StepClockSyncSwitch(SyncSwitchStrategy):
    """The detector's input from a step clock instead of the wall clock: a timed step computes for
    ``(1 +- NOISE) x`` (the straggler's slowdown on its slowed batches) units; the noise is drawn from the rank and
    its own batch count, so it is the same in every run. Which steps are timed is the strategy's (not the first of
    an epoch)."""

    def _measure(self) -> None:
        super()._measure()
        if self.last_step_compute_s is None:
            return
        trainer = self.lightning_module.trainer
        clock = next((cb for cb in trainer.callbacks if isinstance(cb, _StepClockStraggler)), None)
        index = clock.batches_seen if clock is not None else trainer.global_step
        noise = random.Random(f"{self.global_rank}/{index}").uniform(1.0 - NOISE, 1.0 + NOISE)
        slowdown = clock.slowdown if clock is not None and clock.slowed(self.global_rank) else 1.0
        self.last_step_compute_s = 0.01 * slowdown * noise


def _fit(
    world: int,
    callbacks: list,
    epochs: int = EPOCHS,
    strategy_kw: dict | None = None,
    strategy_cls: type[SyncSwitchStrategy] = SyncSwitchStrategy,
    **model_kw,
) -> tuple[pl.Trainer, SyncSwitchStrategy]:
    from lightning.pytorch.callbacks import Callback

    class Observe(Callback):
        """Learning rate the optimizer used at each step; parameters right after the first switch."""

        def __init__(self) -> None:
            self.lrs: list[tuple[int, int, float]] = []
            self.momenta: list[tuple[int, float]] = []
            self.at_switch: list[float] | None = None

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            # the effective rate of this step: the optimizer's rate during the step, times the factor the pushed
            # update is scaled by under ASP (the rate the global model moves at)
            s = trainer.strategy
            push = update_scale_for(s.update_scale, trainer.world_size) if s.protocol == "asp" else 1.0
            self.lrs.append((trainer.global_step, trainer.current_epoch, optimizer.param_groups[0]["lr"] * push))
            self.momenta.append((trainer.global_step, optimizer.param_groups[0]["momentum"]))

        def on_train_batch_end(self, trainer, pl_module, *args):
            if self.at_switch is None and trainer.strategy.protocol == "asp":
                self.at_switch = _checksum(pl_module)

    pl.seed_everything(0)
    observe = Observe()
    strategy = strategy_cls(process_group_backend="gloo", timeout=TIMEOUT, verify_sync=True, **(strategy_kw or {}))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=epochs,
        callbacks=[*callbacks, observe],
        **quiet_trainer_kwargs(limit_val_batches=0),
    )
    trainer.fit(DigitsCNN(lr=LR, momentum=0.9, **model_kw), DigitsDataModule(batch_size=32))
    trainer.observe = observe  # type: ignore[attr-defined]
    return trainer, strategy


def _record(trainer: pl.Trainer, strategy: SyncSwitchStrategy, switch: SyncSwitch) -> dict:
    return {
        "switches": strategy.switches,
        "events": [{k: v for k, v in e.items() if k != "source"} for e in switch.events],
        "ops": dict(strategy.comm_stats.ops),
        "global_step": trainer.global_step,
        "num_batches": strategy.num_batches,
        "bsp_batches": strategy.bsp_batches,
        "lrs": trainer.observe.lrs,  # type: ignore[attr-defined]
        "momenta": trainer.observe.momenta,  # type: ignore[attr-defined]
        "momentum_after": trainer.optimizers[0].param_groups[0]["momentum"],
        "at_switch": trainer.observe.at_switch,  # type: ignore[attr-defined]
        "detector": switch._detector.history if switch._detector is not None else [],  # per window, for messages
    }


def _scheduled(rank: int, out_dir: str) -> None:
    switch = SyncSwitch(schedule=[("bsp", 0.25), ("asp", 1.0)])
    trainer, strategy = _fit(
        2,
        [switch],
        epochs=SCHEDULED_EPOCHS,
        strategy_kw={"worker_momentum": "auto"},
        lr_milestones=[1, 2],
        lr_gamma=GAMMA,
    )
    res = _record(trainer, strategy, switch)
    Path(out_dir, f"scheduled_{rank}.json").write_text(json.dumps(res))


#: the step-clock straggler's slowed batches: windows 2 and 3 exactly (batch 0 of an epoch is not timed, so the
#: 3-step windows are batches 1-3, 4-6, 7-9, ...); flagged after its 2nd slow window, at the end of batch 9
START, DURATION, WINDOW, CONSECUTIVE = 4, 6, 3, 2
FLAG_STEP = START + CONSECUTIVE * WINDOW  # global_step at the end of batch START + 2 * WINDOW - 1


def _online(rank: int, out_dir: str) -> None:
    step_clock = {
        # x4 straggler on rank 2 for its batches 4..9 (transient: flagged mid-epoch 0, gone by its end); no straggler
        "greedy": ("greedy", _StepClockStraggler(ranks=2, slowdown=4.0, start=START, duration=DURATION)),
        "elastic": ("elastic", _StepClockStraggler(ranks=2, slowdown=4.0, start=START, duration=DURATION)),
        "clean": ("greedy", None),
    }
    for name, (policy, injection) in step_clock.items():
        switch = SyncSwitch(
            schedule=[("bsp", 0.5), ("asp", 1.0)], policy=policy, window=WINDOW, consecutive=CONSECUTIVE, margin=0.5
        )
        trainer, strategy = _fit(3, [switch] + ([injection] if injection else []), strategy_cls=_StepClockSyncSwitch)
        Path(out_dir, f"{name}_{rank}.json").write_text(json.dumps(_record(trainer, strategy, switch)))
    # the wall clock, with a real x8 straggler (it sleeps 7x its own step time) on its batches 4..9: the waiting
    # ranks' blocked time is not compute, so only rank 2 can be flagged. Margin 0.5: a wrong flag needs a rank
    # below half the mean in 2 windows in a row, before rank 2's 2nd slow window
    switch = SyncSwitch(
        schedule=[("bsp", 0.5), ("asp", 1.0)], policy="greedy", window=WINDOW, consecutive=CONSECUTIVE, margin=0.5
    )
    injection = StragglerInjection(ranks=2, slowdown=8.0, start=START, duration=DURATION)
    trainer, strategy = _fit(3, [switch, injection], epochs=2)
    Path(out_dir, f"smoke_{rank}.json").write_text(json.dumps(_record(trainer, strategy, switch)))


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_switch")
    run_external(_scheduled, 2, str(out))
    return [json.loads((out / f"scheduled_{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_switch_online")
    run_external(_online, 3, str(out))
    return {
        name: [json.loads((out / f"{name}_{r}.json").read_text()) for r in range(3)]
        for name in ("greedy", "elastic", "clean", "smoke")
    }


# ----------------------------------------------------------------------------------------------- scheduled switch
def test_switch_at_the_scheduled_step_on_every_rank(scheduled):
    total = SCHEDULED_EPOCHS * scheduled[0]["num_batches"]
    expected = -(-int(0.25 * total) // 2)  # BSP steps until 25% of the batch positions are trained (2 per step)
    assert expected < scheduled[0]["num_batches"] // 2  # mid-epoch 0: positions are handed over to the counter
    for res in scheduled:
        assert [(s["from"], s["to"]) for s in res["switches"]] == [("bsp", "asp")]
        assert res["switches"][0]["step"] == expected
        # one 4-byte all-reduce and a copy, plus the other rank's arrival: well under 10 s on a loaded machine (a
        # restart from a checkpoint, the paper's switch, takes 36-90 s; a wait for the 60 s timeout fails too)
        assert 0.0 <= res["switches"][0]["seconds"] < 10.0
        assert res["bsp_batches"] == 2 * expected


def test_parameters_identical_at_the_switch(scheduled):
    assert scheduled[0]["at_switch"] is not None
    assert scheduled[0]["at_switch"] == scheduled[1]["at_switch"]


def test_blocking_allreduces_stop_and_pushes_start_after_the_switch(scheduled):
    for res in scheduled:
        switch_step = res["switches"][0]["step"]
        asp_steps = res["global_step"] - switch_step
        assert res["ops"]["grads"] == switch_step  # one gradient all-reduce per BSP step, none after
        assert res["ops"]["push"] >= asp_steps > 0  # one push per ASP step (to the remote server)


def test_learning_rate_follows_the_configuration_policy_with_a_scheduler(scheduled):
    for res in scheduled:
        switch_step = res["switches"][0]["step"]
        assert res["lrs"], "no optimizer step observed"
        for step, epoch, lr in res["lrs"]:
            scheduled_lr = LR * GAMMA ** min(epoch, 2)  # MultiStepLR(milestones=[1, 2])
            factor = 1.0 if step < switch_step else 0.5  # BSP: the user's (DDP's) eta; ASP: pushes at eta / m
            assert lr == pytest.approx(scheduled_lr * factor), (step, epoch, lr)


def test_worker_momentum_auto_applies_in_the_asp_phase_only(scheduled):
    for res in scheduled:
        switch_step = res["switches"][0]["step"]
        assert len(res["momenta"]) == res["global_step"]
        for step, momentum in res["momenta"]:
            # BSP: the user's 0.9 (DDP's step); ASP with 2 ranks pushing: 1 - (1 - 0.9) * 3/2 = 0.85
            assert momentum == pytest.approx(0.9 if step < switch_step else 0.85), (step, momentum)
        assert res["momentum_after"] == 0.9  # put back after every step


# ----------------------------------------------------------------------------------------------- online policies
def _kinds(res: dict) -> list[str]:
    return [e["event"] for e in res["events"]]


def test_detector_flags_the_injected_straggler_within_k_windows(online):
    # greedy: the first decision is the straggler switch, naming rank 2 only, as soon as it has been slow for
    # `consecutive` windows (step clock: exactly at the end of its 2nd fully slowed window)
    for res in online["greedy"]:
        first = res["events"][0]
        assert first["event"] == "straggler_switch_to_asp" and first["ranks"] == [2], res["events"]
        assert first["step"] == FLAG_STEP, res["events"]


def test_detector_flags_the_real_straggler_on_the_wall_clock(online):
    # smoke test of the measured input: step time minus blocked time. Rank 2's sleep shows in its next step, so
    # its slow windows are 4-6 (2 slowed of 3) and 7-9 (flag at step 10), at the latest 10-12 (flag at step 13)
    for res in online["smoke"]:
        first = res["events"][0]
        assert first["event"] == "straggler_switch_to_asp" and first["ranks"] == [2], (res["events"], res["detector"])
        assert START <= first["step"] <= FLAG_STEP + WINDOW, (res["events"], res["detector"])


def test_detector_flags_no_one_without_a_straggler(online):
    for res in online["clean"]:
        assert _kinds(res) == ["quota_done"]
        assert [(s["from"], s["to"]) for s in res["switches"]] == [("bsp", "asp")]


def test_greedy_switches_to_asp_and_back_when_the_straggler_clears(online):
    for res in online["greedy"]:
        assert _kinds(res) == ["straggler_switch_to_asp", "clear_switch_to_bsp", "quota_done"], res["events"]
        assert [(s["from"], s["to"]) for s in res["switches"]] == [("bsp", "asp"), ("asp", "bsp"), ("bsp", "asp")]


def test_elastic_excludes_the_straggler_then_restores_the_cluster(online):
    survivor = online["elastic"][0]
    kinds = _kinds(survivor)
    assert kinds[0] == "exclude" and survivor["events"][0]["ranks"] == [2]
    assert kinds[-1] == "quota_done_restore"
    assert "straggler_switch_to_asp" not in kinds
    # the straggler was parked (it trained fewer BSP steps), every rank ends in ASP
    assert online["elastic"][2]["ops"]["grads"] < survivor["ops"]["grads"]
    assert any(s["from"] == "parked" for s in online["elastic"][2]["switches"])
    for res in online["elastic"]:
        assert res["switches"][-1]["to"] == "asp"


# ----------------------------------------------------------------------------------------------- setup, YAML, input
def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="schedule"):
        SyncSwitch(schedule=[("bsp", 0.5), ("asp", 0.4)])
    with pytest.raises(ValueError, match="schedule"):
        SyncSwitch(schedule=[("bsp", 0.0), ("asp", 1.0)])
    with pytest.raises(ValueError, match="schedule"):
        SyncSwitch(schedule=[("bsp", 0.5), ("asp", 1.2)])
    with pytest.raises(ValueError, match="schedule"):
        SyncSwitch(schedule=[("ssp", 0.5), ("asp", 1.0)])
    with pytest.raises(ValueError, match="policy"):
        SyncSwitch(policy="eager")
    with pytest.raises(ValueError, match="window"):
        SyncSwitch(window=0)
    with pytest.raises(ValueError, match="margin"):
        SyncSwitch(margin=1.0)
    with pytest.raises(ValueError, match="bsp_lr_scale"):
        SyncSwitchStrategy(bsp_lr_scale=0)
    with pytest.raises(ValueError, match="asp_lr_scale"):
        SyncSwitchStrategy(asp_lr_scale=-1.0)


def test_policy_needs_three_ranks_and_the_callback_needs_the_strategy(single_process):
    from lightning_sync import BSPStrategy

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=BSPStrategy(process_group_backend="gloo"),
        max_epochs=1,
        callbacks=[SyncSwitch()],
        **quiet_trainer_kwargs(),
    )
    with pytest.raises(ValueError, match="SyncSwitchStrategy"):
        trainer.fit(DigitsCNN(), DigitsDataModule(batch_size=32))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SyncSwitchStrategy(process_group_backend="gloo"),
        max_epochs=1,
        callbacks=[SyncSwitch(policy="greedy")],
        **quiet_trainer_kwargs(),
    )
    with pytest.raises(ValueError, match="at least 3 ranks"):
        trainer.fit(DigitsCNN(), DigitsDataModule(batch_size=32))


def test_sync_switch_by_name_and_yaml(single_process, tmp_path):
    from lightning_sync.cli import cli_main

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="sync_switch", max_epochs=1, **quiet_trainer_kwargs())
    assert isinstance(trainer.strategy, SyncSwitchStrategy)
    cli = cli_main(
        ["--config", str(CONFIGS / "sync_switch.yaml"), "--trainer.devices=1", "--trainer.logger=false"], run=False
    )
    assert isinstance(cli.trainer.strategy, SyncSwitchStrategy)
    switches = [cb for cb in cli.trainer.callbacks if isinstance(cb, SyncSwitch)]
    assert len(switches) == 1 and switches[0].schedule.as_list() == [["bsp", 0.25], ["asp", 1.0]]
