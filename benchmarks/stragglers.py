"""Cluster throughput with and without one x4 straggler: BSP, ASP, SSP(s=4), ALADDIN(pi=4); 4 CPU processes.

    python benchmarks/stragglers.py                # 4 processes, 3 repeats: about 5 minutes on 2 CPU cores
    python benchmarks/stragglers.py --world 2      # as many processes as this machine's cores
    python benchmarks/stragglers.py --epochs 10 --slowdown 10
    python benchmarks/stragglers.py --strategies "BSP,ALADDIN(pi=4),ALADDIN-sum(pi=4)" --repeats 1   # Alg. 2 as printed

Same model (demo CNN), data (digits), seed, epochs and optimizer (SGD, lr 0.05, momentum 0.9) for every strategy.
For each strategy two fits run back to back in the same processes: without a straggler, and with rank 3 slowed by
``--slowdown`` times its own measured step time (:class:`~lightning_sync.callbacks.StragglerInjection`). Reported:

* cluster throughput = samples trained by all ranks / training wall time (the slowest rank's, from on_train_start to
  on_train_end), and its ratio straggler / no straggler — the issue's goal: ASP and ALADDIN keep >= 0.75 of their
  straggler-free throughput while BSP falls to <= 0.3 (ALADDIN §5.4);
* how many of the epoch's batches the straggler trained (with dynamic work assignment the others take the rest);
* test accuracy of the model each fit hands back (the global model for the parameter-server methods).

Each rank uses ``torch.set_num_threads(1)``. With more ranks than cores (4 on a 2-core machine) the ranks share cores:
the straggler's factor applies to its own step time, which is shorter while the others sleep or wait, and a sleeping
straggler frees a core for the others. BSP then loses less than the factor says (x4 slowdown of a rank that runs 2x
faster alone: about 0.5 instead of 0.25). ``--world`` equal to the number of cores avoids that. The ratios are
measured side by side in one run: compare them with each other, not with another machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _worker(
    rank: int, world: int, out_dir: str, epochs: int, slowdown: float, seed: int, names: list[str], repeats: int
) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    from lightning_sync import ALADDINStrategy, ASPStrategy, BSPStrategy, SSPStrategy
    from lightning_sync.callbacks import StragglerInjection
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    makers = {
        "BSP": BSPStrategy,
        # update_scale=1.0: every push is the worker's full step, as Hogwild and the committed tables (the library's
        # default, "auto", scales pushes by 1/m so the model's rate is DDP's): rows "ASP(auto)", "SSP(s=4, auto)"
        "ASP": lambda: ASPStrategy(update_scale=1.0),
        "SSP(s=4)": lambda: SSPStrategy(staleness=4, update_scale=1.0),
        "ASP(auto)": ASPStrategy,
        "SSP(s=4, auto)": lambda: SSPStrategy(staleness=4),
        "ALADDIN(pi=4)": lambda: ALADDINStrategy(period=4),
        # Alg. 2 line 8 as printed (plain sum); not in the default list
        "ALADDIN-sum(pi=4)": lambda: ALADDINStrategy(period=4, aggregate="sum"),
    }

    class Meter(Callback):
        def __init__(self) -> None:
            self.samples = 0
            self.batches = 0
            self.start = self.end = 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.samples += len(batch[1])
            self.batches += 1

        def on_train_end(self, trainer, pl_module) -> None:
            self.end = time.perf_counter()

    def one_run(name: str, straggle: bool, repeat: int) -> dict:
        pl.seed_everything(seed)
        meter = Meter()
        callbacks = [meter]
        if straggle:
            callbacks.append(StragglerInjection(ranks=world - 1, slowdown=slowdown))
        kw = quiet_trainer_kwargs(accelerator="cpu", devices=world)
        trainer = pl.Trainer(strategy=makers[name](), max_epochs=epochs, limit_val_batches=0, callbacks=callbacks, **kw)
        model = DigitsCNN(lr=0.05, momentum=0.9)
        dm = DigitsDataModule(batch_size=32, seed=seed)
        trainer.fit(model, dm)
        tester = pl.Trainer(strategy=makers[name](), **kw)
        acc = float(tester.test(model, dm, verbose=False)[0]["test/acc"])
        dist.barrier()
        return {
            "strategy": name,
            "straggler": straggle,
            "repeat": repeat,
            "rank": rank,
            "samples": meter.samples,
            "batches": meter.batches,
            "seconds": meter.end - meter.start,
            "test_acc": acc,
        }

    # interleaved: every repeat runs every (strategy, straggler) pair once, so drift in the machine's speed hits all
    rows = [one_run(name, straggle, r) for r in range(repeats) for name in names for straggle in (False, True)]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4, help="processes (default 4)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--slowdown", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each pair, interleaved; medians reported")
    parser.add_argument("--strategies", default="BSP,ASP,SSP(s=4),ALADDIN(pi=4)")
    args = parser.parse_args()
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]

    from lightning_sync.launch import launch_local

    with tempfile.TemporaryDirectory() as tmp:
        launch_local(
            _worker, args.world, args.world, tmp, args.epochs, args.slowdown, args.seed, names, args.repeats, threads=1
        )
        rows = [row for r in range(args.world) for row in json.loads((Path(tmp) / f"rank{r}.json").read_text())]

    def run(name: str, straggle: bool) -> dict:
        throughputs, shares, accs, seconds = [], [], [], []
        for r in range(args.repeats):
            mine = [x for x in rows if x["strategy"] == name and x["straggler"] == straggle and x["repeat"] == r]
            wall = max(x["seconds"] for x in mine)  # the slowest rank's training time
            throughputs.append(sum(x["samples"] for x in mine) / wall)
            seconds.append(wall)
            straggler = next(x["batches"] for x in mine if x["rank"] == args.world - 1)
            shares.append(straggler / sum(x["batches"] for x in mine))
            accs.append(mine[0]["test_acc"])
        return {
            "throughput": statistics.median(throughputs),
            "throughputs": throughputs,
            "seconds": seconds,
            "straggler_share": statistics.median(shares),
            "acc": statistics.mean(accs),
        }

    print(
        f"\n{args.world} CPU processes (1 thread each), digits CNN, {args.epochs} epochs, rank {args.world - 1} slowed "
        f"x{args.slowdown:g} in the straggler runs; median of {args.repeats} interleaved runs (test acc: mean)\n"
    )
    header = (
        "| strategy | samples/s | samples/s, straggler | ratio | straggler's share of batches | "
        "test acc | test acc, straggler |"
    )
    print(header)
    print("|" + "---|" * 7)
    results = {}
    for name in names:
        base, slow = run(name, False), run(name, True)
        results[name] = {"no_straggler": base, "straggler": slow, "ratio": slow["throughput"] / base["throughput"]}
        print(
            f"| {name} | {base['throughput']:.0f} | {slow['throughput']:.0f} | "
            f"{slow['throughput'] / base['throughput']:.2f} | {slow['straggler_share']:.2f} | "
            f"{base['acc']:.4f} | {slow['acc']:.4f} |"
        )
    ideal = (args.world - 1 + 1 / args.slowdown) / args.world
    print(
        f"\nideal ratio for a method no worker waits in: (n - 1 + 1/slowdown) / n = {ideal:.2f} "
        "(the others' throughput plus the straggler's reduced one)"
    )
    bsp = results.get("BSP")
    if bsp:
        print()
        for name, r in results.items():
            if name == "BSP":
                continue
            free = r["no_straggler"]["throughput"] / bsp["no_straggler"]["throughput"]
            slow = r["straggler"]["throughput"] / bsp["straggler"]["throughput"]
            print(f"{name}: throughput {free:.2f}x BSP's without the straggler, {slow:.2f}x BSP's with it")
    print("\n" + json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
