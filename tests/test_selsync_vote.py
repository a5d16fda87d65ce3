"""SelSync's vote off the critical path (``vote="overlapped"``) against Alg. 1's order (``vote="exact"``).

Two CPU processes (torchrun-style, ``tests/launch.py``), several fits in them:

* **Which step syncs**: with δ = 0 every vote asks for a sync. Exact: every step syncs (BSP's trajectory). Overlapped:
  step k's vote decides after step k+1's update, so the first step is local and every later step syncs; replicas
  identical after every sync (``verify_sync``). (Resume with a vote in flight: ``tests/test_resume.py``.) Validation
  during fit reads the vote in flight and takes the sync it asks for before validating.
* **Off the critical path**: an emulated link of 40 ms latency and a step of ≥ 120 ms of compute (a sleep in the
  model). Exact: every step waits for its vote's round trip (blocked ≥ the latency less the optimizer step the wait
  overlaps, per step: a lower bound by construction, given an update of under 10 ms). Overlapped: the round trip
  runs during the next step's compute, so the training thread waits (almost) nothing for it — bounded at a quarter
  of the latency per step, against the 80 ms of compute left over after the transfer (repeats: see the test).
* **Rules**: overlapped needs parameter aggregation (refused at construction with gradients); the default is
  overlapped with parameters and exact with gradients.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_suite

from lightning_sync import SelSyncStrategy

WORLD = 2
LATENCY_S = 0.04
COMPUTE_S = 0.12
STEPS = 8


def test_defaults_and_the_refusal():
    assert SelSyncStrategy().vote == "overlapped"
    assert SelSyncStrategy(aggregation="gradients").vote == "exact"
    assert SelSyncStrategy(vote="exact").vote == "exact"
    with pytest.raises(ValueError, match=r"vote='overlapped' needs aggregation='parameters'"):
        SelSyncStrategy(vote="overlapped", aggregation="gradients")
    with pytest.raises(ValueError, match=r"vote must be 'exact', 'overlapped' or None"):
        SelSyncStrategy(vote="late")


def _suite(rank: int, out_dir: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    class Slow(DigitsCNN):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(COMPUTE_S)  # a step's compute, long against the link's latency
            return super().training_step(batch, batch_idx)

    class Steps(Callback):
        def __init__(self) -> None:
            self.synced: list[bool] = []

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.synced.append(trainer.strategy.step_counter.sync_steps > sum(self.synced))

    res: dict[str, Any] = {}
    # validation after every step (one batch): the overlapped vote in flight is read there and its sync taken before
    # validation, so every step syncs (delta=0) and validation never averages for evaluation
    steps = Steps()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=SelSyncStrategy(delta=0.0, vote="overlapped", verify_sync=True),
        max_steps=STEPS,
        val_check_interval=1,
        limit_val_batches=1,
        callbacks=[steps],
        **quiet_trainer_kwargs(),
    )
    trainer.fit(DigitsCNN(), DigitsDataModule(batch_size=32))
    metrics = trainer.strategy.sync_metrics()
    res["validated/synced"] = [trainer.strategy.step_counter.sync_steps, trainer.strategy.step_counter.local_steps]
    res["validated/bytes"] = [metrics.get("bytes_eval", 0.0), metrics.get("bytes_params", 0.0)]
    for vote in ("exact", "overlapped"):
        # which steps sync: delta=0 asks for a sync at every vote
        steps = Steps()
        pl.seed_everything(0)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=SelSyncStrategy(delta=0.0, vote=vote, verify_sync=True),
            max_steps=STEPS,
            callbacks=[steps],
            **quiet_trainer_kwargs(limit_val_batches=0),
        )
        trainer.fit(DigitsCNN(), DigitsDataModule(batch_size=32))
        res[f"{vote}/synced"] = steps.synced
        res[f"{vote}/vote_ops"] = trainer.strategy.comm_stats.ops["vote"]
        # the round trip: delta=inf, no step syncs; only the votes travel, under 40 ms of latency
        pl.seed_everything(0)
        strategy = SelSyncStrategy(delta=float("inf"), vote=vote, link=f"100gbit,{int(LATENCY_S * 1000)}ms")
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            max_steps=STEPS,
            **quiet_trainer_kwargs(limit_val_batches=0),
        )
        trainer.fit(Slow(), DigitsDataModule(batch_size=32))
        res[f"{vote}/vote_blocked_s"] = strategy.comm_stats.blocked_seconds["vote"]
        res[f"{vote}/sync_steps"] = strategy.step_counter.sync_steps
    (Path(out_dir) / f"res_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_suite(_suite, WORLD, tmp_path_factory.mktemp("vote"))


def test_exact_syncs_the_step_that_voted_overlapped_the_next_one(suite):
    for r in suite:
        assert r["exact/synced"] == [True] * STEPS  # delta=0: BSP's steps
        assert r["overlapped/synced"] == [False] + [True] * (STEPS - 1)  # step 1's vote decides after step 2
        assert r["exact/vote_ops"] == r["overlapped/vote_ops"] == STEPS  # one vote a step, in both


def test_validation_reads_the_vote_in_flight_and_takes_its_sync_first(suite):
    for r in suite:
        assert r["validated/synced"] == [STEPS, 0]  # each step's sync taken at the validation after it
        bytes_eval, bytes_params = r["validated/bytes"]
        assert bytes_eval == 0.0 and bytes_params > 0  # validation right after a sync averages nothing


def test_a_local_step_waits_for_its_vote_only_in_the_exact_order(suite):
    for r in suite:
        assert r["exact/sync_steps"] == r["overlapped/sync_steps"] == 0
        # exact: each step waits for its own vote: the latency (by construction of the emulation) less the optimizer
        # step it overlaps (a few ms here)
        assert r["exact/vote_blocked_s"] >= 0.75 * STEPS * LATENCY_S
        # overlapped: in flight during the next step's compute; the last vote is waited for at the end of training
        assert r["overlapped/vote_blocked_s"] <= LATENCY_S + STEPS * LATENCY_S / 4
