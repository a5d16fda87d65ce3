"""Local SGD (CPSGD), FedAvg and ADPSGD on 4 CPU processes (gloo), started once torchrun-style for the module."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from launch import run_suite

from lightning_sync.core.periodic import ConstantPeriod

WORLD = 4
K = 10


def _suite(rank: int, out_dir: str) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    from lightning_sync import ADPSGDStrategy, FedAvgStrategy, LocalSGDStrategy
    from lightning_sync.callbacks import SyncStats
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    out = Path(out_dir)
    res: dict = {}

    def fit(name, strategy, max_steps=K, callbacks=(), ckpt_path=None, **kw):
        pl.seed_everything(0)
        model = DigitsCNN(lr=0.05, momentum=0.9, weight_decay=1e-4)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            max_steps=max_steps,
            limit_val_batches=0,
            callbacks=list(callbacks),
            **quiet_trainer_kwargs(**kw),
        )
        trainer.fit(model, DigitsDataModule(batch_size=16), ckpt_path=ckpt_path)
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / f"{name}_rank{rank}.pt")
        return trainer

    class Agreement(Callback):
        """All-gather (plain torch.distributed) a value each step; record whether ranks agree."""

        def __init__(self, value):
            self.value = value
            self.rows = []

        def on_train_batch_end(self, trainer, pl_module, *args):
            local = torch.tensor([float(self.value(trainer, pl_module))], dtype=torch.float64)
            gathered = [torch.zeros_like(local) for _ in range(WORLD)]
            dist.all_gather(gathered, local)
            self.rows.append([g.item() for g in gathered])

    def state_bits(trainer, pl_module):
        bits = torch.cat([t.detach().reshape(-1) for t in pl_module.parameters()]).view(torch.int32).to(torch.int64)
        return float((bits * torch.arange(1, bits.numel() + 1)).sum() % 1000000007)

    # 1. local SGD: averaging count from the accounting; replicas identical right after each averaging
    agree = Agreement(state_bits)
    tr = fit("localsgd3", LocalSGDStrategy(period=3), callbacks=[agree])
    st = tr.strategy
    res["localsgd3"] = {
        "param_ops": st.comm_stats.ops["params"],
        "sync_steps": st.step_counter.sync_steps,
        "local_steps": st.step_counter.local_steps,
        "agree": [len(set(r)) == 1 for r in agree.rows],
    }
    tr = fit("localsgd_warm", LocalSGDStrategy(period=4, warmup_steps=3))
    res["localsgd_warm_ops"] = tr.strategy.comm_stats.ops["params"]
    agree = Agreement(state_bits)
    tr = fit("localsgd_offset", LocalSGDStrategy(period=4, offset=3), callbacks=[agree])
    res["localsgd_offset"] = {
        "param_ops": tr.strategy.comm_stats.ops["params"],
        "final_ops": tr.strategy.comm_stats.ops["final"],
        "sync_steps": tr.strategy.step_counter.sync_steps,
        "agree": [len(set(r)) == 1 for r in agree.rows],
    }

    # 2. by registered name (default period 8). (Period 1 is DDP, with FedAvg's and ADPSGD's: tests/test_strategies.py)
    tr = fit("byname", "localsgd")
    res["byname"] = type(tr.strategy).__name__

    # 3. FedAvg C=0.5: after a sync every rank holds the average of exactly the chosen replicas
    class Snapshot(FedAvgStrategy):
        rounds: list = []

        def average_state(self, tag="params", participants=None):
            pre = torch.cat([t.clone() for t in self.flat.state_tensors()])
            super().average_state(tag, participants)
            post = torch.cat([t.clone() for t in self.flat.state_tensors()])
            if tag == "params":  # not the final all-rank average at the end of training
                self.rounds.append({"participants": list(participants), "pre": pre, "post": post})

    fed = Snapshot(fraction=0.5, syncs_per_epoch=4, seed=3)
    tr = fit("fedavg", fed, max_steps=-1, max_epochs=1, callbacks=[SyncStats()])
    torch.save(fed.rounds, out / f"fedavg_rounds_rank{rank}.pt")
    res["fedavg"] = {
        "steps_per_epoch": tr.num_training_batches,
        "syncs": fed.step_counter.sync_steps,
        "final_ops": fed.comm_stats.ops["final"],
    }

    # 4. ADPSGD: the period changes, every rank holds the same period at every step (resume: tests/test_resume.py)
    def adpsgd():
        return ADPSGDStrategy(p_init=2, warmup_epochs=1, sample_fraction=0.3, max_period=16)

    agree = Agreement(lambda trainer, m: trainer.strategy.controller.period)
    tr = fit("adpsgd_full", adpsgd(), max_steps=90, callbacks=[agree, SyncStats()])
    c = tr.strategy.controller
    res["adpsgd"] = {
        "periods": [r[0] for r in agree.rows],
        "agree": all(len(set(r)) == 1 for r in agree.rows),
        "controller": c.state_dict(),
        "phase": c.phase,
        "steps_per_epoch": tr.num_training_batches,
        "stat_ops": tr.strategy.comm_stats.ops["stat"],
        "syncs": tr.strategy.step_counter.sync_steps,
        "logged": sorted(k for k in tr.callback_metrics if k.startswith("sync/")),
    }

    (out / f"res_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("periodic")
    return out, run_suite(_suite, WORLD, out)


def _load(out, name, rank=0):
    return torch.load(out / f"{name}_rank{rank}.pt")


def test_local_sgd_averaging_count_from_accounting(suite):
    _, res = suite
    for r in res:
        m = r["localsgd3"]
        assert m["param_ops"] == math.ceil(K / 3) == m["sync_steps"]  # after steps 0, 3, 6, 9
        assert m["local_steps"] == K - math.ceil(K / 3)
        assert m["agree"] == [step % 3 == 0 for step in range(K)]  # identical exactly after averaging steps
        assert r["localsgd_warm_ops"] == 3 + math.ceil((K - 3) / 4)
        assert r["byname"] == "LocalSGDStrategy"  # Trainer(strategy="localsgd")


def test_local_sgd_offset_averages_after_every_period_of_local_steps(suite):
    """offset=period-1: averaging after steps 3 and 7 of 10 (torchft's LocalSGD schedule), replicas identical
    exactly there; the last steps (8, 9) are local, so average_at_end sends one more all-reduce."""
    _, res = suite
    for r in res:
        m = r["localsgd_offset"]
        assert m["param_ops"] == m["sync_steps"] == 2 == ConstantPeriod.count(K, 4, 0, 3)
        assert m["agree"] == [step % 4 == 3 for step in range(K)]
        assert m["final_ops"] == 1


def test_fedavg_half_the_ranks_average_of_exactly_the_chosen(suite):
    out, res = suite
    rounds = [torch.load(out / f"fedavg_rounds_rank{r}.pt") for r in range(WORLD)]
    assert res[0]["fedavg"]["syncs"] == 4 and len(rounds[0]) == 4
    for i in range(4):
        participants = rounds[0][i]["participants"]
        assert len(participants) == 2 and all(rounds[r][i]["participants"] == participants for r in range(WORLD))
        pres = [rounds[r][i]["pre"] for r in range(WORLD)]
        assert all(not torch.equal(pres[0], p) for p in pres[1:])  # replicas really differed before the sync
        expected = (pres[participants[0]] + pres[participants[1]]) / 2
        for r in range(WORLD):
            assert torch.allclose(rounds[r][i]["post"], expected, atol=1e-6)
            assert torch.equal(rounds[r][i]["post"], rounds[0][i]["post"])


def test_adpsgd_period_adapts_and_ranks_agree(suite):
    _, res = suite
    a = res[0]["adpsgd"]
    assert a["agree"]
    warm = a["steps_per_epoch"]
    assert set(a["periods"][:warm]) == {1}  # warm-up: period 1 for the first epoch
    # K_s: sample_fraction (0.3) of the 90 steps after the warm-up, not of all 90 (issue 57); at least 4 samples
    assert a["controller"]["warmup_steps"] == warm
    assert a["controller"]["sample_steps"] == warm + round(0.3 * (90 - warm))
    assert a["controller"]["min_samples"] == 4 and a["controller"]["samples"] >= 4
    assert len(set(a["periods"][warm:])) > 1  # the period moved after warm-up
    assert a["stat_ops"] > 0 and a["controller"]["c2"] > 0
    assert {"sync/period", "sync/c2", "sync/s_k"} <= set(a["logged"])
    assert all(r["adpsgd"]["controller"] == a["controller"] for r in res)


def test_fedavg_and_local_sgd_hand_back_the_averaged_model(suite):
    out, res = suite
    assert res[0]["fedavg"]["final_ops"] == 0  # its last sync is the epoch's last step: nothing left to average
    for name in ("fedavg", "localsgd3", "adpsgd_full"):
        ranks = [_load(out, name, r) for r in range(WORLD)]
        assert all(torch.equal(ranks[0][k], other[k]) for other in ranks[1:] for k in ranks[0])


@pytest.mark.parametrize(
    "cls,kwargs,name",
    [
        ("LocalSGDStrategy", {"period": 0}, "period"),
        ("LocalSGDStrategy", {"period": 2.5}, "period"),
        ("LocalSGDStrategy", {"warmup_steps": -1}, "warmup_steps"),
        ("FedAvgStrategy", {"fraction": 0.0}, "fraction"),
        ("FedAvgStrategy", {"fraction": 1.5}, "fraction"),
        ("FedAvgStrategy", {"syncs_per_epoch": 0}, "syncs_per_epoch"),
        ("FedAvgStrategy", {"seed": -1}, "seed"),
        ("ADPSGDStrategy", {"p_init": 0}, "p_init"),
        ("ADPSGDStrategy", {"low": 1.3, "high": 0.7}, "low"),
        ("ADPSGDStrategy", {"low": 1.0, "high": 1.0}, "low"),
        ("ADPSGDStrategy", {"max_period": 0}, "max_period"),
        ("ADPSGDStrategy", {"p_init": 8, "max_period": 4}, "p_init"),
        ("ADPSGDStrategy", {"sample_fraction": 1.0}, "sample_fraction"),
        ("ADPSGDStrategy", {"warmup_epochs": -1}, "warmup_epochs"),
        ("ADPSGDStrategy", {"average_at_end": "yes"}, "average_at_end"),
    ],
)
def test_bad_arguments(cls, kwargs, name):
    import lightning_sync

    with pytest.raises(ValueError, match=name):
        getattr(lightning_sync, cls)(**kwargs)


@pytest.mark.parametrize("name", ["localsgd", "fedavg", "adpsgd"])
def test_yaml_configs_parse(name):
    from lightning_sync.cli import cli_main

    configs = Path(__file__).resolve().parent.parent / "examples" / "configs"
    cli = cli_main(["--config", str(configs / f"{name}.yaml")], run=False)
    assert type(cli.trainer.strategy).strategy_name == name
