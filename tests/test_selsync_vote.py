"""SelSync's vote off the critical path (``vote="overlapped"``) against Alg. 1's order (``vote="exact"``).

Two CPU processes (torchrun-style, ``tests/launch.py``), several fits in them:

* **Which step syncs**: during ``delta="auto"``'s warm-up (δ = 0 from the calibrator, the votes still needed: they
  carry every rank's Δ) every vote asks for a sync. Exact: every step syncs. Overlapped: step k's vote decides after
  step k+1's update, so the first step is local and every later step syncs; replicas identical after every sync
  (``verify_sync``). (Resume with a vote in flight: ``tests/test_resume.py``.) Validation during fit reads the vote in
  flight and takes the sync it asks for before validating.
* **Known outcome**: a fixed δ = 0 syncs every step at once in either order (BSP; equal to Lightning's DDP:
  ``tests/test_strategies.py``), the vote still cast every step (it carries the SIGTERM flags); a checkpoint of it,
  taken with a vote in flight, loads and resumes to the uninterrupted run bit for bit.
* **Off the critical path**: with δ = ∞ (every step local, only the votes travel), the order of events on the
  training thread — each step's forward, each vote's launch, each wait on a vote's handle (a recording subclass of
  the strategy) — shows which step's vote is read when. Exact: step k waits for its own vote before step k+1's
  forward. Overlapped: step k's vote is still in flight (not waited on) when step k+1's forward starts and is read
  after step k+1's vote is launched; the last vote is waited for at the end of training. One wait per vote in both.
  Asserted on the order, not on seconds blocked, so a loaded machine cannot fail it.
* **Rules**: overlapped needs parameter aggregation (refused at construction with gradients); the default is
  overlapped with parameters and exact with gradients.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_suite

from lightning_sync import SelSyncStrategy

WORLD = 2
STEPS = 8
#: delta="auto" during its warm-up: the calibrator's threshold is 0 for the whole run, so every vote asks for a sync,
#: but the vote is still needed (it carries every rank's Δ): the order of the votes shows
WARM_UP = {"delta": "auto", "calibration_warmup": STEPS}
RESUME_AT = 4


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

    class Recorded(SelSyncStrategy):
        """Appends to ``events``, in order: ``("launch", k)`` when step k's vote is launched, ``("wait", k)`` when the
        training thread waits on the handle of step k's vote (the only way a vote is read)."""

        def __init__(self, events: list, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.events = events
            self._votes_cast = 0

        def _launch_vote(self):
            vote = super()._launch_vote()
            self._votes_cast += 1
            step, wait = self._votes_cast, vote.handle.wait

            def recorded_wait() -> None:
                self.events.append(("wait", step))
                wait()

            vote.handle.wait = recorded_wait
            self.events.append(("launch", step))
            return vote

    class Order(Callback):
        """Appends ``("forward", k)`` when step k's batch starts and ``("train_end",)`` before the strategy's own
        ``on_train_end`` (Lightning calls the callbacks' first)."""

        def __init__(self, events: list) -> None:
            self.events = events

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.events.append(("forward", trainer.global_step + 1))

        def on_train_end(self, trainer, pl_module):
            self.events.append(("train_end",))

    class Steps(Callback):
        def __init__(self) -> None:
            self.synced: list[bool] = []

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.synced.append(trainer.strategy.step_counter.sync_steps > sum(self.synced))

    res: dict[str, Any] = {}
    out = Path(out_dir)
    # validation after every step (one batch): the overlapped vote in flight is read there and its sync taken before
    # validation, so every step syncs (every vote asks, WARM_UP) and validation never averages for evaluation
    steps = Steps()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=SelSyncStrategy(**WARM_UP, vote="overlapped", verify_sync=True),
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

    def fit(strategy, callbacks=(), ckpt_path=None, **kw):
        pl.seed_everything(0)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            max_steps=STEPS,
            callbacks=list(callbacks),
            **quiet_trainer_kwargs(limit_val_batches=0, **kw),
        )
        model = DigitsCNN()
        trainer.fit(model, DigitsDataModule(batch_size=32), ckpt_path=ckpt_path)
        return trainer, model

    for vote in ("exact", "overlapped"):
        # which steps sync: every vote asks for a sync (WARM_UP), read in either order
        steps = Steps()
        trainer, _ = fit(SelSyncStrategy(**WARM_UP, vote=vote, verify_sync=True), [steps])
        res[f"{vote}/synced"] = steps.synced
        res[f"{vote}/vote_ops"] = trainer.strategy.comm_stats.ops["vote"]
        # the order of reads: delta=inf, no step syncs; only the votes travel
        events: list = []
        trainer, _ = fit(Recorded(events, delta=float("inf"), vote=vote), [Order(events)])
        res[f"{vote}/events"] = events
        res[f"{vote}/sync_steps"] = trainer.strategy.step_counter.sync_steps

    # a fixed delta=0 (the outcome known before the vote) at its defaults: every step syncs at once; a checkpoint
    # after step RESUME_AT (the vote of that step in flight) resumes to the uninterrupted run
    from lightning.pytorch.callbacks import ModelCheckpoint

    def params(model):
        return [t.detach().clone() for t in model.state_dict().values()]

    steps = Steps()
    ckpt = ModelCheckpoint(dirpath=out / "delta0", every_n_train_steps=RESUME_AT, save_top_k=-1, filename="{step}")
    trainer, model = fit(SelSyncStrategy(delta=0.0, verify_sync=True), [steps, ckpt], enable_checkpointing=True)
    res["delta0/synced"] = steps.synced
    res["delta0/vote_ops"] = trainer.strategy.comm_stats.ops["vote"]
    res["delta0/voters"] = trainer.strategy.last_voters
    uninterrupted = params(model)
    state = torch.load(out / "delta0" / f"step={RESUME_AT}.ckpt.rank{rank}", weights_only=False)["strategy_state"]
    res["delta0/saved_in_flight"] = state["vote_in_flight"] is not None
    steps = Steps()
    steps.synced = [True] * RESUME_AT  # (the steps before the checkpoint, for the counter's comparison)
    trainer, model = fit(SelSyncStrategy(delta=0.0), [steps], ckpt_path=str(out / "delta0" / f"step={RESUME_AT}.ckpt"))
    res["delta0/resumed_synced"] = steps.synced
    res["delta0/resumed_equal"] = all(torch.equal(a, b) for a, b in zip(params(model), uninterrupted, strict=True))
    (out / f"res_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_suite(_suite, WORLD, tmp_path_factory.mktemp("vote"))


def test_exact_syncs_the_step_that_voted_overlapped_the_next_one(suite):
    for r in suite:
        assert r["exact/synced"] == [True] * STEPS  # every vote asks: BSP's steps
        assert r["overlapped/synced"] == [False] + [True] * (STEPS - 1)  # step 1's vote decides after step 2
        assert r["exact/vote_ops"] == r["overlapped/vote_ops"] == STEPS  # one vote a step, in both


def test_a_fixed_delta_zero_syncs_every_step_at_once_in_the_default_order(suite):
    for r in suite:
        assert r["delta0/synced"] == [True] * STEPS  # the first step too: nothing waits for a vote
        assert r["delta0/vote_ops"] == STEPS  # the vote still carries the SIGTERM flags (and Δ) every step
        assert r["delta0/voters"] == WORLD  # and every rank voted for the sync it had already taken


def test_a_delta_zero_checkpoint_with_a_vote_in_flight_resumes_to_the_uninterrupted_run(suite):
    for r in suite:
        assert r["delta0/saved_in_flight"]  # the default order: the step's vote was still in flight
        assert r["delta0/resumed_synced"] == [True] * STEPS
        assert r["delta0/resumed_equal"]  # parameters and buffers bit for bit


def test_validation_reads_the_vote_in_flight_and_takes_its_sync_first(suite):
    for r in suite:
        assert r["validated/synced"] == [STEPS, 0]  # each step's sync taken at the validation after it
        bytes_eval, bytes_params = r["validated/bytes"]
        assert bytes_eval == 0.0 and bytes_params > 0  # validation right after a sync averages nothing


def test_a_local_step_waits_for_its_vote_only_in_the_exact_order(suite):
    steps = range(1, STEPS + 1)
    # exact: step k waits for its own vote, before step k+1's forward
    exact = [e for k in steps for e in (("forward", k), ("launch", k), ("wait", k))] + [("train_end",)]
    # overlapped: step k's vote is still in flight during step k+1's forward and backward, read after step k+1's vote
    # is launched (step 1 waits for nothing); the last one is waited for at the end of training
    overlapped = [e for k in steps for e in (("forward", k), ("launch", k)) + ((("wait", k - 1),) if k > 1 else ())]
    overlapped += [("train_end",), ("wait", STEPS)]
    for r in suite:
        assert r["exact/sync_steps"] == r["overlapped/sync_steps"] == 0  # every step local
        assert [tuple(e) for e in r["exact/events"]] == exact
        assert [tuple(e) for e in r["overlapped/events"]] == overlapped
