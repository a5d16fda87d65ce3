"""Compressed synchronization (``compression=None | "bf16" | "int8"``): bytes and time per step, and accuracy.

    python benchmarks/compression.py                       # speed and accuracy, about 8 minutes on 2 CPU cores
    python benchmarks/compression.py --part speed          # only the bytes/time table
    python benchmarks/compression.py --part accuracy --seeds 0 1 2
    python benchmarks/compression.py --part accuracy --strategies localsgd,asp,osp --seeds 0
    python benchmarks/compression.py --part sum            # what gloo does with a bf16/fp16 SUM (seconds)

**Sum** (``--part sum``): why the compressed all-reduce never asks the backend for a low-precision SUM. ``--world``
gloo ranks all-reduce 1M normal values cast to bf16 / fp16 with gloo's own SUM, and with
``Communicator.all_reduce_compressed`` (op ``"sum"``); the mean absolute error of each against the exact (float64) sum
of the same low-precision inputs, beside the error of the fp32 sum rounded once to the format (the best a result in
that format can be). gloo's error above that floor is its rounding at every ring step.

**Speed** (``--part speed``): the communication-heavy ``WideMLP`` (hidden 2048, depth 2: ~4.3M parameters, 17 MB of
float32) on digits (batch 32 per rank), ``--world`` ranks (default 4) at an emulated ``--link`` (default
``1gbit,1ms``), BSP (gradients every step) and local SGD (``period=8``), each with fp32, bf16 and int8 syncs, one
after another in the same processes. Per row: bytes rank 0 sent per step (``sync/bytes_sent`` / steps) and the
mean wall time of a training step after the first ``--skip`` steps (workspaces and the first collectives of a
shape are set up there; local SGD's averaging steps are included in the mean), and the seconds per step rank 0 was
blocked communicating (``sync/blocked_s`` / steps: the collectives, their emulated transfers and, compressed, the
encoding and decoding; all steps, setup included). Several processes share the 2 cores
of the development machine, and the encode/decode of a compressed all-reduce is CPU work they compete for: the
times are noisy and CPU-bound; the bytes are exact.

**Accuracy** (``--part accuracy``): the embedded default (demo CNN on digits, 2 ranks, batch 32, 6 epochs as
``lightning-sync compare`` runs it), BSP (``--strategies``: any, default arguments) with fp32, bf16 and int8 syncs per
seed; test accuracy of the model ``fit`` hands back (the global model for the periodic and parameter-server
methods), and the difference to fp32 in points (the goal: bf16 within 0.5 point; the test split has
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


def _accuracy_worker(rank: int, out_dir: str, strategies: list[str], seeds: list[int], epochs: int) -> None:
    import lightning.pytorch as pl

    from lightning_sync import BSPStrategy
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN
    from lightning_sync.strategies import STRATEGIES

    classes = {cls.strategy_name: cls for cls in STRATEGIES}
    res: dict = {}
    for name in strategies:
        for seed in seeds:
            for compression in COMPRESSIONS:
                pl.seed_everything(seed)
                kw = quiet_trainer_kwargs(accelerator="cpu", devices=2)
                model, dm = DigitsCNN(), DigitsDataModule(batch_size=32)
                strategy = classes[name](compression=compression)
                pl.Trainer(strategy=strategy, max_epochs=epochs, limit_val_batches=0, **kw).fit(model, dm)
                result = pl.Trainer(strategy=BSPStrategy(), **kw).test(model, dm, verbose=False)
                res[f"{name}/{seed}/{compression}"] = {
                    "acc": float(result[0]["test/acc"]),
                    "bytes": strategy.comm_stats.total_bytes(),
                }
    if rank == 0:
        Path(out_dir, "accuracy.json").write_text(json.dumps(res))


def _sum_worker(rank: int, out_dir: str, world: int) -> None:
    import torch
    import torch.distributed as dist

    from lightning_sync.comm import CommStats, Communicator
    from lightning_sync.comm.compression import Compressor

    dist.init_process_group("gloo")  # launch_local set the torchrun-like environment
    comm = Communicator(CommStats())
    res = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        inputs = [torch.randn(1_000_000, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(world)]
        exact = torch.stack([x.double() for x in inputs]).sum(0)
        gloo = inputs[rank].clone()
        dist.all_reduce(gloo)  # the backend's SUM in the low-precision type
        ours = inputs[rank].float()
        comm.all_reduce_compressed(ours, Compressor(name), op="sum")
        floor = exact.float().to(dtype)  # the exact sum rounded once to the format
        res[name] = {
            "gloo": float((gloo.double() - exact).abs().mean()),
            "compressed": float((ours.double() - exact).abs().mean()),
            "floor": float((floor.double() - exact).abs().mean()),
        }
    if rank == 0:
        Path(out_dir, "sum.json").write_text(json.dumps(res))


def _label(compression: str | None) -> str:
    return compression or "fp32"


def _sum_table(tmp: str, world: int) -> None:
    from lightning_sync.launch import launch_local

    launch_local(_sum_worker, world, tmp, world)
    res = json.loads(Path(tmp, "sum.json").read_text())
    print(f"\n## SUM of 1M low-precision values over {world} gloo ranks: mean |error| vs the exact sum")
    print(
        "| format | gloo all_reduce (SUM in the format) | compressed all-reduce (fp32 sum) | exact sum rounded once |"
    )
    print("|---|---:|---:|---:|")
    for name, r in res.items():
        print(f"| {name} | {r['gloo']:.3g} | {r['compressed']:.3g} | {r['floor']:.3g} |")
    for name, r in res.items():
        gloo, ours = r["gloo"] / r["floor"], r["compressed"] / r["floor"]
        print(f"{name}: gloo's error is {gloo:.2f}x the rounding floor, the compressed all-reduce's {ours:.2f}x")


def _speed_table(tmp: str, world: int, link: str, epochs: int, skip: int) -> None:
    from lightning_sync.launch import launch_local

    launch_local(_speed_worker, world, tmp, world, link, epochs)
    speed = json.loads(Path(tmp, "speed.json").read_text())
    print(
        f"\n## Compressed syncs: WideMLP (~4.3M params), digits, batch 32 x {world} ranks, link {link}, "
        f"{epochs} epochs (step time: mean over the steps after the first {skip}, syncs included)"
    )
    print(
        "| strategy | compression | steps | bytes sent / step (rank 0) | vs fp32 | s / step | vs fp32 "
        "| blocked s / step | vs fp32 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("BSP", "local SGD(p=8)"):
        base = speed[f"{name}/None"]
        base_bytes = base["bytes_sent"] / base["steps"]
        base_step = statistics.mean(base["step_s"][skip:])
        base_blocked = base["blocked_s"] / base["steps"]
        for compression in COMPRESSIONS:
            r = speed[f"{name}/{compression}"]
            per_step = r["bytes_sent"] / r["steps"]
            step = statistics.mean(r["step_s"][skip:])
            blocked = r["blocked_s"] / r["steps"]
            print(
                f"| {name} | {_label(compression)} | {r['steps']} | {per_step:,.0f} | {per_step / base_bytes:.3f} "
                f"| {step:.4f} | {step / base_step:.2f} | {blocked:.4f} | {blocked / base_blocked:.2f} |"
            )


def _accuracy_table(tmp: str, strategies: list[str], seeds: list[int], epochs: int) -> None:
    from lightning_sync.launch import launch_local

    launch_local(_accuracy_worker, 2, tmp, strategies, seeds, epochs)
    acc = json.loads(Path(tmp, "accuracy.json").read_text())
    for name in strategies:
        print(f"\n## {name} on the embedded default (demo CNN, digits, 2 ranks, {epochs} epochs): test accuracy")
        print("| seed | " + " | ".join(_label(c) for c in COMPRESSIONS) + " | bf16 - fp32 (points) | int8 - fp32 |")
        print("|---:|" + "---:|" * (len(COMPRESSIONS) + 2))
        diffs: dict[str, list[float]] = {"bf16": [], "int8": []}
        for seed in seeds:
            row = [acc[f"{name}/{seed}/{c}"]["acc"] for c in COMPRESSIONS]
            for c in diffs:
                diffs[c].append(100 * (acc[f"{name}/{seed}/{c}"]["acc"] - acc[f"{name}/{seed}/None"]["acc"]))
            cells = " | ".join(f"{a:.4f}" for a in row)
            print(f"| {seed} | {cells} | {diffs['bf16'][-1]:+.2f} | {diffs['int8'][-1]:+.2f} |")
        means = [statistics.mean(acc[f"{name}/{s}/{c}"]["acc"] for s in seeds) for c in COMPRESSIONS]
        cells = " | ".join(f"{a:.4f}" for a in means)
        print(f"| mean | {cells} | {statistics.mean(diffs['bf16']):+.2f} | {statistics.mean(diffs['int8']):+.2f} |")
        ratios = ", ".join(
            f"{c} {acc[f'{name}/{seeds[0]}/{c}']['bytes'] / acc[f'{name}/{seeds[0]}/None']['bytes']:.3f}"
            for c in ("bf16", "int8")
        )
        held = "holds" if abs(statistics.mean(diffs["bf16"])) <= 0.5 else "does NOT hold"
        print(f"bytes sent / fp32: {ratios}; bf16 within 0.5 point of fp32 (mean): {held}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("speed", "accuracy", "sum", "both"), default="both")
    parser.add_argument("--world", type=int, default=4, help="ranks of the speed and sum parts")
    parser.add_argument("--link", default="1gbit,1ms", help="emulated link of the speed part")
    parser.add_argument("--speed-epochs", type=int, default=3)
    parser.add_argument("--skip", type=int, default=3, help="first steps of each run left out of the step time")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=6, help="epochs of the accuracy part")
    parser.add_argument("--strategies", default="bsp", help="strategies of the accuracy part, comma-separated names")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.part == "sum":
            _sum_table(tmp, args.world)
        if args.part in ("speed", "both"):
            _speed_table(tmp, args.world, args.link, args.speed_epochs, args.skip)
        if args.part in ("accuracy", "both"):
            _accuracy_table(tmp, [n.strip() for n in args.strategies.split(",") if n.strip()], args.seeds, args.epochs)


if __name__ == "__main__":
    main()
