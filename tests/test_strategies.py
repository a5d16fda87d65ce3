"""BSP and SelSync trained with Lightning on 2 CPU processes (gloo).

The processes are started once for the whole module, torchrun-style (``tests/launch.py``), and each runs
several ``Trainer.fit`` calls; every rank writes what it observed and the tests below assert on it. The real
Lightning spawn launcher (``Trainer(strategy="selsync")`` by name) and the CLI are covered in test_launch.py.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from launch import run_suite
from tolerance import assert_equal_in_exact_arithmetic

K = 12  # steps for the equivalence runs
DELTA_MIXED = 0.05  # with the paper's smoothing (N/100, window 25) the digits CNN syncs some steps, not all
WORLD = 2


# ----------------------------------------------------------------------------------------------- worker side
def _trainer(strategy, max_steps, callbacks=(), **kw):
    import lightning.pytorch as pl

    from lightning_sync.launch import quiet_trainer_kwargs

    kw.setdefault("limit_val_batches", 0)
    return pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=list(callbacks),
        **quiet_trainer_kwargs(**kw),
    )


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _suite(rank: int, out_dir: str) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_sync import (
        ADPSGDStrategy,
        BSPStrategy,
        FedAvgStrategy,
        LocalSGDStrategy,
        SelSyncStrategy,
        SyncSwitchStrategy,
    )
    from lightning_sync.callbacks import SelDP, SyncStats
    from lightning_sync.data import DigitsDataModule, SelDPSampler
    from lightning_sync.models import DigitsCNN, WideMLP

    out = Path(out_dir)
    res: dict = {}

    class ChecksumProbe(Callback):
        """After every step, all-gather (plain torch.distributed, not the strategy's code) a checksum of the
        exact bits of parameters and buffers; record whether ranks agree, and whether the step synced."""

        def __init__(self):
            self.rows = []
            self._last_sync = 0

        def on_train_batch_end(self, trainer, pl_module, *args):
            tensors = [t.detach().reshape(-1) for t in pl_module.state_dict().values() if t.is_floating_point()]
            bits = torch.cat(tensors).view(torch.int32).to(torch.int64)
            local = torch.stack([bits.sum(), (bits * torch.arange(1, bits.numel() + 1)).sum()])
            gathered = [torch.zeros_like(local) for _ in range(WORLD)]
            dist.all_gather(gathered, local)
            synced = trainer.strategy.step_counter.sync_steps > self._last_sync
            self._last_sync = trainer.strategy.step_counter.sync_steps
            self.rows.append([bool(synced), all(torch.equal(g, gathered[0]) for g in gathered)])

    def fit(name, strategy, max_steps=K, callbacks=(), dm=None, model=DigitsCNN, ckpt_path=None, **kw):
        pl.seed_everything(0)
        model = model(lr=0.05, momentum=0.9, weight_decay=1e-4)
        trainer = _trainer(strategy, max_steps, callbacks, **kw)
        trainer.fit(model, dm or DigitsDataModule(batch_size=32), ckpt_path=ckpt_path)
        torch.save(_params(model), out / f"{name}_rank{rank}.pt")
        return trainer, model

    # 1. equivalence with Lightning's ddp: our BSP, SelSync delta=0 (parameter aggregation with either vote order,
    #    gradient aggregation), with and without gradient accumulation (the hooks act once per optimizer step on the
    #    accumulated gradient). Each special case on its default path: only the argument that defines it (delta=0).
    #    Equal in exact arithmetic, not in float32 rounding, so checked in float64 against a bound
    #    (tests/tolerance.py).
    f64 = {"precision": "64-true"}
    tr, _ = fit("ddp", DDPStrategy(), **f64)
    steps_per_epoch = tr.num_training_batches
    fit("bsp64", BSPStrategy(verify_sync=True), **f64)
    tr, _ = fit("sel0", SelSyncStrategy(delta=0.0), **f64)
    res["sel0_f64"] = tr.strategy.sync_metrics()
    res["sel0_vote"] = tr.strategy.vote
    fit("sel0_exact", SelSyncStrategy(delta=0.0, vote="exact"), **f64)
    fit("sel0ga", SelSyncStrategy(delta=0.0, aggregation="gradients"), **f64)
    fit("ddp_acc", DDPStrategy(), accumulate_grad_batches=2, **f64)
    fit("bsp_acc", BSPStrategy(), accumulate_grad_batches=2, **f64)
    tr, _ = fit("sel0_acc", SelSyncStrategy(delta=0.0), accumulate_grad_batches=2, **f64)
    res["sel0_acc"] = tr.strategy.sync_metrics()
    # the other documented special cases that are DDP's update, each on its default path (only the argument that
    # defines the case): averaging after every step (SGD with momentum and weight decay: linear in the gradient)
    fit("localsgd1", LocalSGDStrategy(period=1), **f64)
    fit("fedavg1", FedAvgStrategy(syncs_per_epoch=steps_per_epoch), **f64)  # C = 1 (default), a sync every step
    # the period pinned at 1 ([1, max_period]); no warm-up, so the adaptive schedule (not its warm-up) is what runs
    tr, _ = fit("adpsgd1", ADPSGDStrategy(p_init=1, max_period=1, warmup_epochs=0), **f64)
    res["adpsgd1"] = [tr.strategy.controller.period, tr.strategy.step_counter.sync_steps]
    # Sync-Switch's BSP phase (its default schedule: BSP for the first 25% of the workload, beyond these K steps).
    # Its dynamic loader splits each step's global batch among the ranks differently from DistributedSampler (the
    # same samples), so a model without BatchNorm, whose gradient does not depend on that split
    mlp = {"precision": "64-true", "model": functools.partial(WideMLP, hidden=32, depth=1)}
    fit("ddp_mlp", DDPStrategy(), **mlp)
    tr, _ = fit("sync_switch_bsp", SyncSwitchStrategy(), max_epochs=4, **mlp)
    res["sync_switch_bsp"] = [tr.strategy.protocol, len(tr.strategy.switches), tr.strategy.comm_stats.ops["grads"]]
    # float32: what is bit-exact (replicas identical after every sync) and the accounting. Its SyncStats is the
    # strategy's default one and the Trainer has no logger (logger=False): Lightning's "no logger configured" warning
    # must not come (SyncStats logs to the loggers only when there is one), the values still reach callback_metrics
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr, _ = fit("bsp", BSPStrategy(verify_sync=True))
    res["bsp"] = tr.strategy.sync_metrics()
    res["bsp_no_logger_warnings"] = [str(w.message) for w in caught if "no logger configured" in str(w.message)]
    res["bsp_callback_metrics"] = sorted(k for k in tr.callback_metrics if k.startswith("sync/"))
    tr, _ = fit("sel0_f32", SelSyncStrategy(delta=0.0, verify_sync=True))
    res["sel0"] = tr.strategy.sync_metrics()

    # 2. a delta above every Delta: purely local, only votes travel
    probe = ChecksumProbe()
    # (no average at the end either: the replicas it hands back are the ranks' own)
    tr, _ = fit("large", SelSyncStrategy(delta=1e9, average_at_end=False), callbacks=[probe, SyncStats()])
    res["large"] = tr.strategy.sync_metrics()
    if rank == 0:  # loggers and callback_metrics are rank 0's
        res["large_logged_lssr"] = float(tr.callback_metrics["sync/lssr"])
    res["large_probe"] = probe.rows

    # 3. a mix of local and sync steps: bit-identical replicas after every sync (independent probe)
    for agg in ("parameters", "gradients"):
        probe = ChecksumProbe()
        tr, _ = fit(
            f"mixed_{agg}",
            SelSyncStrategy(delta=DELTA_MIXED, aggregation=agg, verify_sync=True),
            max_steps=40,
            callbacks=[probe],
        )
        res[f"mixed_{agg}"] = tr.strategy.sync_metrics()
        res[f"mixed_{agg}_probe"] = probe.rows

    # 4. top-k pruning removes every rank's part along with the checkpoint file
    mc3 = ModelCheckpoint(dirpath=out / "ckpt3", every_n_train_steps=4, save_top_k=1, filename="{step}")
    tr, _ = fit("pruned", SelSyncStrategy(delta=DELTA_MIXED), max_steps=12, callbacks=[mc3], enable_checkpointing=True)
    res["steps_per_epoch"] = tr.num_training_batches  # (mid-epoch resume of every strategy: tests/test_resume.py)
    dist.barrier()
    res["pruned_files"] = sorted(p.name for p in (out / "ckpt3").iterdir())

    # 5. SelDP through the callback: the training sampler is swapped, an epoch is N times longer, val untouched
    dm = DigitsDataModule(batch_size=32)
    tr, _ = fit(
        "seldp",
        SelSyncStrategy(delta=DELTA_MIXED),
        max_steps=3,
        callbacks=[SelDP()],
        dm=dm,
        limit_val_batches=2,
        val_check_interval=2,
    )
    res["seldp_sampler"] = type(tr.train_dataloader.sampler).__name__
    res["seldp_val_sampler"] = type(tr.val_dataloaders.sampler).__name__
    res["seldp_steps_per_epoch"] = tr.num_training_batches
    res["seldp_expected"] = math.ceil(len(SelDPSampler(dm.train_dataset, num_replicas=WORLD, rank=rank)) / 32)

    # 6. SIGTERM on rank 1 only (before the step's collective): every rank stops at the same step
    class SigtermAt(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if rank == 1 and trainer.global_step == 3:
                trainer._signal_connector.received_sigterm = True

    short = {"timeout": timedelta(seconds=60)}  # a mismatched collective fails fast instead of hanging
    for name, make in (
        ("bsp", lambda: BSPStrategy(**short)),
        ("selsync", lambda: SelSyncStrategy(DELTA_MIXED, **short)),
        ("selsync_exact", lambda: SelSyncStrategy(DELTA_MIXED, vote="exact", **short)),
    ):
        strategy = make()
        try:
            fit(f"sigterm_{name}", strategy, max_steps=10, callbacks=[SigtermAt()])
            res[f"sigterm_{name}"] = None
        except SystemExit as exc:  # Lightning's SIGTERMException
            res[f"sigterm_{name}"] = [type(exc).__name__, strategy.step_counter.steps]
        dist.barrier()

    (out / f"res_rank{rank}.json").write_text(json.dumps(res))


# ----------------------------------------------------------------------------------------------- parent side
@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("strategies")
    res = run_suite(_suite, WORLD, out)

    def params(name, rank=0):
        return torch.load(out / f"{name}_rank{rank}.pt")

    return res, params


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_bsp_matches_lightning_ddp(suite):
    res, params = suite
    assert_equal_in_exact_arithmetic(params("bsp64"), params("ddp"), K, "BSP vs Lightning's DDP")
    assert res[0]["bsp"]["lssr"] == 0.0 and res[0]["bsp"]["sync_steps"] == K


def test_selsync_delta_zero_at_its_defaults_is_lightning_ddp(suite):
    """δ = 0 is BSP (Alg. 1: every Δ >= 0): on the default path (vote="overlapped") and in Alg. 1's order, with
    parameter aggregation (averaging after the update: equal in exact arithmetic for SGD with momentum and weight
    decay) and with gradient aggregation; every step synced, the first included."""
    res, params = suite
    assert res[0]["sel0_vote"] == "overlapped"  # the default order, and delta=0 is the only argument
    for rank in range(WORLD):
        ddp = params("ddp", rank)
        assert_equal_in_exact_arithmetic(params("sel0", rank), ddp, K, "SelSync(delta=0) at its defaults vs DDP")
        assert_equal_in_exact_arithmetic(params("sel0_exact", rank), ddp, K, "SelSync(delta=0, vote='exact') vs DDP")
        assert_equal_in_exact_arithmetic(params("sel0ga", rank), ddp, K, "SelSync(delta=0, gradients) vs DDP")
    for r in res:
        for name in ("sel0", "sel0_f64"):
            assert r[name]["sync_steps"] == K and r[name]["local_steps"] == 0 and r[name]["lssr"] == 0.0


@pytest.mark.parametrize(
    "name,what",
    [
        ("localsgd1", "local SGD, period 1"),
        ("fedavg1", "FedAvg, C = 1, a sync every step"),
        ("adpsgd1", "ADPSGD, period 1"),
        ("sync_switch_bsp", "Sync-Switch's BSP phase"),
    ],
)
def test_documented_special_cases_at_their_defaults_are_lightning_ddp(suite, name, what):
    res, params = suite
    reference = "ddp_mlp" if name == "sync_switch_bsp" else "ddp"
    for rank in range(WORLD):
        assert_equal_in_exact_arithmetic(params(name, rank), params(reference, rank), K, f"{what} vs DDP")
    if name == "adpsgd1":
        assert all(r["adpsgd1"] == [1, K] for r in res)  # period 1, a sync after every step
    if name == "sync_switch_bsp":
        assert all(r["sync_switch_bsp"] == ["bsp", 0, K] for r in res)  # K BSP steps, no switch


def test_gradient_accumulation_matches_lightning_ddp(suite):
    res, params = suite
    assert_equal_in_exact_arithmetic(params("bsp_acc"), params("ddp_acc"), K, "BSP vs DDP, accumulation 2")
    # parameter averaging after the update vs gradient averaging before it
    assert_equal_in_exact_arithmetic(params("sel0_acc"), params("ddp_acc"), K, "SelSync delta=0 vs DDP, accumulation")
    assert _max_diff(params("bsp_acc"), params("bsp64")) > 1e-4  # accumulation really changed the trajectory
    assert res[0]["sel0_acc"]["sync_steps"] == K  # K optimizer steps over 2K micro-batches


def test_replicas_identical_after_sync_in_bsp(suite):
    _, params = suite
    for name in ("bsp", "sel0_f32", "bsp64", "sel0"):
        assert _max_diff(params(name, 0), params(name, 1)) == 0.0


def test_default_sync_stats_without_a_logger_does_not_warn(suite):
    res, _ = suite
    for r in res:
        assert r["bsp_no_logger_warnings"] == []  # (Lightning warns on rank 0: one warning per value logged, before)
    assert {"sync/lssr", "sync/sync_steps", "sync/bytes_sent"} <= set(res[0]["bsp_callback_metrics"])


def test_large_delta_is_local_only(suite):
    res, params = suite
    for r in res:
        m = r["large"]
        assert m["sync_steps"] == 0 and m["local_steps"] == K
        assert m["lssr"] == 1.0  # 1 minus first-step syncs: the first step's Delta is 0, so none
        assert m.get("bytes_params", 0.0) == 0.0 and m.get("bytes_grads", 0.0) == 0.0
        assert m["bytes_vote"] == 8 * K  # one [vote, SIGTERM] float32 all-reduce per step; 2 ranks: sent once
        assert not any(equal for _, equal in r["large_probe"])  # replicas drift apart from the first step
    assert res[0]["large_logged_lssr"] == 1.0  # what SyncStats logged through Lightning
    assert _max_diff(params("large", 0), params("large", 1)) > 1e-4


@pytest.mark.parametrize("agg", ["parameters", "gradients"])
def test_mixed_run_syncs_some_steps_and_replicas_agree_after_each_sync(suite, agg):
    res, _ = suite
    m = res[0][f"mixed_{agg}"]
    assert 0 < m["sync_steps"] < 40 and 0 < m["local_steps"] < 40
    assert m["lssr"] == pytest.approx(m["local_steps"] / (m["local_steps"] + m["sync_steps"]))
    rows = res[0][f"mixed_{agg}_probe"]
    assert sum(s for s, _ in rows) == m["sync_steps"]
    if agg == "parameters":
        # after every parameter sync all ranks hold bit-identical parameters and buffers
        assert all(equal for synced, equal in rows if synced)
        assert not all(equal for synced, equal in rows if not synced)
    # each sync moved exactly one flat buffer: bytes equal the analytic count for 2 ranks (the buffer, once)
    from lightning_sync.models import DigitsCNN

    model = DigitsCNN()
    numel = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for b in model.buffers() if b.is_floating_point()
    )
    key = "bytes_params" if agg == "parameters" else "bytes_grads"
    assert m[key] == m["sync_steps"] * 4 * numel
    for k in ("sync_steps", "local_steps", key, "bytes_vote"):  # decisions are global: every rank agrees
        assert res[0][f"mixed_{agg}"][k] == res[1][f"mixed_{agg}"][k]


def test_checkpoint_pruning_removes_rank_parts(suite):
    res, _ = suite
    assert res[0]["pruned_files"] == ["step=12.ckpt", "step=12.ckpt.rank0", "step=12.ckpt.rank1"]


def test_seldp_callback_swaps_training_sampler_only(suite):
    res, _ = suite
    for r in res:
        assert r["seldp_sampler"] == "SelDPSampler"
        assert r["seldp_val_sampler"] == "DistributedSampler"
        assert r["seldp_steps_per_epoch"] == r["seldp_expected"]
        assert r["seldp_steps_per_epoch"] >= WORLD * (r["steps_per_epoch"] - 1)


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step(suite):
    res, _ = suite
    # rank 1 receives it at the start of step 4: BSP and SelSync in Alg. 1's order stop after that step's update;
    # SelSync's default (vote="overlapped") reads that step's vote, which carries the flag, one step later
    for name, last in (("bsp", 4), ("selsync_exact", 4), ("selsync", 5)):
        stops = [r[f"sigterm_{name}"] for r in res]
        assert stops[0] is not None and stops[0] == stops[1]
        assert stops[0][0] == "SIGTERMException" and stops[0][1] == last


def test_lightning_per_step_collective_goes_through_the_accounting(suite):
    res, _ = suite
    bsp, large = res[0]["bsp"], res[0]["large"]
    # BSP: a gradient all-reduce plus Lightning's per-step SIGTERM check (counted, tag "lightning") per step;
    # SelSync folds the SIGTERM flag into its vote, so a local step is one collective. Lightning's other
    # collectives (setup barriers...) are the same in both runs.
    assert bsp["collectives"] - large["collectives"] == K
    assert bsp["bytes_lightning"] - large["bytes_lightning"] == 4 * K
