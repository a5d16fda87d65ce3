"""SelSync's per-step overhead, and bytes and epoch time on an emulated 1 Gbit/s, 1 ms link.

    python benchmarks/overhead.py            # about a minute on 2 CPU cores

Part 1 — overhead of a step that does not sync. One 2-process run (gloo, CPU) of the demo CNN on the digits data
alternates, step by step, SelSync's full per-step work (squared gradient norm over the flat gradient buffer,
windowed EWMA, Eq. 2, the 4-byte vote all-reduce; delta=inf so no step syncs) with a plain local step (the same
Lightning step with none of that). Interleaving puts both kinds of step under the same machine noise; the ratio
of median step times is printed. Goal: <= 1.01.

Part 2 — BSP vs SelSync(delta=0.3) for one epoch (Lightning's DistributedSampler for both, so epochs have the same
steps) under LinkModel("1gbit", "1ms"): bytes sent per rank, seconds blocked in communication, epoch wall time,
on the demo CNN (~38k parameters) and on WideMLP (~4.3M parameters, 17 MB: communication-heavy). Each cell is
measured in the same pair of processes, one run after another.

Every rank uses torch.set_num_threads(1) (2 ranks on 2 cores would otherwise oversubscribe).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

WORLD = 2


def _make_toggle_strategy():
    from torch.optim import Optimizer

    from lightning_sync import SelSyncStrategy

    class ToggleSelSync(SelSyncStrategy):
        """Even steps: SelSync's full per-step logic. Odd steps: a plain local step, i.e. what Lightning does on
        its own in a multi-process step: no norm, no EWMA, no vote, but Lightning's per-step SIGTERM collective
        (which SelSync folds into its vote)."""

        plain = False
        _count = 0

        def on_train_batch_start(self, batch, batch_idx):  # type: ignore[override]
            self.plain = self._count % 2 == 1
            self._count += 1
            return super().on_train_batch_start(batch, batch_idx)

        def _after_backward(self, optimizer: Optimizer) -> None:
            if not self.plain:
                super()._after_backward(optimizer)

        def _after_update(self, optimizer: Optimizer) -> None:
            if self.plain:
                self.step_counter.record(False)
                self._check_sigterm()
            else:
                super()._after_update(optimizer)

    return ToggleSelSync


def _trainer(strategy, callbacks=(), **kw):
    import lightning.pytorch as pl

    from lightning_sync.launch import quiet_trainer_kwargs

    return pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        limit_val_batches=0,
        callbacks=list(callbacks),
        **quiet_trainer_kwargs(**kw),
    )


def _worker(rank: int, out_dir: str, steps: int, repeats: int) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_sync import BSPStrategy, LinkModel, SelSyncStrategy
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.models import DigitsCNN, WideMLP

    res: dict = {}

    class StepTimer(Callback):
        """Step time = from the end of the previous step to the end of this one, so everything a step costs
        (Lightning's per-step collectives and the wait for the slower rank included) is charged to it."""

        def __init__(self, skip: int):
            self.skip = skip
            self.last: float | None = None
            self.times: dict[bool, list[float]] = {True: [], False: []}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            if self.last is not None and trainer.global_step > self.skip and batch_idx > 0:
                self.times[trainer.strategy.plain].append(now - self.last)
            self.last = now

    # Part 1: interleaved overhead runs (several fits in the same processes)
    blocks = []
    for _ in range(repeats):
        pl.seed_everything(0)
        timer = StepTimer(skip=20)
        strategy = _make_toggle_strategy()(delta=float("inf"))
        trainer = _trainer(strategy, [timer], max_steps=steps + 20, max_epochs=-1)
        trainer.fit(DigitsCNN(), DigitsDataModule(batch_size=32))
        blocks.append(
            {
                "selsync_median_s": statistics.median(timer.times[False]),
                "plain_median_s": statistics.median(timer.times[True]),
                "n": [len(timer.times[False]), len(timer.times[True])],
                "sync_steps": strategy.step_counter.sync_steps,
                "vote_blocked_s": strategy.comm_stats.blocked_seconds["vote"],
                "vote_ops": strategy.comm_stats.ops["vote"],
            }
        )
    res["overhead"] = blocks

    # Part 2: one epoch, BSP vs SelSync(0.3), emulated 1 Gbit/s + 1 ms
    class EpochTimer(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            self.t0 = time.perf_counter()

        def on_train_epoch_end(self, trainer, pl_module):
            self.seconds = time.perf_counter() - self.t0

    link = LinkModel("1gbit", "1ms")
    for model_name, make_model in (("DigitsCNN", DigitsCNN), ("WideMLP", WideMLP)):
        for strat_name, make_strategy in (
            ("BSP", lambda: BSPStrategy(link=link)),
            ("SelSync(0.3)", lambda: SelSyncStrategy(delta=0.3, link=link)),
        ):
            pl.seed_everything(0)
            timer2 = EpochTimer()
            strategy = make_strategy()
            trainer = _trainer(strategy, [timer2], max_epochs=1)
            trainer.fit(make_model(), DigitsDataModule(batch_size=32))
            stats = strategy.comm_stats
            res[f"{model_name}/{strat_name}"] = {
                "steps": strategy.step_counter.steps,
                "lssr": strategy.step_counter.lssr,
                "bytes_sent": stats.total_bytes(),
                "blocked_s": stats.total_blocked_seconds(),
                "epoch_s": timer2.seconds,
                "params": sum(p.numel() for p in trainer.lightning_module.parameters()),
            }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="measured steps in part 1 (half of each kind)")
    parser.add_argument("--repeats", type=int, default=3, help="part 1 runs, one after another")
    parser.add_argument("--json", type=Path, default=None, help="also write rank 0's raw numbers here")
    args = parser.parse_args()

    from lightning_sync.launch import launch_local

    with tempfile.TemporaryDirectory() as tmp:
        launch_local(_worker, WORLD, tmp, args.steps, args.repeats)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]
    r0 = ranks[0]
    if args.json:
        args.json.write_text(json.dumps(ranks, indent=2))

    print("\n## Part 1: per-step overhead of a SelSync step that does not sync (demo CNN, 2 ranks, gloo, CPU)")
    print(
        "| run | SelSync steps | plain steps | syncs | median SelSync ms | median plain ms | ratio | vote blocked us |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for i, o in enumerate(r0["overhead"]):
        ratio = o["selsync_median_s"] / o["plain_median_s"]
        ratios.append(ratio)
        vote_us = o["vote_blocked_s"] / max(1, o["vote_ops"]) * 1e6
        print(
            f"| {i + 1} | {o['n'][0]} | {o['n'][1]} | {o['sync_steps']} | {o['selsync_median_s'] * 1e3:.3f} "
            f"| {o['plain_median_s'] * 1e3:.3f} | {ratio:.3f} | {vote_us:.0f} |"
        )
    print(f"median ratio SelSync / plain over runs: {statistics.median(ratios):.3f}   (goal <= 1.01)")
    print("\n## Part 2: one epoch at an emulated 1 Gbit/s, 1 ms link (rank 0; DistributedSampler)")
    print("| model | params | strategy | steps | LSSR | bytes sent / rank | blocked s | epoch s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for model in ("DigitsCNN", "WideMLP"):
        for strat in ("BSP", "SelSync(0.3)"):
            c = r0[f"{model}/{strat}"]
            print(
                f"| {model} | {c['params']:,} | {strat} | {c['steps']} | {c['lssr']:.3f} | {c['bytes_sent']:,} "
                f"| {c['blocked_s']:.3f} | {c['epoch_s']:.3f} |"
            )
    for model in ("DigitsCNN", "WideMLP"):
        b, s = r0[f"{model}/BSP"], r0[f"{model}/SelSync(0.3)"]
        print(
            f"{model}: BSP/SelSync bytes = {b['bytes_sent'] / max(1, s['bytes_sent']):.1f}x, "
            f"epoch time = {b['epoch_s'] / s['epoch_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
