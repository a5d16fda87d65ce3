"""OSP vs BSP: throughput at an emulated 1 Gbit/s, 1 ms link and without emulation, and final accuracy.

    python benchmarks/osp.py                 # about two minutes on 2 CPU cores

Throughput model: WideMLP(hidden=256, depth=6) — ~350k parameters (1.4 MB of float32) in six similar layers
(OSP moves whole parameter tensors to the ICS, so one dominant layer would cap the share), batch 128 per rank — chosen
so that at 1 Gbit/s communication is at least a third of a BSP step on this machine (the script prints the measured
share). OSP runs Algorithm 1 as published: the first epoch is BSP (S(G^u)=0), then the ICS share grows as the loss
falls, up to U_max = b T_c / N (Eq. 5, capped at 80% of the model); throughput is reported over all epochs and over
epochs 2+ (after the first, BSP-like, epoch). "OSP(fixed 0.5)" bypasses Algorithm 1 with half the model in the ICS
every step (an ablation showing the overlap mechanism itself). All run in the same 2 processes, one after another.

Accuracy: the demo CNN on digits (embedded default), BSP vs OSP, same seed and epochs, test accuracy.

Each rank uses torch.set_num_threads(1).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

WORLD = 2


def _worker(rank: int, out_dir: str, epochs: int, acc_epochs: int) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_sync import BSPStrategy, OSPStrategy
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN, WideMLP

    class EpochClock(Callback):
        def __init__(self):
            self.rows = []

        def on_train_epoch_start(self, trainer, pl_module):
            self.t0, self.steps0 = time.perf_counter(), trainer.global_step

        def on_train_epoch_end(self, trainer, pl_module):
            self.rows.append([time.perf_counter() - self.t0, trainer.global_step - self.steps0])

    res: dict = {}
    batch = 128
    for link in ("1gbit,1ms", None):
        for name, make in (
            ("BSP", BSPStrategy),
            ("OSP", OSPStrategy),
            ("OSP(fixed 0.5)", lambda link: OSPStrategy(link=link, fixed_share=0.5)),
        ):
            pl.seed_everything(0)
            strategy = make(link=link)
            clock = EpochClock()
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=WORLD,
                strategy=strategy,
                max_epochs=epochs,
                limit_val_batches=0,
                callbacks=[clock],
                **quiet_trainer_kwargs(),
            )
            trainer.fit(WideMLP(hidden=256, depth=6), DigitsDataModule(batch_size=batch, flatten=True))
            m = strategy.sync_metrics()
            res[f"{name}/{link}"] = {
                "epochs": clock.rows,
                "samples_per_step": batch * WORLD,
                "blocked_s": m["blocked_s"],
                "steps": strategy.step_counter.steps,
                "ics_fraction": m.get("ics_fraction", 0.0),
                "overlap": m.get("overlap", 0.0),
                "u_max": m.get("u_max", 0.0),
            }
    for name, make in (("BSP", BSPStrategy), ("OSP", OSPStrategy)):
        pl.seed_everything(0)
        kw = quiet_trainer_kwargs(accelerator="cpu", devices=WORLD)
        model, dm = DigitsCNN(), DigitsDataModule(batch_size=32)
        pl.Trainer(strategy=make(), max_epochs=acc_epochs, limit_val_batches=0, **kw).fit(model, dm)
        result = pl.Trainer(strategy=make(), **kw).test(model, dm, verbose=False)
        res[f"acc/{name}"] = float(result[0]["test/acc"])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


def _throughput(rows: list[list[float]], samples_per_step: int, skip: int) -> float:
    seconds = sum(r[0] for r in rows[skip:])
    steps = sum(r[1] for r in rows[skip:])
    return steps * samples_per_step / seconds if seconds else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--acc-epochs", type=int, default=10)
    args = parser.parse_args()

    from lightning_sync.launch import launch_local

    with tempfile.TemporaryDirectory() as tmp:
        launch_local(_worker, WORLD, tmp, args.epochs, args.acc_epochs)
        r = json.loads(Path(tmp, "rank0.json").read_text())

    print(f"\n## OSP vs BSP throughput: WideMLP(256, 6) ~350k params, batch 128 x {WORLD} ranks, {args.epochs} epochs")
    print("| link | strategy | samples/s (all) | samples/s (epochs 2+) | blocked s / step | last ICS share | overlap |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for link in ("1gbit,1ms", "None"):
        for name in ("BSP", "OSP", "OSP(fixed 0.5)"):
            c = r[f"{name}/{link if link != 'None' else None}"]
            print(
                f"| {link} | {name} | {_throughput(c['epochs'], c['samples_per_step'], 0):,.0f} "
                f"| {_throughput(c['epochs'], c['samples_per_step'], 1):,.0f} | {c['blocked_s'] / c['steps']:.4f} "
                f"| {c['ics_fraction']:.2f} | {c['overlap']:.2f} |"
            )
    for link in ("1gbit,1ms", None):
        b = r[f"BSP/{link}"]
        step_s = sum(x[0] for x in b["epochs"][1:]) / max(1, sum(x[1] for x in b["epochs"][1:]))
        comm_share = (b["blocked_s"] / b["steps"]) / step_s if step_s else float("nan")
        base = _throughput(b["epochs"], b["samples_per_step"], 1)
        ratios = ", ".join(
            f"{name}/BSP = {_throughput(r[f'{name}/{link}']['epochs'], b['samples_per_step'], 1) / base:.2f}x"
            for name in ("OSP", "OSP(fixed 0.5)")
        )
        print(
            f"link {link}: throughput (epochs 2+) {ratios}; communication share of a BSP step = {comm_share:.2f}"
            "   (goal at 1gbit: >= 1.4x)"
        )
    print(
        f"\n## Accuracy on the embedded default (demo CNN, digits, {args.acc_epochs} epochs): "
        f"BSP {r['acc/BSP']:.4f}, OSP {r['acc/OSP']:.4f}"
    )


if __name__ == "__main__":
    main()
