"""DiLoCo vs local SGD vs Lightning's DDP on the embedded digits workload, 4 CPU processes.

    python benchmarks/diloco.py --sweep                              # DiLoCo's H (sync_every) vs DDP: accuracy
    python benchmarks/diloco.py --link 100mbit,1ms --target 0.95     # time to a validation accuracy, same link
    python benchmarks/diloco.py --model wide --hidden 512 --seeds 0  # the same with a communication-bound MLP

Same model (demo CNN: SGD lr 0.05, momentum 0.9, weight decay 1e-4 — DDP's configuration, which every strategy's
inner optimizer keeps), data (digits, batch 32 per rank, 10 steps per epoch on 4 ranks) and seed for every row;
validation after every epoch. ``--model wide`` trains ``WideMLP(hidden=--hidden)`` instead (wide fully connected
layers on the same inputs: syncs cost far more than a step's compute).

* ``--sweep``: DiLoCo with the paper's outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9) at several H, and DDP:
  final test accuracy of the model each run hands back, best validation accuracy, averagings. This is how the
  default ``sync_every`` was chosen (DiLoCoStrategy's docstring).
* time to target (default): every row under the same emulated link. Lightning's ``DDPStrategy`` gets the link
  through a DDP communication hook (:class:`EmulatedLinkDDP`: each gradient bucket's all-reduce completes no earlier
  than the pack's :class:`~lightning_sync.comm.LinkClock` says, the same emulation the pack's own strategies use);
  the pack's strategies through ``link=``. "train s to target" is the training time (validation excluded) until the
  validation accuracy first reached ``--target``; "-" if never.

Each rank uses ``torch.set_num_threads(1)``: 4 ranks share the machine's cores, so wall times are noisy where other
jobs run; bytes and counts do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

WORLD = 4


def emulated_link_ddp(link: str):
    """A Lightning ``DDPStrategy`` whose gradient all-reduces pay the emulated link (benchmark-only helper)."""
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from lightning_sync.comm import LinkModel
    from lightning_sync.comm.cost import allreduce_bytes
    from lightning_sync.comm.link import LinkClock

    class EmulatedLinkDDP(DDPStrategy):
        """Lightning's DDP; each bucket's all-reduce (DDP's own ``allreduce_hook``) is complete only when the
        emulated transfer of the bytes gloo's ring sends is (LinkClock: concurrent buckets share the bandwidth)."""

        def configure_ddp(self) -> None:
            super().configure_ddp()
            clock = LinkClock(LinkModel.parse(link))
            rank, world = dist.get_rank(), dist.get_world_size()
            self.bytes_sent = 0
            strategy = self

            def hook(state, bucket):  # no annotations: DDP checks them (and this module's are strings)
                tensor = bucket.buffer()
                nbytes = allreduce_bytes(tensor.numel(), tensor.element_size(), world, rank, "gloo")
                strategy.bytes_sent += nbytes
                key = clock.start(nbytes, time.perf_counter())
                fut = default_hooks.allreduce_hook(None, bucket)

                def after(f: Any) -> Any:
                    clock.sleep_until_complete(key)
                    return f.value()

                return fut.then(after)

            self.model.register_comm_hook(None, hook)

    return EmulatedLinkDDP


def _worker(
    rank: int, out_dir: str, rows_spec: list[dict], epochs: int, seeds: list[int], target: float, model_spec: dict
) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    import lightning_sync as ls
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN, WideMLP

    class Clock(Callback):
        """Training seconds (validation excluded) and validation accuracy at every validation."""

        def on_train_start(self, trainer, pl_module):
            self.start, self.val_seconds, self.points = time.perf_counter(), 0.0, []

        def on_validation_start(self, trainer, pl_module):
            self.val_start = time.perf_counter()

        def on_validation_end(self, trainer, pl_module):
            now = time.perf_counter()
            self.val_seconds += now - self.val_start
            acc = float(trainer.callback_metrics["val/acc"])
            self.points.append((now - self.start - self.val_seconds, trainer.global_step, acc))

    def make(spec: dict):
        kind, kw = spec["kind"], dict(spec.get("kwargs", {}))
        if kind == "ddp":
            if spec.get("link"):
                return emulated_link_ddp(spec["link"])()
            from lightning.pytorch.strategies import DDPStrategy

            return DDPStrategy()
        if spec.get("link"):
            kw["link"] = spec["link"]
        return getattr(ls, kind)(**kw)

    rows = []
    for seed in seeds:
        for spec in rows_spec:
            pl.seed_everything(seed)
            strategy = make(spec)
            clock = Clock()
            kw = quiet_trainer_kwargs(accelerator="cpu", devices=WORLD)
            trainer = pl.Trainer(strategy=strategy, max_epochs=epochs, callbacks=[clock], **kw)
            hp = dict(lr=0.05, momentum=0.9, weight_decay=1e-4)
            wide = model_spec["model"] == "wide"
            model = WideMLP(hidden=model_spec["hidden"], **hp) if wide else DigitsCNN(**hp)
            dm = DigitsDataModule(batch_size=32, seed=seed, flatten=wide)
            trainer.fit(model, dm)
            reached = next(((t, step) for t, step, acc in clock.points if acc >= target), None)
            stats = getattr(strategy, "comm_stats", None)
            row = {
                "name": spec["name"],
                "seed": seed,
                "steps": trainer.global_step,
                "averagings": strategy.step_counter.sync_steps if hasattr(strategy, "step_counter") else None,
                "bytes_sent": stats.total_bytes() if stats is not None else getattr(strategy, "bytes_sent", None),
                "train_s": clock.points[-1][0] if clock.points else None,
                "best_val": max(acc for _, _, acc in clock.points),
                "to_target_s": reached[0] if reached else None,
                "to_target_step": reached[1] if reached else None,
            }
            tester = pl.Trainer(strategy=ls.BSPStrategy(), **kw)  # test the model this rank holds after fit
            row["test_acc"] = float(tester.test(model, dm, verbose=False)[0]["test/acc"])
            rows.append(row)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))


NESTEROV = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}


#: the paper's outer optimizer, given explicitly: these tables were measured with it (DiLoCo's default became
#: ``"auto"`` later, SlowMo's outer step over this script's SGD; docs/strategies/diloco.md, "The outer optimizer in
#: detail")
PAPER_OUTER = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}


def sweep_rows(values: list[int]) -> list[dict]:
    rows = [{"name": "DDP", "kind": "ddp"}]
    for h in values:
        kwargs = {"sync_every": h, "outer_optimizer": PAPER_OUTER}
        rows.append({"name": f"DiLoCo(H={h})", "kind": "DiLoCoStrategy", "kwargs": kwargs})
    return rows


def target_rows(link: str, h: int) -> list[dict]:
    return [
        {"name": "DDP", "kind": "ddp", "link": link},
        {"name": f"local SGD(p={h})", "kind": "LocalSGDStrategy", "kwargs": {"period": h}, "link": link},
        {
            "name": f"DiLoCo(H={h})",
            "kind": "DiLoCoStrategy",
            "kwargs": {"sync_every": h, "outer_optimizer": PAPER_OUTER},
            "link": link,
        },
        {
            "name": f"Streaming DiLoCo(H={h}, K=4, tau=1)",
            "kind": "DiLoCoStrategy",
            "kwargs": {"sync_every": h, "fragments": 4, "delay": 1, "outer_optimizer": PAPER_OUTER},
            "link": link,
        },
    ]


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="DiLoCo's H against DDP (no link emulation)")
    parser.add_argument("--values", type=int, nargs="+", default=[4, 8, 16, 32, 64, 500], help="H values to sweep")
    parser.add_argument("--link", default="100mbit,1ms", help="emulated link of every row (time to target)")
    parser.add_argument("--sync-every", type=int, default=16, help="H of the DiLoCo and period of the local SGD rows")
    parser.add_argument("--target", type=float, default=0.95, help="validation accuracy to reach")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--model", choices=["cnn", "wide"], default="cnn", help="DigitsCNN or WideMLP")
    parser.add_argument("--hidden", type=int, default=512, help="WideMLP's width (--model wide)")
    args = parser.parse_args()

    from lightning_sync.launch import launch_local

    spec = sweep_rows(args.values) if args.sweep else target_rows(args.link, args.sync_every)
    with tempfile.TemporaryDirectory() as tmp:
        model_spec = {"model": args.model, "hidden": args.hidden}
        launch_local(_worker, WORLD, tmp, spec, args.epochs, args.seeds, args.target, model_spec)
        rows = json.loads(Path(tmp, "rank0.json").read_text())

    what = "no link emulation" if args.sweep else f"emulated link {args.link} on every row"
    model = "demo CNN" if args.model == "cnn" else f"WideMLP(hidden={args.hidden})"
    print(f"\n## DiLoCo: {model}, digits, {WORLD} ranks, {args.epochs} epochs, seeds {args.seeds}, {what}")
    print(
        f"| row | seed | steps | averagings | bytes sent / rank | train s | best val acc | train s to {args.target} "
        f"| step reached | test acc |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['name']} | {r['seed']} | {r['steps']} | {_fmt(r['averagings'])} | {_fmt(r['bytes_sent'], ',')} "
            f"| {_fmt(r['train_s'], '.2f')} | {r['best_val']:.4f} | {_fmt(r['to_target_s'], '.2f')} "
            f"| {_fmt(r['to_target_step'])} | {r['test_acc']:.4f} |"
        )
    print()
    ddp = {r["seed"]: r for r in rows if r["name"] == "DDP"}
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name]
        acc = statistics.fmean(r["test_acc"] for r in mine)
        speedups = [
            ddp[r["seed"]]["to_target_s"] / r["to_target_s"]
            for r in mine
            if r["to_target_s"] and ddp.get(r["seed"], {}).get("to_target_s")
        ]
        reached = sum(r["to_target_s"] is not None for r in mine)
        line = f"{name}: mean test acc {acc:.4f}; reached {args.target} in {reached}/{len(mine)} runs"
        if speedups and name != "DDP":
            line += f"; time to target vs DDP: {', '.join(f'{s:.2f}x' for s in speedups)} (per seed)"
        print(line)


if __name__ == "__main__":
    main()
