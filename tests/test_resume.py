"""Resume equivalence for every strategy: one parametrized suite.

Two CPU processes (torchrun-style, ``tests/launch.py``) run, for each strategy, an uninterrupted fit and a fit resumed
from a checkpoint of the same run, then the tests compare them:

* **Deterministic strategies** (BSP, SelSync, local SGD, FedAvg, ADPSGD, OSP, DiLoCo): checkpoint mid-epoch (in the
  second epoch, after every schedule has left its warm-up), resume, and the end is *exact*: bit-identical parameters on
  every rank, identical per-rank method state (counters, EWMA, period, C2, ICS schedule, DiLoCo's global parameters,
  outer momentum and fragment in flight...) and identical communication totals. All run with ``verify_sync=True``, so
  every sync of both runs also checked that the ranks agree.
* **Asynchronous strategies** (ASP, SSP, ALADDIN): ranks only meet at epoch ends, so checkpoints are taken there
  (step-based checkpointing is rejected at setup). What must hold is that the state is restored *exactly* — server
  parameters and clocks, each rank's replica, counters, ALADDIN's mailbox — with nothing in flight when it was
  saved. The trajectory after the resume may differ from the uninterrupted run's: which rank trains which batch is
  decided by the ranks' speed at run time (a shared work counter), so the interleaving of pushes and pulls, and thus
  the floating-point result, is not reproducible even between two uninterrupted runs. Every batch is still trained
  exactly once per epoch, so the steps summed over the ranks are equal.
* **Sync-Switch** (BSP for the first half of the workload, then ASP): a checkpoint in the BSP phase resumes exactly
  (the switch happens at the same step and position, with bit-identical replicas); one in the ASP phase restores the
  state exactly, as the asynchronous strategies.
* **Compressed** (``compression="int8"``, and ``"int2"`` for the packed formats: per-rank error-feedback residuals,
  and the reference of compressed parameter averaging): BSP, local SGD and plain DiLoCo resume exactly like their
  uncompressed runs, ASP restores its state (the push residuals included) exactly.
* **Replica groups** (``replica_size=2`` on 4 processes: 2 replicas x 2 ranks, a second module fixture): every method
  that runs grouped resumes mid-epoch exactly like the deterministic strategies above (each replica's state, the
  outer optimizer's, the schedule's, the fragment or vote in flight), ``verify_sync`` checking both levels at every
  step of both runs.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_suite

WORLD = 2
EPOCHS = 3
BATCH = 64
TIMEOUT = timedelta(seconds=120)
#: DiLoCo's cases step an outer optimizer with state (SlowMo's: outer_optimizer="auto" over SGD is plain averaging)
SLOWMO = {"name": "sgd", "lr": 1.0, "momentum": 0.5}
EXACT = ("bsp", "selsync", "localsgd", "fedavg", "adpsgd", "osp", "diloco")
ASYNC = ("asp", "ssp", "aladdin")
#: compressed cases (int8, int2, topk: residuals and the averaging reference are per-rank state), run like EXACT and
#: ASYNC
COMPRESSED_EXACT = ("bsp_int8", "localsgd_int8", "diloco_int8", "diloco_int2", "localsgd_topk", "diloco_topk_int2")
#: each compressed case's compression where its name does not end with it
COMPRESSION_OF = {"localsgd_topk": "topk:0.05", "diloco_topk_int2": "topk:0.05+int2"}
#: other settings of a strategy that resume exactly: SelSync in Alg. 1's vote order (the default, "overlapped", is
#: "selsync" above: its checkpoint is taken with the previous step's vote in flight, which decides after the resume)
VARIANTS_EXACT = ("selsync_exact",)
COMPRESSED_ASYNC = ("asp_int8",)
#: replica groups, 2 replicas x 2 ranks (4 processes): every strategy that runs grouped, resumed like EXACT
GROUPED_WORLD, GROUPED_SIZE = 4, 2
GROUPED_EXACT = (
    "bsp_grouped",
    "selsync_grouped",
    "localsgd_grouped",
    "fedavg_grouped",
    "adpsgd_grouped",
    "diloco_grouped",
    "localsgd_int8_grouped",
)
#: state entries that are wall-clock measurements, not trajectory (per-tag blocked seconds, measured times)
TIME_KEYS = frozenset(
    {"blocked_seconds", "blocked_s", "blocked_intra_s", "blocked_inter_s", "seconds", "ics_wait_s", "overlap"}
)
#: state lists that hold a measured time beside trajectory values: the indices that are not times
#: (OSP: [compute seconds, steps, loss sum] and [RS bytes, RS seconds] of the epoch so far)
PARTLY_TIMED = {"epoch_stats": slice(1, None), "rs_bytes_seconds": slice(0, 1)}


def _strategy(name: str):
    import lightning_sync.strategies as S

    common = dict(timeout=TIMEOUT)
    sync = dict(common, verify_sync=True)
    grouped = dict(sync, replica_size=GROUPED_SIZE)
    return {
        "bsp": lambda: S.BSPStrategy(**sync),
        "selsync": lambda: S.SelSyncStrategy(delta=0.05, **sync),
        "selsync_exact": lambda: S.SelSyncStrategy(delta=0.05, vote="exact", **sync),
        # offset 2: averages after steps 3, 6, ..., so the mid-epoch checkpoint (step 15) is saved in sync
        "localsgd": lambda: S.LocalSGDStrategy(period=3, offset=2, **sync),
        "fedavg": lambda: S.FedAvgStrategy(fraction=0.5, syncs_per_epoch=3, **sync),
        "adpsgd": lambda: S.ADPSGDStrategy(p_init=2, warmup_epochs=1, **sync),
        "osp": lambda: S.OSPStrategy(bandwidth="100gbit", **sync),  # U_max at its cap: no measured time in the schedule
        # streaming, with a fragment in flight at the checkpoint (launched after step 14, applied after step 16)
        "diloco": lambda: S.DiLoCoStrategy(
            outer_optimizer=SLOWMO, sync_every=6, fragments=2, delay=2, alpha=0.5, **sync
        ),
        "asp": lambda: S.ASPStrategy(**common),
        "ssp": lambda: S.SSPStrategy(staleness=2, **common),
        "aladdin": lambda: S.ALADDINStrategy(period=2, **common),
        "sync_switch": lambda: S.SyncSwitchStrategy(**sync),
        "bsp_int8": lambda: S.BSPStrategy(compression="int8", **sync),
        "localsgd_int8": lambda: S.LocalSGDStrategy(period=3, compression="int8", **sync),
        "asp_int8": lambda: S.ASPStrategy(compression="int8", **common),
        # plain DiLoCo (its default outer optimizer, chosen at setup) with int8: outer state, residuals, reference
        "diloco_int8": lambda: S.DiLoCoStrategy(outer_optimizer=SLOWMO, sync_every=4, compression="int8", **sync),
        # the same with int2 (ternary codes packed four to a byte): the packed format's residuals resume exactly
        "diloco_int2": lambda: S.DiLoCoStrategy(outer_optimizer=SLOWMO, sync_every=4, compression="int2", **sync),
        # sparse (the top 5 % of each chunk, its indices beside): residuals hold what was not sent, and resume
        "localsgd_topk": lambda: S.LocalSGDStrategy(period=3, compression="topk:0.05", **sync),
        # sparse with ternary values, under DiLoCo's outer optimizer: the residuals hold what neither the selection
        # nor the quantisation sent, and resume
        "diloco_topk_int2": lambda: S.DiLoCoStrategy(
            outer_optimizer=SLOWMO, sync_every=4, compression="topk:0.05+int2", **sync
        ),
        # replica groups: the same settings, 2 ranks per replica; checkpoints after 7 steps (5 per epoch)
        "bsp_grouped": lambda: S.BSPStrategy(**grouped),
        "selsync_grouped": lambda: S.SelSyncStrategy(delta=0.05, **grouped),  # the previous step's vote in flight
        "localsgd_grouped": lambda: S.LocalSGDStrategy(period=3, offset=2, **grouped),
        "fedavg_grouped": lambda: S.FedAvgStrategy(fraction=0.5, syncs_per_epoch=3, **grouped),  # one replica of 2
        "adpsgd_grouped": lambda: S.ADPSGDStrategy(p_init=2, warmup_epochs=1, **grouped),
        # streaming: fragment 1 launched after step 5, in flight at the checkpoint, applied after step 7
        "diloco_grouped": lambda: S.DiLoCoStrategy(
            outer_optimizer=SLOWMO, sync_every=6, fragments=2, delay=2, alpha=0.5, **grouped
        ),
        "localsgd_int8_grouped": lambda: S.LocalSGDStrategy(period=3, compression="int8", **grouped),
    }[name]()


def _float_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


# ----------------------------------------------------------------------------------------------- worker side
def _suite(rank: int, out_dir: str) -> None:
    _run(rank, out_dir, WORLD, grouped=False)


def _grouped_suite(rank: int, out_dir: str) -> None:
    _run(rank, out_dir, GROUPED_WORLD, grouped=True)


def _run(rank: int, out_dir: str, world: int, grouped: bool) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from lightning_sync.callbacks import SyncSwitch
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    out = Path(out_dir)
    res: dict[str, Any] = {}

    class AtStart(Callback):
        """What the strategy holds when training (re)starts: restored state, before the first batch is fetched
        (epoch start) or, resuming mid-epoch (no epoch-start hook), before its first step."""

        state: dict | None = None

        def _record(self, trainer, pl_module):
            if self.state is None:
                self.state = trainer.strategy.strategy_state()
                self.model = _float_state(pl_module)

        def on_train_epoch_start(self, trainer, pl_module):
            self._record(trainer, pl_module)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._record(trainer, pl_module)

    class AtEnd(Callback):
        """The strategy's state and totals when training ends (the parameter server is still up)."""

        def on_train_end(self, trainer, pl_module):
            self.state = trainer.strategy.strategy_state()
            self.metrics = trainer.strategy.sync_metrics()

    class AtSwitch(Callback):
        """Sync-Switch: the replica at the first batch after the BSP->ASP switch (identical on every rank)."""

        model: dict | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.model is None and trainer.strategy.protocol == "asp":
                self.model = _float_state(pl_module)

    def fit(name: str, run: str, callbacks: list, ckpt_path: str | None = None) -> pl.Trainer:
        pl.seed_everything(0)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=_strategy(name),
            max_epochs=EPOCHS,
            callbacks=[*callbacks, end := AtEnd()],
            **quiet_trainer_kwargs(limit_val_batches=0, enable_checkpointing=True, default_root_dir=str(out)),
        )
        model = DigitsCNN(lr=0.05, momentum=0.9, weight_decay=1e-4)
        trainer.fit(model, DigitsDataModule(batch_size=BATCH), ckpt_path=ckpt_path)
        torch.save(
            {
                "model": _float_state(model),
                "metrics": end.metrics,
                "state": end.state,
                "global_step": trainer.global_step,
            },
            out / f"{name}_{run}_rank{rank}.pt",
        )
        dist.barrier()
        return trainer

    dm = DigitsDataModule(batch_size=BATCH)
    dm.setup("fit")
    assert dm.train_dataset is not None
    steps_per_epoch = math.ceil(math.ceil(len(dm.train_dataset) / world) / BATCH)  # DistributedSampler pads
    res["steps_per_epoch"] = steps_per_epoch

    # deterministic strategies: a checkpoint at step C, in the middle of the second epoch
    for name in GROUPED_EXACT if grouped else EXACT + COMPRESSED_EXACT + VARIANTS_EXACT:
        ckdir = out / f"ckpt_{name}"
        at = steps_per_epoch + steps_per_epoch // 2
        mc = ModelCheckpoint(dirpath=ckdir, every_n_train_steps=at, save_top_k=-1, filename="{step}")
        fit(name, "full", [mc])
        start = AtStart()
        # the same checkpointing as the uninterrupted run (saving is collective: Lightning's barriers are counted),
        # into a directory and files with names of the same length: each save broadcasts its file name (counted)
        mc = ModelCheckpoint(dirpath=out / f"ckp2_{name}", every_n_train_steps=at, save_top_k=-1, filename="{step}")
        fit(name, "resumed", [start, mc], ckpt_path=str(ckdir / f"step={at}.ckpt"))
        torch.save({"state": start.state, "model": start.model}, out / f"{name}_start_rank{rank}.pt")
        res[f"{name}_ckpt_step"] = at
    if grouped:
        (out / f"res_rank{rank}.json").write_text(json.dumps(res))
        return

    # asynchronous strategies: a checkpoint at the end of the first epoch
    for name in ASYNC + COMPRESSED_ASYNC:
        ckdir = out / f"ckpt_{name}"
        mc = ModelCheckpoint(dirpath=ckdir, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
        fit(name, "full", [mc])
        start = AtStart()
        mc = ModelCheckpoint(dirpath=out / f"ckpt_{name}_resumed", every_n_epochs=1, save_top_k=-1)
        fit(name, "resumed", [start, mc], ckpt_path=str(ckdir / "epoch=0.ckpt"))
        torch.save({"state": start.state, "model": start.model}, out / f"{name}_start_rank{rank}.pt")

    # Sync-Switch: BSP for half of the workload (1.5 epochs), then ASP; checkpoints at every epoch end
    ckdir = out / "ckpt_sync_switch"
    schedule = [("bsp", 0.5), ("asp", 1.0)]
    switch = AtSwitch()
    mc = ModelCheckpoint(dirpath=ckdir, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    fit("sync_switch", "full", [SyncSwitch(schedule=schedule), mc, switch])
    saved = {"full_switch": switch.model}
    for ckpt, run in (("epoch=0.ckpt", "resumed_bsp"), ("epoch=1.ckpt", "resumed_asp")):
        start, switch = AtStart(), AtSwitch()
        mc = ModelCheckpoint(dirpath=out / f"ckpt_sync_switch_{run}", every_n_epochs=1, save_top_k=-1)
        fit("sync_switch", run, [SyncSwitch(schedule=schedule), start, switch, mc], ckpt_path=str(ckdir / ckpt))
        saved[f"{run}_switch"] = switch.model
        torch.save({"state": start.state, "model": start.model}, out / f"sync_switch_{run}_start_rank{rank}.pt")
    torch.save(saved, out / f"sync_switch_models_rank{rank}.pt")
    (out / f"res_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    return out, run_suite(_suite, WORLD, out)


@pytest.fixture(scope="module")
def grouped_suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_grouped")
    return out, run_suite(_grouped_suite, GROUPED_WORLD, out)


# ----------------------------------------------------------------------------------------------- helpers
def _load(path: Path) -> Any:
    return torch.load(path, weights_only=False)


def _strip(value: Any) -> Any:
    """``value`` without wall-clock measurements (keys in TIME_KEYS), tensors as lists, for exact comparison.

    Bookkeeping traffic stays in: a checkpoint part counts every message of its own save (the name broadcast, the
    main file's average or ``verify_sync``'s check, the closing barrier), so a resumed run's totals per tag, the
    ``"checkpoint"`` and ``"verify"`` tags included, are the uninterrupted run's."""
    if isinstance(value, dict):
        return {
            k: _strip(v[PARTLY_TIMED[k]] if k in PARTLY_TIMED else v) for k, v in value.items() if k not in TIME_KEYS
        }
    if isinstance(value, (list, tuple)):
        return [_strip(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value


def _training(metrics: dict[str, float]) -> dict[str, float]:
    """Logged communication totals and counters without times; bookkeeping bytes (``bytes_checkpoint``,
    ``bytes_verify``, ``bytes_setup``) included, as in :func:`_strip`."""
    return {k: v for k, v in metrics.items() if k not in TIME_KEYS}


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _part(out: Path, name: str, ckpt: str, rank: int) -> dict[str, Any]:
    return _load(out / f"ckpt_{name}" / f"{ckpt}.rank{rank}")


# ----------------------------------------------------------------------------------------------- tests
def test_the_suite_covers_every_strategy():
    from lightning_sync.strategies import STRATEGIES

    assert {cls.strategy_name for cls in STRATEGIES} == {*EXACT, *ASYNC, "sync_switch"}
    # and every strategy that runs with replica groups has a grouped case
    grouped = {cls.strategy_name for cls in STRATEGIES if cls.replica_groups_refusal is None}
    assert grouped == {name.removesuffix("_grouped") for name in GROUPED_EXACT if "_int8" not in name}


def _assert_resumed_exactly(out: Path, res: list[dict[str, Any]], name: str, world: int) -> None:
    spe, at = res[0]["steps_per_epoch"], res[0][f"{name}_ckpt_step"]
    assert spe < at < 2 * spe  # mid-epoch, in the second epoch
    for rank in range(world):
        full, resumed = _load(out / f"{name}_full_rank{rank}.pt"), _load(out / f"{name}_resumed_rank{rank}.pt")
        assert full["global_step"] == resumed["global_step"] == EPOCHS * spe
        assert _same_tensors(resumed["model"], full["model"])  # bit-identical parameters and buffers
        assert _training(resumed["metrics"]) == _training(full["metrics"])  # LSSR, steps, bytes per tag, ops
        assert _strip(resumed["state"]) == _strip(full["state"])  # every piece of per-rank method state
        # the resumed run restarted from exactly what the checkpoint part holds
        start, part = _load(out / f"{name}_start_rank{rank}.pt"), _part(out, name, f"step={at}.ckpt", rank)
        assert _strip(start["state"]) == _strip(part["strategy_state"])
    assert full["metrics"]["bytes_sent"] > 0


@pytest.mark.parametrize("name", EXACT + COMPRESSED_EXACT + VARIANTS_EXACT)
def test_deterministic_strategy_resumed_mid_epoch_ends_exactly_where_the_uninterrupted_run_does(suite, name):
    out, res = suite
    _assert_resumed_exactly(out, res, name, WORLD)


@pytest.mark.parametrize("name", GROUPED_EXACT)
def test_grouped_strategy_resumed_mid_epoch_ends_exactly_where_the_uninterrupted_run_does(grouped_suite, name):
    """Replica groups: the same exact resume, on 2 replicas x 2 ranks. The two replicas end different (but each
    replica's ranks identical: ``verify_sync`` checked it after every step), and each rank's part held its own."""
    out, res = grouped_suite
    _assert_resumed_exactly(out, res, name, GROUPED_WORLD)
    at = res[0][f"{name}_ckpt_step"]
    parts = [_part(out, name, f"step={at}.ckpt", rank)["strategy_state"] for rank in range(GROUPED_WORLD)]
    main = _load(out / f"ckpt_{name}" / f"step={at}.ckpt")["lightning_sync"]
    assert main["ranks_per_replica"] == GROUPED_SIZE and main["world_size"] == GROUPED_WORLD
    sent = [p["comm"]["bytes_sent"] for p in parts]
    assert all(s.get("intra/grads", 0) > 0 for s in sent)  # the exact average inside each replica, every step
    models = [_load(out / f"{name}_full_rank{rank}.pt")["model"] for rank in range(GROUPED_WORLD)]
    assert _same_tensors(models[0], models[1]) and _same_tensors(models[2], models[3])
    if name == "diloco_grouped":  # the fragment in flight: launched on the leaders, taken by the others at its step
        assert all(p["diloco"]["pending"] is not None for p in parts)
    if name == "selsync_grouped":  # the previous step's vote, cast alike by every rank of a replica
        assert all(p["vote_in_flight"] is not None for p in parts)


def test_checkpoint_parts_count_their_own_save_whether_the_replicas_are_in_sync_or_not(suite):
    """Both kinds of save occur here by the schedule, not by the numerics (issue 47: which kind the drop-in suite's
    SelSync run hit depended on the machine's floating point): local SGD (period 3, offset 2) saves at step 15 right
    after a sync, so its main file needs no average and ``verify_sync`` checks the replicas instead (one checksum
    gather, ``"verify"``); FedAvg saves between syncs, so its main file is the replicas' average, an all-reduce of
    the model under ``"checkpoint"``. Either way the part already counts it, so the exact-resume test above compares
    those tags too."""
    out, res = suite
    at = res[0]["localsgd_ckpt_step"]
    assert at % 3 == 0 and at == res[0]["fedavg_ckpt_step"]
    for rank in range(WORLD):
        parts = {n: _part(out, n, f"step={at}.ckpt", rank)["strategy_state"]["comm"] for n in ("localsgd", "fedavg")}
        model = _load(out / f"localsgd_full_rank{rank}.pt")["model"]
        model_bytes = sum(v.numel() * v.element_size() for v in model.values())
        in_sync, between = parts["localsgd"], parts["fedavg"]
        assert in_sync["ops"]["params"] == at // 3  # the last sync was the step just saved
        assert in_sync["bytes_sent"]["checkpoint"] < 1000 < model_bytes <= between["bytes_sent"]["checkpoint"]
        # verify_sync: one gather after every sync, and the in-sync save's one
        assert in_sync["ops"]["verify"] == in_sync["ops"]["params"] + 1
        assert between["ops"]["verify"] == between["ops"]["params"]


def test_selsync_checkpoint_holds_the_vote_in_flight(suite):
    """The resume case above covers SelSync's default vote order (``"overlapped"``): the checkpoint is taken with
    the last step's vote in flight; the part holds what it delivered (the votes, SIGTERM flags, each rank's Δ), which
    decides after the first step of the resumed run as it did in the uninterrupted one. In Alg. 1's order nothing is
    in flight at a checkpoint."""
    out, res = suite
    for rank in range(WORLD):
        at = res[0]["selsync_ckpt_step"]
        state = _part(out, "selsync", f"step={at}.ckpt", rank)["strategy_state"]
        assert (
            state["vote_in_flight"] is not None and len(state["vote_in_flight"]) == 4
        )  # votes, SIGTERM, own Δ, finite
        exact = _part(out, "selsync_exact", f"step={res[0]['selsync_exact_ckpt_step']}.ckpt", rank)["strategy_state"]
        assert exact["vote_in_flight"] is None


def test_diloco_checkpoint_holds_the_fragment_in_flight_and_the_outer_state(suite):
    """The resume case above covers a Streaming DiLoCo checkpoint taken while a fragment's all-reduce is in flight:
    the part holds its completed result (applied two steps later in both runs), the global parameters and the
    outer momentum."""
    out, res = suite
    at = res[0]["diloco_ckpt_step"]
    for rank in range(WORLD):
        state = _part(out, "diloco", f"step={at}.ckpt", rank)["strategy_state"]
        pending = state["diloco"]["pending"]
        assert pending is not None and pending["step"] == at - 1 and pending["fragment"] == 0
        outer = state["outer"]["optimizer"]
        assert outer["steps"] > 0 and float(outer["momentum_buffers"][0].abs().max()) > 0


@pytest.mark.parametrize("name", ASYNC + COMPRESSED_ASYNC)
def test_asynchronous_strategy_restores_server_replicas_and_counters_exactly(suite, name):
    out, _ = suite
    steps = {}
    for rank in range(WORLD):
        part = _part(out, name, "epoch=0.ckpt", rank)
        start = _load(out / f"{name}_start_rank{rank}.pt")
        saved, restored = part["strategy_state"], start["state"]
        # server shard parameters, clocks, push counters, mailbox; step counters and communication totals
        assert _strip(restored) == _strip(saved)
        assert saved["ps"]["clocks"] and saved["steps"]["sync_steps"] + saved["steps"]["local_steps"] > 0
        replica = {k: v for k, v in part["state_dict"].items() if v.is_floating_point()}
        assert _same_tensors(start["model"], replica)  # this rank's own replica, not rank 0's
        for run in ("full", "resumed"):
            s = _load(out / f"{name}_{run}_rank{rank}.pt")["state"]["steps"]
            steps[run] = steps.get(run, 0) + s["sync_steps"] + s["local_steps"]
        resumed = _load(out / f"{name}_resumed_rank{rank}.pt")
        assert all(torch.isfinite(v).all() for v in resumed["model"].values())
    main = _load(out / f"ckpt_{name}" / "epoch=0.ckpt")
    assert main["lightning_sync"]["world_size"] == WORLD
    # every batch is trained exactly once per epoch whatever rank took it: the totals over the ranks agree
    assert steps["resumed"] == steps["full"]


@pytest.mark.parametrize("name", COMPRESSED_EXACT + COMPRESSED_ASYNC)
def test_compressed_checkpoint_parts_hold_the_error_feedback_residuals(suite, name):
    out, res = suite
    ckpt = f"step={res[0][f'{name}_ckpt_step']}.ckpt" if name in COMPRESSED_EXACT else "epoch=0.ckpt"
    parts = [_part(out, name, ckpt, rank)["strategy_state"]["compression"] for rank in range(WORLD)]
    for part in parts:
        streams = part["residuals"]["feedback"]
        codec = COMPRESSION_OF.get(name, name.rpartition("_")[2])
        assert part["residuals"]["compression"] == codec and streams
        assert all(float(s["worker"].abs().sum()) > 0 for s in streams.values())  # something was carried over
    # the residuals are each rank's own (ASP's are per remote server: push/<other rank>); the reference of parameter
    # averaging is the same on every rank
    mine, theirs = parts[0]["residuals"]["feedback"], parts[1]["residuals"]["feedback"]
    for key in set(mine) & set(theirs):
        assert not torch.equal(mine[key]["worker"], theirs[key]["worker"])
    if name in ("localsgd_int8", "diloco_int8", "diloco_int2", "localsgd_topk", "diloco_topk_int2"):
        assert all(torch.equal(a, b) for a, b in zip(parts[0]["reference"], parts[1]["reference"]))
    else:
        assert parts[0]["reference"] is None  # BSP and ASP never average parameters


def test_sync_switch_resumed_in_the_bsp_phase_switches_at_the_same_point_with_identical_replicas(suite):
    out, _ = suite
    for rank in range(WORLD):
        full = _load(out / f"sync_switch_full_rank{rank}.pt")
        resumed = _load(out / f"sync_switch_resumed_bsp_rank{rank}.pt")
        switches = [_strip(s) for s in full["state"]["sync_switch"]["switches"]]
        assert [(s["from"], s["to"]) for s in switches] == [("bsp", "asp")]
        assert switches[0]["epoch"] == 1  # half of 3 epochs: in the middle of the second
        assert [_strip(s) for s in resumed["state"]["sync_switch"]["switches"]] == switches
        assert full["state"]["sync_switch"]["bsp_batches"] == resumed["state"]["sync_switch"]["bsp_batches"]
        models = _load(out / f"sync_switch_models_rank{rank}.pt")
        assert _same_tensors(models["resumed_bsp_switch"], models["full_switch"])
        start = _load(out / f"sync_switch_resumed_bsp_start_rank{rank}.pt")
        assert start["state"]["sync_switch"]["protocol"] == "bsp"
        assert _strip(start["state"]) == _strip(_part(out, "sync_switch", "epoch=0.ckpt", rank)["strategy_state"])
    replicas = [_load(out / f"sync_switch_models_rank{r}.pt")["full_switch"] for r in range(WORLD)]
    assert _same_tensors(replicas[0], replicas[1])  # BSP kept the replicas identical up to the switch


def test_sync_switch_resumed_in_the_asp_phase_restores_the_state_exactly(suite):
    out, _ = suite
    for rank in range(WORLD):
        part = _part(out, "sync_switch", "epoch=1.ckpt", rank)
        start = _load(out / f"sync_switch_resumed_asp_start_rank{rank}.pt")
        assert part["strategy_state"]["sync_switch"]["protocol"] == "asp"
        assert _strip(start["state"]) == _strip(part["strategy_state"])
        resumed = _load(out / f"sync_switch_resumed_asp_rank{rank}.pt")
        assert len(resumed["state"]["sync_switch"]["switches"]) == 1  # no second switch after the resume


def test_declared_state_fields_save_restore_and_refuse_another_strategys_checkpoint():
    """``state_fields`` (``strategies/state.py``), in process: a leading underscore is dropped from the key, an object
    with ``state_dict`` is saved as that and rebuilt by its ``_new_<key>`` factory, a subclass adds its own fields
    (``{key: names}``: one dict), values are copies, and a checkpoint without a declared field raises naming it."""
    from lightning_sync.strategies import ADPSGDStrategy, LocalSGDStrategy, SyncSwitchStrategy
    from lightning_sync.strategies.state import load_declared_state, save_declared_state

    local = LocalSGDStrategy(period=3)
    local._step = 7
    assert save_declared_state(local) == {"step": 7}
    restored = LocalSGDStrategy(period=3)
    load_declared_state(restored, {"step": 7})
    assert restored._step == 7
    with pytest.raises(ValueError, match="'step'.*LocalSGDStrategy"):
        load_declared_state(restored, {"round": 2})  # FedAvg's

    adpsgd = ADPSGDStrategy(p_init=2)
    assert save_declared_state(adpsgd) == {"controller": None}  # built at train start: nothing to restore yet
    load_declared_state(adpsgd, {"controller": None})
    assert adpsgd.controller is None
    adpsgd.controller = adpsgd._new_controller()
    saved = save_declared_state(adpsgd)
    assert saved == {"controller": adpsgd.controller.state_dict()}
    fresh = ADPSGDStrategy(p_init=2)
    load_declared_state(fresh, saved)
    assert fresh.controller is not None and fresh.controller.state_dict() == saved["controller"]

    switch = SyncSwitchStrategy()
    switch.switches.append({"from": "bsp", "to": "asp"})
    saved = save_declared_state(switch)
    assert saved == {
        "async_pushes": 0,  # ASP's field, at the top level
        "sync_switch": {"protocol": "bsp", "next_protocol": None, "bsp_batches": 0, "switches": switch.switches},
    }
    assert saved["sync_switch"]["switches"] is not switch.switches  # a copy: later switches do not change it
