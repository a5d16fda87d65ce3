"""Compressed synchronization (``compression=None | "bf16" | "int8"``): bytes and time per step, and accuracy.

    python benchmarks/compression.py                       # both parts, about 6 minutes on 2 CPU cores
    python benchmarks/compression.py --part speed          # only the bytes/time table
    python benchmarks/compression.py --part accuracy --seeds 0 1 2

**Speed** (``--part speed``): the communication-heavy ``WideMLP`` (hidden 2048, depth 2: ~4.3M parameters, 17 MB of
float32) on digits (batch 32 per rank), ``--world`` ranks (default 4) at an emulated ``--link`` (default
``1gbit,1ms``), BSP (gradients every step) and local SGD (``period=8``), each with fp32, bf16 and int8 syncs, one
after another in the same processes. Per row: bytes rank 0 sent per step (``sync/bytes_sent`` / steps) and the
median wall time of a training step after the first ``--skip`` steps (workspaces and the first collectives of a
shape are set up there). Several processes share the 2 cores of the development machine, and the encode/decode
of a compressed all-reduce is CPU work they compete for: the times are noisy and CPU-bound; the bytes are exact.

**Accuracy** (``--part accuracy``): the embedded default (demo CNN on digits, 2 ranks, batch 32, 6 epochs as
``lightning-sync compare`` runs it), BSP with fp32, bf16 and int8 gradient all-reduces per seed; test accuracy of the
model ``fit`` hands back, and the difference to fp32 in points (the goal: bf16 within 0.5 point; the test split has
360 images, so one image is 0.28 points).

Each rank uses ``torch.set_num_threads(1)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

COMPRESSIONS = (None, "bf16", "int8")


def _speed_worker(rank: int, out_dir: str, world: int, link: str, epochs: int) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_sync import BSPStrategy, LocalSGDStrategy
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import WideMLP

    class StepClock(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not self.ends:
                self.ends.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())

    res: dict = {}
    for name, make in (("BSP", BSPStrategy), ("local SGD(p=8)", lambda **k: LocalSGDStrategy(period=8, **k))):
        for compression in COMPRESSIONS:
            pl.seed_everything(0)
            strategy = make(link=link, compression=compression)
            clock = StepClock()
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=world,
                strategy=strategy,
                max_epochs=epochs,
                limit_val_batches=0,
                callbacks=[clock],
                **quiet_trainer_kwargs(),
            )
            trainer.fit(WideMLP(), DigitsDataModule(batch_size=32, flatten=True))
            m = strategy.sync_metrics()
            res[f"{name}/{compression}"] = {
                "steps": strategy.step_counter.steps,
                "bytes_sent": m["bytes_sent"],
                "step_s": [b - a for a, b in zip(clock.ends, clock.ends[1:])],
                "blocked_s": m["blocked_s"],
            }
    if rank == 0:
        Path(out_dir, "speed.json").write_text(json.dumps(res))


def _accuracy_worker(rank: int, out_dir: str, seeds: list[int], epochs: int) -> None:
    import lightning.pytorch as pl

    from lightning_sync import BSPStrategy
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    res: dict = {}
    for seed in seeds:
        for compression in COMPRESSIONS:
            pl.seed_everything(seed)
            kw = quiet_trainer_kwargs(accelerator="cpu", devices=2)
            model, dm = DigitsCNN(), DigitsDataModule(batch_size=32)
            strategy = BSPStrategy(compression=compression)
            pl.Trainer(strategy=strategy, max_epochs=epochs, limit_val_batches=0, **kw).fit(model, dm)
            result = pl.Trainer(strategy=BSPStrategy(), **kw).test(model, dm, verbose=False)
            res[f"{seed}/{compression}"] = {
                "acc": float(result[0]["test/acc"]),
                "bytes_grads": strategy.comm_stats.bytes_sent["grads"],
            }
    if rank == 0:
        Path(out_dir, "accuracy.json").write_text(json.dumps(res))


def _label(compression: str | None) -> str:
    return compression or "fp32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("speed", "accuracy", "both"), default="both")
    parser.add_argument("--world", type=int, default=4, help="ranks of the speed part")
    parser.add_argument("--link", default="1gbit,1ms", help="emulated link of the speed part")
    parser.add_argument("--speed-epochs", type=int, default=2)
    parser.add_argument("--skip", type=int, default=3, help="first steps of each run left out of the median")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=6, help="epochs of the accuracy part")
    args = parser.parse_args()

    from lightning_sync.launch import launch_local

    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("speed", "both"):
            launch_local(_speed_worker, args.world, tmp, args.world, args.link, args.speed_epochs)
            speed = json.loads(Path(tmp, "speed.json").read_text())
            print(
                f"\n## Compressed syncs: WideMLP (~4.3M params), digits, batch 32 x {args.world} ranks, link "
                f"{args.link}, {args.speed_epochs} epochs (step time: median after the first {args.skip} steps)"
            )
            print(
                "| strategy | compression | steps | bytes sent / step (rank 0) | vs fp32 | step s (median) | vs fp32 |"
            )
            print("|---|---|---:|---:|---:|---:|---:|")
            for name in ("BSP", "local SGD(p=8)"):
                base = speed[f"{name}/None"]
                base_bytes = base["bytes_sent"] / base["steps"]
                base_step = statistics.median(base["step_s"][args.skip :])
                for compression in COMPRESSIONS:
                    r = speed[f"{name}/{compression}"]
                    per_step = r["bytes_sent"] / r["steps"]
                    step = statistics.median(r["step_s"][args.skip :])
                    print(
                        f"| {name} | {_label(compression)} | {r['steps']} | {per_step:,.0f} | "
                        f"{per_step / base_bytes:.3f} | {step:.4f} | {step / base_step:.2f} |"
                    )
        if args.part in ("accuracy", "both"):
            launch_local(_accuracy_worker, 2, tmp, args.seeds, args.epochs)
            acc = json.loads(Path(tmp, "accuracy.json").read_text())
            print(f"\n## BSP on the embedded default (demo CNN, digits, 2 ranks, {args.epochs} epochs): test accuracy")
            print("| seed | " + " | ".join(_label(c) for c in COMPRESSIONS) + " | bf16 - fp32 (points) |")
            print("|---:|" + "---:|" * (len(COMPRESSIONS) + 1))
            diffs = []
            for seed in args.seeds:
                row = [acc[f"{seed}/{c}"]["acc"] for c in COMPRESSIONS]
                diffs.append(100 * (acc[f"{seed}/bf16"]["acc"] - acc[f"{seed}/None"]["acc"]))
                print(f"| {seed} | " + " | ".join(f"{a:.4f}" for a in row) + f" | {diffs[-1]:+.2f} |")
            means = [statistics.mean(acc[f"{s}/{c}"]["acc"] for s in args.seeds) for c in COMPRESSIONS]
            print("| mean | " + " | ".join(f"{a:.4f}" for a in means) + f" | {statistics.mean(diffs):+.2f} |")
            ratio = acc[f"{args.seeds[0]}/bf16"]["bytes_grads"] / acc[f"{args.seeds[0]}/None"]["bytes_grads"]
            held = "holds" if abs(statistics.mean(diffs)) <= 0.5 else "does NOT hold"
            print(f"bf16 gradient bytes / fp32: {ratio:.3f}; goal (bf16 within 0.5 point of fp32, mean): {held}")


if __name__ == "__main__":
    main()
