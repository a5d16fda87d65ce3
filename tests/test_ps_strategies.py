"""ASP, SSP and ALADDIN trained with Lightning on 2 CPU processes (gloo), with a x4 straggler where it matters.

One set of torchrun-style processes (``tests/launch.py``) runs several fits; every rank writes what it observed
and the tests below assert on it. Launch by name, YAML, setup rejections and the exception path are at the end.
"""

from __future__ import annotations

import json
import math
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from launch import run_suite

from lightning_sync import ALADDINStrategy, ASPStrategy, SSPStrategy
from lightning_sync.cli import cli_main
from lightning_sync.data import DigitsDataModule
from lightning_sync.launch import quiet_trainer_kwargs
from lightning_sync.models import DigitsCNN

WORLD = 2
CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
TIMEOUT = timedelta(seconds=60)


# ----------------------------------------------------------------------------------------------- worker side
def _suite(rank: int, out_dir: str) -> None:
    import threading

    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint

    from lightning_sync.callbacks import StragglerInjection

    out = Path(out_dir)
    res: dict = {}

    class Count(Callback):
        """Batches this rank trained per epoch, and the size of the shared order."""

        def __init__(self):
            self.batches: dict[int, int] = {}
            self.total = None

        def on_train_batch_end(self, trainer, *args):
            self.batches[trainer.current_epoch] = self.batches.get(trainer.current_epoch, 0) + 1
            self.total = trainer.train_dataloader.batch_sampler.num_batches

    def checksum_agrees(model) -> bool:
        flat = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values() if t.is_floating_point()])
        local = torch.stack([flat.double().sum(), (flat.double() * torch.arange(flat.numel())).sum()])
        gathered = [torch.zeros_like(local) for _ in range(WORLD)]
        dist.all_gather(gathered, local)
        return all(torch.equal(g, gathered[0]) for g in gathered)

    def fit(strategy, callbacks=(), max_epochs=1, ckpt_path=None, **kw):
        pl.seed_everything(0)
        kw.setdefault("limit_val_batches", 0)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            max_epochs=max_epochs,
            callbacks=list(callbacks),
            **quiet_trainer_kwargs(**kw),
        )
        model = DigitsCNN(lr=0.05, momentum=0.9)
        trainer.fit(model, DigitsDataModule(batch_size=32), ckpt_path=ckpt_path)
        return trainer, model

    def ps_threads():
        return [t.name for t in threading.enumerate() if t.name.startswith("ps-")]

    # 1. ASP and ALADDIN with a x4 straggler on rank 1: the other rank trains more batches of the same epoch
    for name, make in (
        ("asp", lambda: ASPStrategy(timeout=TIMEOUT)),
        ("aladdin", lambda: ALADDINStrategy(period=3, timeout=TIMEOUT)),
    ):
        count = Count()
        tr, model = fit(make(), [count, StragglerInjection(ranks=1, slowdown=4.0)])
        res[name] = {
            "batches": count.batches.get(0, 0),
            "total": count.total,
            "agree": checksum_agrees(model),  # fit hands back the global model on every rank
            "threads": ps_threads(),
            "summary": {k: v for k, v in tr.strategy.server_summary.items() if k != "pull_log"},
            "alpha": tr.strategy.alpha_value if name == "aladdin" else None,
        }

    # 2. SSP(s=2) with the straggler: at every pull, nobody more than 2 steps ahead of the slowest
    count = Count()
    tr, _ = fit(SSPStrategy(staleness=2, timeout=TIMEOUT), [count, StragglerInjection(ranks=1, slowdown=4.0)])
    log = tr.strategy.server_summary["pull_log"]
    res["ssp"] = {"batches": count.batches.get(0, 0), "pulls": len(log), "max_lead": max(c - m for _, c, m in log)}

    # 3. checkpoint and resume (ASP, ALADDIN): the main file holds the global model, each part a replica and the
    #    server state; resume restores exactly those
    for name, make in (
        ("asp", lambda: ASPStrategy(timeout=TIMEOUT)),
        ("aladdin", lambda: ALADDINStrategy(period=2, timeout=TIMEOUT)),
    ):
        ckdir = out / f"ckpt_{name}"
        mc = ModelCheckpoint(dirpath=ckdir, save_top_k=-1, filename="{epoch}-{step}")
        tr, model = fit(make(), [mc, StragglerInjection(ranks=1, slowdown=2.0)], enable_checkpointing=True)
        dist.barrier()
        files = sorted(p.name for p in ckdir.iterdir())
        (main,) = [f for f in files if f.endswith(".ckpt")]
        ckpt = torch.load(ckdir / main, weights_only=False)
        part = torch.load(ckdir / f"{main}.rank{rank}", weights_only=False)
        main_is_global = all(  # floating state; integer buffers (BN's batch counts) are each replica's own
            torch.equal(ckpt["state_dict"][k], v) for k, v in model.state_dict().items() if v.is_floating_point()
        )

        class Probe(Callback):
            def __init__(self, part):
                self.part = part

            def on_train_start(self, trainer, pl_module):
                s = trainer.strategy
                part = self.part
                saved = part["strategy_state"]["ps"]
                self.server_restored = s.ps.server.clocks == saved["clocks"] and torch.equal(
                    s.ps.server.params, saved["params"]
                )
                self.replica_restored = all(
                    torch.equal(v, part["state_dict"][k]) for k, v in pl_module.state_dict().items()
                )

        probe = Probe(part)
        fit(make(), [probe], max_epochs=2, ckpt_path=str(ckdir / main))
        res[f"resume_{name}"] = {
            "files": files,
            "main_is_global": main_is_global,
            "server_restored": probe.server_restored,
            "replica_restored": probe.replica_restored,
        }

    # 4. EarlyStopping on validation works with each asynchronous strategy (it meets at epoch ends)
    for name, make in (("asp", ASPStrategy), ("ssp", SSPStrategy), ("aladdin", ALADDINStrategy)):
        es = EarlyStopping(monitor="val/acc", mode="max", patience=0, min_delta=1.0)
        tr, _ = fit(make(timeout=TIMEOUT), [es], max_epochs=4, limit_val_batches=3)
        res[f"early_{name}"] = {"epoch": tr.current_epoch, "stopped": tr.should_stop}

    # 5. DDP's learning rate out of the box: every push is the worker's own step scaled by 1/m ("auto"), by the
    #    given number, and ramped linearly over warmup_steps (issue 17)
    class RecordPushes(ASPStrategy):
        def _exchange(self, delta, epoch):
            local = self.flat.state_tensors()[0] - self._prev  # this step's own update, before the scale
            self.rows.append(float((delta - local * self.expected(len(self.rows))).abs().max()))
            self.norms.append(float(local.abs().max()))
            return super()._exchange(delta, epoch)

    for name, kwargs, expected in (
        ("auto", {}, lambda k: 1 / WORLD),
        ("literal", {"update_scale": 1.0}, lambda k: 1.0),
        ("warmup", {"warmup_steps": 4}, lambda k: (min(k + 1, 4) / 4) / WORLD),
    ):
        strategy = RecordPushes(timeout=TIMEOUT, **kwargs)
        strategy.rows, strategy.norms, strategy.expected = [], [], expected
        fit(strategy, limit_train_batches=8)
        res[f"scale_{name}"] = {"errors": strategy.rows, "norms": strategy.norms}

    # 6. the workers' momentum: "auto" steps with the rule's value, the user's is back after every step (issue 17)
    class RecordMomentum(ASPStrategy):
        def _exchange(self, delta, epoch):  # inside the optimizer step, after the update
            self.during.append(self.lightning_module.trainer.optimizers[0].param_groups[0]["momentum"])
            return super()._exchange(delta, epoch)

    for name, kwargs in (("auto", {}), ("none", {"worker_momentum": None}), ("given", {"worker_momentum": 0.3})):
        strategy = RecordMomentum(timeout=TIMEOUT, **kwargs)
        strategy.during = []
        tr, _ = fit(strategy, limit_train_batches=4)
        res[f"momentum_{name}"] = {
            "during": strategy.during,
            "after": tr.optimizers[0].param_groups[0]["momentum"],
            "metric": strategy.sync_metrics().get("worker_momentum"),
        }

    # 7. a per-step LR schedule under a x4 straggler follows the batches all ranks consumed (lr_pace="global", the
    #    default), not the fast rank's own step count ("local")
    class Scheduled(DigitsCNN):
        def configure_optimizers(self):
            opt = super().configure_optimizers()
            return {
                "optimizer": opt,
                "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k)),
                    "interval": "step",
                },
            }

    class Pace(Callback):
        def __init__(self):
            self.rows: list[tuple[int | None, int, int]] = []  # (target, schedule's steps before, after) per batch

        def on_train_batch_start(self, trainer, *args):
            self.before = trainer.lr_scheduler_configs[0].scheduler.last_epoch

        def on_train_batch_end(self, trainer, *args):
            steps = trainer.lr_scheduler_configs[0].scheduler.last_epoch
            self.rows.append((trainer.strategy._pace_target, self.before, steps))

    for pace in ("global", "local"):
        pl.seed_everything(0)
        pace_cb, count = Pace(), Count()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=ASPStrategy(timeout=TIMEOUT, lr_pace=pace),
            max_epochs=1,
            callbacks=[pace_cb, count, StragglerInjection(ranks=1, slowdown=4.0)],
            **quiet_trainer_kwargs(limit_val_batches=0),
        )
        trainer.fit(Scheduled(lr=0.05, momentum=0.9), DigitsDataModule(batch_size=32))
        sched = trainer.lr_scheduler_configs[0].scheduler
        res[f"pace_{pace}"] = {
            "rows": pace_cb.rows,
            "batches": count.batches.get(0, 0),
            "total": count.total,
            "steps": sched.last_epoch,
            "lr": sched.get_last_lr()[0],
            "wrapped": type(sched).__name__,
            "saved_keys": sorted(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
        }

    res["done_at"] = time.time()
    (out / f"res_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps_strategies")
    res = run_suite(_suite, WORLD, out)
    return res, time.time()


def test_workers_step_with_the_derived_momentum_and_the_users_is_restored(suite):
    res, _ = suite
    for r in res:
        # DigitsCNN's momentum 0.9, 2 ranks pushing: 1 - 0.1 * 3/2 = 0.85 during every step
        assert r["momentum_auto"]["during"] == [pytest.approx(0.85)] * len(r["momentum_auto"]["during"])
        assert len(r["momentum_auto"]["during"]) >= 1
        assert r["momentum_none"]["during"] and set(r["momentum_none"]["during"]) == {0.9}
        assert r["momentum_given"]["during"] and set(r["momentum_given"]["during"]) == {0.3}
        assert r["momentum_auto"]["metric"] == pytest.approx(0.85) and r["momentum_none"]["metric"] is None
        for name in ("auto", "none", "given"):
            assert r[f"momentum_{name}"]["after"] == 0.9  # schedulers and checkpoints see the user's value


def test_straggler_does_not_gate_asp_or_aladdin(suite):
    res, _ = suite
    for name in ("asp", "aladdin"):
        fast, slow = res[0][name]["batches"], res[1][name]["batches"]
        assert fast + slow == res[0][name]["total"]  # dynamic assignment: the epoch is the data, consumed once
        assert fast > 2 * slow, (name, fast, slow)  # x4 straggler: the other rank does most of the epoch


def test_a_per_step_lr_schedule_follows_the_data_all_ranks_consumed_not_the_fast_ranks_steps(suite):
    res, _ = suite
    total = res[0]["pace_global"]["total"]
    share = math.ceil(total / WORLD)  # DDP's schedule after the epoch
    fast, slow = res[0]["pace_global"], res[1]["pace_global"]
    assert fast["batches"] + slow["batches"] == total and fast["batches"] > 2 * slow["batches"]
    for r in (fast, slow):
        assert r["wrapped"] == "GlobalPaceScheduler" and r["saved_keys"] == sorted(
            torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), lambda k: 1.0).state_dict()
        )  # a checkpoint holds the user's scheduler state, nothing of the wrapper
        for target, before, after in r["rows"]:
            assert target is not None and after == max(before, target)  # to the data's step: none ahead, more behind
        assert r["steps"] <= share and r["lr"] == pytest.approx(0.05 / (1 + r["steps"]))
    # whichever rank trained the epoch's last batch ends where DDP's schedule ends; the fast rank's own count is far on
    assert max(fast["steps"], slow["steps"]) == share and fast["batches"] > share
    assert any(after - before > 1 for _, before, after in slow["rows"])  # the straggler caught up in bigger steps
    local_fast, local_slow = res[0]["pace_local"], res[1]["pace_local"]
    assert local_fast["wrapped"] == "LambdaLR"  # lr_pace="local": each rank's own count, the scheduler untouched
    assert local_fast["steps"] == local_fast["batches"] > share and local_slow["steps"] == local_slow["batches"]


def test_fit_hands_back_the_global_model_and_stops_every_server_thread(suite):
    res, returned_at = suite
    for name in ("asp", "aladdin"):
        assert all(r[name]["agree"] for r in res)
        assert all(r[name]["threads"] == [] for r in res)
    # processes exit promptly after their last fit: interpreter teardown and the join take seconds on a loaded
    # machine, while a rank held at exit by a peer wait runs into the strategies' 60 s TIMEOUT
    assert returned_at - max(r["done_at"] for r in res) < 30


def test_asp_every_push_answered(suite):
    res, _ = suite
    pushes = [r["asp"]["summary"]["pushes"] for r in res]
    for r in res:
        assert r["asp"]["summary"]["replies"] == pushes  # each server answered each worker's every push
        assert r["asp"]["summary"]["clocks"] == pushes


def test_ssp_never_lets_a_worker_run_more_than_s_ahead(suite):
    res, _ = suite
    for r in res:
        assert r["ssp"]["pulls"] > 0 and r["ssp"]["max_lead"] <= 2


def test_aladdin_global_parameters_every_period_pushes_with_default_alpha(suite):
    res, _ = suite
    for r in res:
        s = r["aladdin"]["summary"]
        assert set(s["params_received"].values()) == {s["pushes"] // 3}  # from each server, every 3rd push
        assert r["aladdin"]["alpha"] == pytest.approx(1 - 1 / math.sqrt(WORLD * 3))


def test_checkpoint_holds_global_model_and_resume_restores_server_and_replicas(suite):
    res, _ = suite
    for name in ("asp", "aladdin"):
        for r in res:
            rr = r[f"resume_{name}"]
            main = [f for f in rr["files"] if f.endswith(".ckpt")]
            assert rr["files"] == sorted(main + [f"{main[0]}.rank{k}" for k in range(WORLD)])
            assert rr["main_is_global"] and rr["server_restored"] and rr["replica_restored"]


def test_early_stopping_works_with_every_asynchronous_strategy(suite):
    res, _ = suite
    for name in ("asp", "ssp", "aladdin"):
        assert all(r[f"early_{name}"]["stopped"] and r[f"early_{name}"]["epoch"] < 4 for r in res)


def test_pushes_are_the_workers_step_scaled_by_one_over_m_by_default(suite):
    res, _ = suite
    for r in res:
        for name in ("auto", "literal", "warmup"):
            rows = r[f"scale_{name}"]
            assert len(rows["errors"]) >= 4 and max(rows["norms"]) > 0  # real updates were pushed
            assert max(rows["errors"]) == 0.0, name  # exactly the local step times the documented factor


# ----------------------------------------------------------------------------------------------- launching
@pytest.mark.parametrize("name,cls", [("asp", ASPStrategy), ("ssp", SSPStrategy), ("aladdin", ALADDINStrategy)])
def test_registered_by_name_and_yaml_parses(name, cls):
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, **quiet_trainer_kwargs())
    assert type(trainer.strategy) is cls
    cli = cli_main(["--config", str(CONFIGS / f"{name}.yaml")], run=False)
    assert type(cli.trainer.strategy) is cls


def test_aladdin_trains_from_yaml_with_lightning_spawn(tmp_path):
    cli = cli_main(
        [
            "fit",
            "--config",
            str(CONFIGS / "aladdin.yaml"),
            "--trainer.strategy.init_args.start_method=spawn",  # popen would re-run pytest
            "--trainer.max_epochs=1",
            "--trainer.limit_val_batches=2",
            "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--test_after_fit=false",
        ]
    )
    m = cli.trainer.callback_metrics
    assert m["sync/ps_pushes"] > 0 and m["sync/bytes_push"] > 0 and "val/acc" in m


class _FailsOnRank1(DigitsCNN):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 3:
            raise RuntimeError("boom on rank 1")
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(300)
def test_exception_on_one_rank_ends_all_ranks_with_that_error():
    # a long strategy timeout, so that a rank left waiting for the failed one (>= 600 s) cannot pass for the prompt
    # end: spawning 2 workers that import Lightning takes 10-30 s on a loaded 2-core machine
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ASPStrategy(timeout=timedelta(seconds=600), start_method="spawn"),
        max_epochs=1,
        limit_val_batches=0,
        **quiet_trainer_kwargs(),
    )
    start = time.monotonic()
    with pytest.raises(Exception, match="boom on rank 1"):
        trainer.fit(_FailsOnRank1(), DigitsDataModule(batch_size=32))
    assert time.monotonic() - start < 150


# ----------------------------------------------------------------------------------------------- rejected at setup
def _fit_local(strategy, model=None, callbacks=(), **kw):
    kw.setdefault("limit_val_batches", 0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=1,
        callbacks=list(callbacks),
        **quiet_trainer_kwargs(**kw),
    )
    trainer.fit(model or DigitsCNN(), DigitsDataModule())
    return trainer


@pytest.mark.parametrize(
    "kw,match",
    [
        (
            {"callbacks": [pl.callbacks.ModelCheckpoint(every_n_train_steps=5)], "enable_checkpointing": True},
            "every_n_",
        ),
        ({"val_check_interval": 10, "limit_val_batches": 2}, "val_check_interval"),
        ({"max_time": "00:00:01:00"}, "max_time"),
        ({"limit_train_batches": 0.5}, "limit_train_batches"),
    ],
)
def test_step_based_lightning_features_are_rejected_at_setup(single_process, kw, match):
    with pytest.raises(ValueError, match=match):
        _fit_local(ASPStrategy(), **kw)


class _LogsSyncDistOnStep(DigitsCNN):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/synced", loss, sync_dist=True, on_step=True)
        return loss


def test_per_step_sync_dist_logging_logs_the_rank_value_and_warns_once(single_process):
    with pytest.warns(UserWarning, match=r"self.log\('train/synced', \.\.\., sync_dist=True\) inside a training batch"):
        trainer = _fit_local(ALADDINStrategy(), model=_LogsSyncDistOnStep())
    assert trainer.strategy._warned_local_logs == {"train/synced"}  # once per metric, not once per step
    assert trainer.global_step > 1
    assert trainer.callback_metrics["train/synced"] == trainer.callback_metrics["train/loss"]  # the rank's own value


class _CollectivesInStep(DigitsCNN):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.what == "reduce":
            self.trainer.strategy.reduce(loss.detach())
        else:
            self.trainer.strategy.barrier()
        return loss


@pytest.mark.parametrize("what,match", [("reduce", "A collective reduce"), ("barrier", "A barrier")])
def test_other_per_step_collectives_raise_a_clear_error(single_process, what, match):
    with pytest.raises(RuntimeError, match=f"{match} inside a training batch"):
        _fit_local(ALADDINStrategy(), model=_CollectivesInStep(what))


class _Adam(DigitsCNN):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_a_given_worker_momentum_needs_an_optimizer_with_momentum(single_process):
    with pytest.raises(ValueError, match=r"worker_momentum=0.5 needs an optimizer with a 'momentum' entry.*Adam"):
        _fit_local(ASPStrategy(worker_momentum=0.5), model=_Adam(), limit_train_batches=2)
    trainer = _fit_local(ASPStrategy(), model=_Adam(), limit_train_batches=2)  # "auto": Adam is left as it is
    assert trainer.optimizers[0].param_groups[0]["betas"] == (0.9, 0.999)
    assert "worker_momentum" not in trainer.strategy.sync_metrics()


def test_seldp_is_rejected(single_process):
    from lightning_sync.callbacks import SelDP

    with pytest.raises(ValueError, match="SelDP"):
        _fit_local(SSPStrategy(), callbacks=[SelDP()])


def test_for_the_step_sets_groups_that_have_the_key_and_restores_them_even_on_error():
    from lightning_sync.strategies.param_groups import for_the_step

    w = torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([{"params": [w], "momentum": 0.9}, {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=0.1)
    with pytest.raises(RuntimeError, match="boom"):
        with for_the_step(sgd, "momentum", lambda mu: mu / 2) as own:
            assert own == [0.9, 0.0]
            assert [g["momentum"] for g in sgd.param_groups] == [0.45, 0.0]
            raise RuntimeError("boom")
    assert [g["momentum"] for g in sgd.param_groups] == [0.9, 0.0]
    adam = torch.optim.Adam([w])
    with for_the_step(adam, "momentum", lambda mu: 0.0) as own:
        assert own == [] and "momentum" not in adam.param_groups[0]
