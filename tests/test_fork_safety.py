"""The pack's threads and DataLoader workers (issue 61): a fork never copies a lock a pack thread holds, no pack thread
outlives its fit, and a loader whose worker never delivers stops its rank within the strategy's timeout.

A DataLoader forks its workers whenever an iterator is created. The hazard is made deterministic here: on rank 0 the
parameter server's thread is held inside a push — holding the server's lock — exactly when the training thread
creates worker iterators, and each worker checks, as it starts, whether it can take that lock (a child that finds a
lock held hangs the first time it needs it). Before the fork gate (``lightning_sync.comm.forksafe``) the workers
found it held; with it, the fork waits for the push to end.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tests.launch import run_external

#: thread-name prefixes of every thread the pack starts (comm/ps.py, comm/communicator.py, comm/ddp_hook.py)
PACK_THREADS = ("ps-", "comm-driver-", "lightning-sync-ddp-link")
HOLD_S = 1.0  # how long the server thread is held inside a push (the fork happens meanwhile, unless it waits)


def _pack_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(PACK_THREADS))


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def _loader(n: int, seed: int, **kw) -> DataLoader:
    # fork, as in a script Lightning launches like 'ddp' (processes started by spawn, as here, default to spawn)
    return DataLoader(_data(n, seed), batch_size=8, num_workers=1, multiprocessing_context="fork", **kw)


def _module():
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

        def training_step(self, batch, i):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, i):
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

        def test_step(self, batch, i):
            self.log("test_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

        def predict_step(self, batch, i):
            return self.net(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return Net()


# ---------------------------------------------------------------------------------------------- the hazard, held
_HOLD = threading.Event()
_HOLDING = threading.Event()
_STRATEGY = None  # the rank's strategy, for the workers' check (a forked child has a copy of it)


def _held_push(original):
    def push(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread() and _HOLD.is_set():
            _HOLD.clear()
            _HOLDING.set()
            time.sleep(HOLD_S)  # inside the server's lock, as a long push is
        return original(self, *args, **kwargs)

    return push


def _check_lock_in_worker(out: str):
    def init(worker_id: int) -> None:
        lock = _STRATEGY._ps._server_lock
        free = lock.acquire(timeout=2.0)
        if free:
            lock.release()
        Path(out, f"child-{os.getpid()}.json").write_text(json.dumps({"server_lock_free": free}))

    return init


def _fork_run(rank: int, out: str, names: list[str]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    import lightning_sync
    from lightning_sync.core.ps import ShardServer
    from lightning_sync.launch import quiet_trainer_kwargs

    global _STRATEGY
    forks: list[dict] = []
    stage = {"now": "fit"}
    os.register_at_fork(before=lambda: forks.append({"stage": stage["now"], "threads": _pack_threads()}))
    ShardServer.push = _held_push(ShardServer.push)

    class ForkWhileServing(Callback):
        """Rank 0: at two batches, hold the server thread inside a push and create worker iterators meanwhile.

        Rank 1 starts its next batch only once rank 0 is ready to hold (a file in ``out``): the ranks of the
        parameter-server strategies run at their own pace, and without it rank 1 may have pushed its last push of
        the epoch, or be held by SSP's staleness bound waiting for rank 0, when rank 0 waits for its next push."""

        def __init__(self, name: str) -> None:
            self.name = name

        def _ready(self, trainer, batch_idx) -> Path:
            return Path(out, f"ready-{self.name}-{trainer.current_epoch}-{batch_idx}")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_rank != 1 or batch_idx not in (2, 4) or getattr(trainer.strategy, "_ps", None) is None:
                return
            ready, deadline = self._ready(trainer, batch_idx - 1), time.monotonic() + 60
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.005)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_rank != 0 or batch_idx not in (1, 3) or getattr(trainer.strategy, "_ps", None) is None:
                return
            _HOLDING.clear()
            _HOLD.set()
            self._ready(trainer, batch_idx).touch()
            held = _HOLDING.wait(timeout=30)  # rank 1's next push reaches the server thread
            loader = _loader(8, 9, worker_init_fn=_check_lock_in_worker(out))
            next(iter(loader))
            forks[-1]["held"] = held

    results = {}
    for name in names:
        _STRATEGY = strategy = {
            "asp": lambda: lightning_sync.ASPStrategy(timeout=timedelta(seconds=60)),
            "ssp": lambda: lightning_sync.SSPStrategy(timeout=timedelta(seconds=60)),
            "aladdin": lambda: lightning_sync.ALADDINStrategy(timeout=timedelta(seconds=60)),
            "localsgd": lambda: lightning_sync.LocalSGDStrategy(timeout=timedelta(seconds=60)),
        }[name]()
        forks.clear()
        stage["now"] = "fit"
        pl.seed_everything(0)
        model = _module()
        trainer = pl.Trainer(
            **quiet_trainer_kwargs(num_sanity_val_steps=1),
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_epochs=2,
            callbacks=[ForkWhileServing(name)],
        )
        trainer.fit(model, _loader(400, 0), _loader(16, 1))
        for what in ("validate", "test", "predict"):
            stage["now"] = what
            getattr(trainer, what)(model, _loader(16, 2))
        results[name] = {"forks": list(forks), "live_after": _pack_threads()}
    Path(out, f"res_rank{rank}.json").write_text(json.dumps(results))


def test_a_fork_during_training_copies_no_lock_the_pack_threads_hold_and_none_outlives_fit(tmp_path):
    names = ["asp", "ssp", "aladdin", "localsgd"]
    run_external(_fork_run, 2, str(tmp_path), names)
    res = [json.loads((tmp_path / f"res_rank{r}.json").read_text()) for r in range(2)]
    children = [json.loads(p.read_text()) for p in tmp_path.glob("child-*.json")]
    # rank 0 held its server thread inside a push at two batches of each of 2 epochs, in the three PS strategies' fits
    held = [f for name in names[:3] for f in res[0][name]["forks"] if "held" in f]
    assert len(held) == 3 * 2 * 2 and all(f["held"] for f in held), {
        name: [f["held"] for f in res[0][name]["forks"] if "held" in f] for name in names[:3]
    }
    assert len(children) == len(held)
    assert all(c["server_lock_free"] for c in children), children  # the fork waited for the push to end
    for r in range(2):
        for name in names:
            forks = res[r][name]["forks"]
            assert {f["stage"] for f in forks} >= {"fit", "validate", "test", "predict"}
            for f in forks:
                if f["stage"] != "fit":
                    assert f["threads"] == [], (name, f)  # no pack thread outside its fit
            assert res[r][name]["live_after"] == []
        for name in names[:3]:  # the parameter server's threads did run while the workers forked
            assert any(f["threads"] for f in res[r][name]["forks"] if f["stage"] == "fit")


# ----------------------------------------------------------------------------- a worker that never delivers
class _StallsInWorkerOnRank1(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        if torch.utils.data.get_worker_info() is not None and os.environ.get("RANK") == "1":
            time.sleep(3600)
        return torch.ones(8), torch.ones(1)


def _stalled_validate(rank: int, out: str) -> None:
    import lightning.pytorch as pl

    import lightning_sync
    from lightning_sync.launch import quiet_trainer_kwargs

    pl.seed_everything(0)
    trainer = pl.Trainer(
        **quiet_trainer_kwargs(),
        accelerator="cpu",
        devices=2,
        strategy=lightning_sync.ASPStrategy(timeout=timedelta(seconds=5)),
    )
    start = time.monotonic()
    try:
        trainer.validate(_module(), DataLoader(_StallsInWorkerOnRank1(), batch_size=8, num_workers=1))
        error = None
    except Exception as err:  # noqa: BLE001 - recorded for the test
        error = f"{type(err).__name__}: {err}"
    Path(out, f"res_rank{rank}.json").write_text(json.dumps({"error": error, "s": time.monotonic() - start}))


@pytest.mark.timeout(180)
def test_a_rank_whose_dataloader_worker_never_delivers_stops_within_the_strategy_timeout(tmp_path):
    try:
        run_external(_stalled_validate, 2, str(tmp_path))
    except Exception:  # noqa: BLE001 - the ranks' own errors are read from their files
        pass
    rank1 = json.loads((tmp_path / "res_rank1.json").read_text())
    assert rank1["error"] is not None and "DataLoader timed out after 5" in rank1["error"]
    assert rank1["s"] < 60  # the strategy's timeout (5 s), not forever


# ------------------------------------------------------------------- a rank that starts its epoch late
def _late_rank(rank: int, out: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, EarlyStopping

    import lightning_sync
    from lightning_sync.launch import quiet_trainer_kwargs

    exhausted = lightning_sync.ASPStrategy._on_exhausted

    def on_exhausted(self, epoch: int) -> None:  # rank 0 says when it has taken every position it could
        if self.global_rank == 0:
            self._work.store.set(f"test/rank0_exhausted/{epoch}", "1")
        exhausted(self, epoch)

    lightning_sync.ASPStrategy._on_exhausted = on_exhausted

    class Rank1StartsLate(Callback):
        """Rank 1 starts each epoch only once rank 0 has claimed past its end (a slow start, a loaded machine)."""

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.global_rank == 1:
                key = f"test/rank0_exhausted/{trainer.current_epoch}"
                trainer.strategy._work.store.wait([key], timedelta(seconds=60))

    pl.seed_everything(0)
    trainer = pl.Trainer(
        **quiet_trainer_kwargs(),
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        strategy=lightning_sync.ASPStrategy(timeout=timedelta(seconds=30)),
        callbacks=[Rank1StartsLate(), EarlyStopping(monitor="val_loss", patience=5)],
    )
    trainer.fit(_module(), DataLoader(_data(64, 0), batch_size=8), DataLoader(_data(16, 1), batch_size=8))
    claimed = trainer.strategy.server_summary["batches_claimed"]
    Path(out, f"res_rank{rank}.json").write_text(json.dumps({"epochs": trainer.current_epoch, "claimed": claimed}))


def test_a_rank_that_starts_its_epoch_after_the_others_took_every_batch_still_trains_one_and_validates(tmp_path):
    # found by benchmarks/fork_stress.py under load: the rank trained no batch, skipped the epoch-end validation the
    # other ran, and the two met in different collectives (a hang until the timeout)
    run_external(_late_rank, 2, str(tmp_path))
    res = [json.loads((tmp_path / f"res_rank{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert r["epochs"] == 2
    # rank 1's own first position, then its claim past the end; rank 0 took the other 7 and its claim past the end
    assert res[1]["claimed"] == {"0": 2, "1": 2}
    assert res[0]["claimed"] == {"0": 8, "1": 8}
