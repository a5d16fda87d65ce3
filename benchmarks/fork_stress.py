"""Issue 61's check: fit → validate → test → predict with worker DataLoaders, many times a strategy, and no hang.

The script a user would write (2 CPU ranks; DataLoaders with one forked worker, persistent or not; ModelCheckpoint and
EarlyStopping; ``fit`` then ``validate``, ``test`` and ``predict``), at each strategy's defaults, run ``--runs`` times
a strategy by the same two processes (started once with ``launch_local``; their DataLoaders fork, as in a script
Lightning launches like ``ddp``). A run that fails is recorded with its error; a run that hangs trips a watchdog that
dumps every thread's stack, and every DataLoader worker's (``worker_<pid>.txt``; a worker that hung inside the fork
never started and writes nothing), and ends the process (``--hang-s``), so a hang is reported, never waited for.

    python benchmarks/fork_stress.py --strategies ssp,asp,aladdin,localsgd --runs 100 \\
        --out docs/benchmarks/fork_stress

Run it beside another job to load the machine (issue 61's hang needed one): e.g. two instances at once.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

_OUT = "."  # the run's folder, where a DataLoader worker writes its stacks when the watchdog asks


def _worker_init(worker_id: int) -> None:
    """A worker that started: its stacks on SIGUSR1 (the watchdog's request), into the run's folder."""
    log = open(Path(_OUT, f"worker_{os.getpid()}.txt"), "w")  # noqa: SIM115 - open until the worker exits
    log.write(f"worker {os.getpid()} started\n")
    log.flush()
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)


def _loader(n: int, seed: int, persistent: bool) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    return DataLoader(
        TensorDataset(x, y),
        batch_size=16,
        num_workers=1,
        persistent_workers=persistent,
        multiprocessing_context="fork",
        shuffle=False,
        worker_init_fn=_worker_init,
    )


def _watchdog(out: str, rank: int, hang_s: float, progress: list[float]) -> None:
    """A run that makes no progress for ``hang_s``: this rank's stacks, then every DataLoader worker's (a worker that
    never reached its start writes nothing: it hung inside the fork), then the process ends."""
    while True:
        time.sleep(5)
        if time.monotonic() - progress[0] < hang_s:
            continue
        with open(Path(out, f"stacks_rank{rank}.txt"), "w") as f:
            f.write(f"no progress for {hang_s:.0f} s\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            for child in multiprocessing.active_children():
                f.write(f"DataLoader worker {child.pid} ({child.name}): asked for its stacks\n")
                with contextlib.suppress(OSError):
                    os.kill(child.pid, signal.SIGUSR1)
        time.sleep(3)
        os._exit(3)


def _module():
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

        def _loss(self, batch):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def training_step(self, batch, i):
            return self._loss(batch)

        def validation_step(self, batch, i):
            self.log("val_loss", self._loss(batch), sync_dist=True)

        def test_step(self, batch, i):
            self.log("test_loss", self._loss(batch), sync_dist=True)

        def predict_step(self, batch, i):
            return self.net(batch[0]).argmax(1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return Net()


def _cycles(rank: int, out: str, strategies: list[str], runs: int, hang_s: float, scratch: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    import lightning_sync  # noqa: F401  (registers the strategy names)
    from lightning_sync.comm.forksafe import GATE, live_threads

    global _OUT
    _OUT = out
    progress = [time.monotonic()]
    threading.Thread(target=_watchdog, args=(out, rank, hang_s, progress), daemon=True, name="watchdog").start()
    results: dict[str, dict] = {}
    for name in strategies:
        done, errors, longest = 0, [], 0.0
        for run in range(runs):
            progress[0] = start = time.monotonic()
            try:
                pl.seed_everything(run, verbose=False)
                model = _module()
                ckpt = Path(scratch, name, str(run))
                trainer = pl.Trainer(
                    accelerator="cpu",
                    devices=2,
                    strategy=name,
                    max_epochs=2,
                    logger=False,
                    enable_progress_bar=False,
                    enable_model_summary=False,
                    callbacks=[ModelCheckpoint(dirpath=ckpt, monitor="val_loss"), EarlyStopping(monitor="val_loss")],
                )
                persistent = run % 2 == 0
                trainer.fit(model, _loader(256, run, persistent), _loader(64, 1000 + run, persistent))
                trainer.validate(model, _loader(64, 2000 + run, persistent), verbose=False)
                trainer.test(model, _loader(64, 3000 + run, persistent), verbose=False)
                trainer.predict(model, _loader(64, 4000 + run, persistent))
                alive = live_threads()
                if alive:
                    raise RuntimeError(f"pack threads alive after the run: {alive}")
                done += 1
            except Exception as err:  # noqa: BLE001 - recorded; the ranks stop this strategy together
                errors.append(f"run {run}: {type(err).__name__}: {err}"[:500])
                break
            finally:
                longest = max(longest, time.monotonic() - start)
        results[name] = {"runs": done, "errors": errors, "longest_run_s": round(longest, 2)}
    results["_gate"] = {"forks_waited": GATE.forks_waited, "longest_wait_s": round(GATE.longest_wait_s, 4)}
    Path(out, f"res_rank{rank}.json").write_text(json.dumps(results, indent=1))
    if rank == 0:  # the workers that only wrote "started": nothing to report
        for done_worker in Path(out).glob("worker_*.txt"):
            with contextlib.suppress(FileNotFoundError):
                if done_worker.read_text().count("\n") <= 1:
                    done_worker.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default="ssp,asp,aladdin,localsgd")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--hang-s", type=float, default=600.0, help="a run taking longer is a hang (default 600)")
    parser.add_argument("--out", default="runs/fork_stress")
    args = parser.parse_args(argv)
    from lightning_sync.launch import launch_local

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    strategies = args.strategies.split(",")
    start = time.monotonic()
    failed = None
    try:
        with tempfile.TemporaryDirectory() as scratch:  # the runs' checkpoints
            launch_local(_cycles, 2, str(out), strategies, args.runs, args.hang_s, scratch)
    except Exception as err:  # noqa: BLE001 - a rank ended (a hang's watchdog): reported below
        failed = f"{type(err).__name__}: {err}"
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("res_rank*.json"))]
    summary = {
        "command": "python benchmarks/fork_stress.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "wall_s": round(time.monotonic() - start, 1),
        "launch_error": failed,
        "ranks": ranks,
        "load_average_at_end": os.getloadavg(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for name in strategies:
        per_rank = [r.get(name, {}) for r in ranks]
        print(name, [(r.get("runs"), len(r.get("errors", []))) for r in per_rank])
    ok = (
        failed is None
        and len(ranks) == 2
        and all(r[name]["runs"] == args.runs and not r[name]["errors"] for r in ranks for name in strategies)
    )
    print("all runs completed" if ok else f"NOT all runs completed: {failed}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
